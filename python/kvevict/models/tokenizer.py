# SPDX-License-Identifier: Apache-2.0
"""llama2.c tokenizer (tokenizer.bin format), encode and decode, standard library only.

Format: int32 max_token_length, then vocab_size records {float32 score, int32 len, len bytes}.
Encoding follows llama2.c ``encode``: optional BOS (1), the piece for " " as a dummy prefix when
the text is non-empty, one piece per UTF-8 character (byte fallback: id = byte + 3 when the
character has no piece), then repeatedly merge the adjacent pair whose concatenation is a piece
with the highest score (first such pair on ties). Decoding drops BOS/EOS, strips the leading
space of the piece right after BOS and maps <0xXX> pieces to raw bytes.
"""

from __future__ import annotations

import os
import re
import struct
from typing import List, Optional, Sequence

__all__ = ["Tokenizer", "BOS", "EOS"]

BOS = 1
EOS = 2
_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")


def _default_model_dir() -> str:
    """Same rule as llama2c.default_model_dir (kept here so this file stands alone)."""
    env = os.environ.get("KVEVICT_MODEL_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    d = here
    for _ in range(6):  # the checkout (python/kvevict/models) or a build tree inside it (<build>/python/kvevict/models)
        d = os.path.dirname(d)
        cand = os.path.join(os.path.dirname(d), "shared", "models", "stories260K")
        if os.path.isfile(os.path.join(cand, "stories260K.bin")):
            return os.path.normpath(cand)
    return os.path.normpath(os.path.join(here, "..", "..", "..", "..", "shared", "models", "stories260K"))


class Tokenizer:
    def __init__(self, path: Optional[str] = None, vocab_size: int = 512):
        if path is None:
            path = os.path.join(_default_model_dir(), "tok512.bin")
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 4:
            raise ValueError(f"{path}: truncated tokenizer file ({len(data)} bytes)")
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        off = 4
        self.pieces: List[bytes] = []
        self.scores: List[float] = []
        for i in range(vocab_size):
            if off + 8 > len(data):
                raise ValueError(f"{path}: truncated tokenizer file at record {i} of {vocab_size}")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or off + n > len(data):
                raise ValueError(f"{path}: truncated or corrupt tokenizer record {i} (len {n})")
            self.pieces.append(data[off:off + n])
            self.scores.append(score)
            off += n
        if off != len(data):
            raise ValueError(f"{path}: wrong size: {len(data) - off} trailing bytes after "
                             f"{vocab_size} records")
        # first id wins for duplicate pieces (llama2.c uses bsearch over sorted unique pieces)
        self.lookup = {}
        for i, p in enumerate(self.pieces):
            self.lookup.setdefault(p, i)
        self.vocab_size = vocab_size

    # ------------------------------------------------------------------------------------------
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        ids: List[int] = []
        if bos:
            ids.append(BOS)
        if text:
            ids.append(self.lookup[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            pid = self.lookup.get(b)
            if pid is not None:
                ids.append(pid)
            else:
                ids.extend(c + 3 for c in b)
        start = 1 if bos else 0  # BOS never merges
        while True:
            best_score, best_idx, best_id = -1e10, -1, -1
            for i in range(start, len(ids) - 1):
                merged = self.pieces[ids[i]] + self.pieces[ids[i + 1]]
                pid = self.lookup.get(merged)
                if pid is not None and self.scores[pid] > best_score:
                    best_score, best_idx, best_id = self.scores[pid], i, pid
            if best_idx < 0:
                break
            ids[best_idx:best_idx + 2] = [best_id]
        if eos:
            ids.append(EOS)
        return ids

    def piece_bytes(self, prev: int, tok: int) -> bytes:
        """Bytes of one token as llama2.c ``decode(prev, tok)`` prints them."""
        if tok in (BOS, EOS):
            return b""
        p = self.pieces[tok]
        if prev == BOS and p.startswith(b" "):
            p = p[1:]
        m = _BYTE_PIECE.match(p)
        if m:
            return bytes([int(m.group(1), 16)])
        return p

    def decode(self, ids: Sequence[int], prev: int = -1) -> str:
        """Decode ids to text. ``prev`` is the token before ids[0] (pass BOS to strip the
        leading space of a continuation of [BOS])."""
        out = bytearray()
        for t in ids:
            out += self.piece_bytes(prev, int(t))
            prev = int(t)
        return out.decode("utf-8", errors="replace")
