# SPDX-License-Identifier: Apache-2.0
"""Writes the character windows of sherlock.txt that LKV's training contexts came from
(artifacts/lkv/train_windows.txt), so that the fidelity report can leave out the excerpts that
overlap them (examples/fidelity/fidelity_main.cpp, docs/fidelity.md "Excerpts").

Both committed artifacts (stories260K.lkv, stories260K_decode.lkv) were trained with train.py's
defaults (seed 1234, 80 contexts of 448 + 32 tokens; artifacts/lkv/train_log*.txt): the contexts
are the first 80 paragraph starts of train.py's seeded shuffle whose window holds enough tokens
(train.train_excerpts, the first use of the seeded generator). This script repeats exactly that
draw (train.train_excerpt_windows) and writes each context's window [start, start + chars) as byte offsets of the text (train.py counts characters).

    /usr/bin/python3 tools/lkv/train_windows.py [--text ../shared/data/text/sherlock.txt] [--out FILE]
"""
import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train  # noqa: E402  (tools/lkv/train.py: the same data code)
from llama2c import default_model_dir  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def fnv1a64(data: bytes) -> int:
    """FNV-1a, 64 bits: the fingerprint of the text (examples/engine/report_util.hpp computes the same)."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def training_windows(tok, text: str, n: int, tokens: int, seed: int):
    """[(start, end)] character windows of train.train_excerpts(tok, text, n, tokens, Random(seed))."""
    return [(s, e) for s, e, _ in train.train_excerpt_windows(tok, text, n, tokens, random.Random(seed))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=train.DEFAULT_TEXT)
    ap.add_argument("--tokenizer", default=os.path.join(default_model_dir(), "tok512.bin"))
    ap.add_argument("--out", default=os.path.join(train.REPO, "artifacts", "lkv", "train_windows.txt"))
    ap.add_argument("--rows", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=448 + 32, help="context + continuation tokens per row")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    with open(a.text, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    tok = Tokenizer(a.tokenizer, 512)
    wins = training_windows(tok, text, a.rows, a.tokens, a.seed)
    if len(wins) != a.rows:
        raise SystemExit(f"only {len(wins)} windows")
    with open(a.out, "w") as f:
        f.write("# LKV's training contexts (artifacts/lkv/stories260K.lkv and stories260K_decode.lkv): byte windows\n")
        f.write("# [start, end) of the text below, written by tools/lkv/train_windows.py (train.py's seeded draw).\n")
        f.write(f"text {os.path.basename(a.text)} bytes {len(raw)} fnv1a64 {fnv1a64(raw):016x}\n")
        for s, e in sorted(wins):  # train.py counts characters; the C++ report counts bytes
            f.write(f"{len(text[:s].encode())} {len(text[:e].encode())}\n")
    print(f"wrote {len(wins)} windows to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
