#!/usr/bin/env python3
"""kvevict beside NVIDIA kvpress on the same Hugging Face transformers model, prompts and budgets.

The model is stories260K converted to a transformers ``LlamaForCausalLM`` by kvevict's own converter
(``kvevict.models.hf.to_transformers``). Excerpts: non-overlapping ``--prompt``-token windows of
sherlock.txt (and of the King James Bible with ``--kjv FILE``, scripts/kjv_text.sh), each followed by
the full cache's greedy continuation of ``--steps`` tokens (teacher-forced into every row, the
fidelity report's protocol). For every keep (the fraction kept, 1 - kvpress's compression_ratio)
each row prefills through its press, then decodes the continuation; KL(full || evicted) of the
next-token distributions, mean over the steps (fp64, nats).

Rows where the definitions coincide (the pair's kept sets are compared per layer and KV head):
  StreamingLLM  kvpress StreamingLLMPress(n_sink=4)         kvevict streaming_llm (4 sinks + recent)
  KeyNorm       kvpress KnormPress                          kvevict key_norm (window 0: no protection)
  SnapKV        kvpress SnapKVPress(window_size=32, kernel_size=5)   kvevict snapkv (window 32, avg-pool 5)
  TOVA          kvpress TOVAPress                           kvevict tova (last query, mean over the layer's heads)
Rows of one side only: kvpress ExpectedAttentionPress and AdaKVPress(SnapKVPress) (head-wise by masking keys,
no memory freed); kvevict restkv, criticalkv, pyramidkv, h2o. Time per eviction = time inside the press's
compress over all layers of one prefill (median over excerpts), in the same run.

Needs a venv with a current torch, transformers (4.56 <= version < 5: kvpress 0.5.2 reads the attention
module's ``past_key_values`` keyword, which transformers 5 renamed) and kvpress, plus kvevict installed
(``pip install .``). Writes a markdown table to stdout and the per-excerpt rows to ``--csv``.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch

import kvevict
from kvevict.hf import Press as KvevictPress
from kvevict.models import hf as hfm
from kvevict.models import llama2c
from kvevict.models.tokenizer import Tokenizer

KEEPS = (0.1, 0.2, 0.3, 0.5)


def excerpts(path: str, tok: Tokenizer, n: int, length: int):
    """n non-overlapping excerpts of `length` tokens (BOS + length - 1), starting at paragraph starts spread
    evenly over the text (each encoded from a 4 * length character span: about 1.7 characters per token)."""
    text = open(path, encoding="utf-8", errors="replace").read()
    span = 4 * length
    starts, pos, stride = [], 0, max(span, (len(text) - span) // max(n, 1))
    while len(starts) < n and pos + span <= len(text):
        p = text.find("\n\n", pos)
        p = pos if p < 0 else p + 2
        if p + span > len(text):
            break
        starts.append(p)
        pos = max(p + span, pos + stride)
    out = []
    for p in starts:
        ids = tok.encode(" ".join(text[p:p + span].split()), bos=False)
        if len(ids) >= length - 1:
            out.append([1] + ids[:length - 1])
    return out


def run(model, prompt, fed, press_ctx=None):
    """log-softmax after each fed token (fp64); the cache prefilled through press_ctx when given."""
    from transformers import DynamicCache
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if press_ctx is None:
            out = model(ids, past_key_values=cache)
        else:
            with press_ctx:
                out = model(ids, past_key_values=cache)
        logp = []
        last = out.logits[0, -1]
        for i, t in enumerate(fed):
            o = model(torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[len(prompt) + i]]))
            logp.append(torch.log_softmax(o.logits[0, -1].double(), dim=-1))
    return logp, cache, last


def kl(full, ev):
    return sum(max(float((a.exp() * (a - b)).sum()), 0.0) for a, b in zip(full, ev)) / len(full)


class Recorder:
    """Wraps a kvpress press: times its compress and records the kept positions per (layer, head)
    (from its own score and kvpress's ScorerPress rule, n_kept = int(L * (1 - compression_ratio)))."""

    def __init__(self, press):
        self.press, self.seconds, self.kept = press, 0.0, {}
        inner = press.press if hasattr(press, "press") and hasattr(press.press, "score") else press
        orig = press.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            t0 = time.perf_counter()
            k2, v2 = orig(module, hidden_states, keys, values, attentions, kwargs)
            self.seconds += time.perf_counter() - t0
            if hasattr(inner, "score") and not hasattr(press, "alpha_safeguard"):
                s = inner.score(module, hidden_states, keys, values, attentions, kwargs)
                n = int(keys.shape[2] * (1 - inner.compression_ratio))
                idx = s.topk(n, dim=-1).indices.sort(dim=-1).values
                for h in range(idx.shape[1]):
                    self.kept[(module.layer_idx, h)] = idx[0, h].tolist()
            return k2, v2

        press.compress = compress


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "text", "sherlock.txt"))
    ap.add_argument("--kjv", default=None, help="a second text (scripts/kjv_text.sh output)")
    ap.add_argument("--excerpts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=448)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--keeps", default=",".join(str(k) for k in KEEPS))
    ap.add_argument("--csv", default="kvpress_vs_kvevict.csv")
    a = ap.parse_args()
    import kvpress
    from kvpress import (AdaKVPress, ExpectedAttentionPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress)
    import transformers

    torch.set_num_threads(1)
    model = hfm.to_transformers(llama2c.load_llama2c())
    tok = Tokenizer()
    texts = [("sherlock", a.text)] + ([("kjv", a.kjv)] if a.kjv else [])
    keeps = [float(k) for k in a.keeps.split(",")]
    pairs = [("StreamingLLM", lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=4), "streaming_llm"),
             ("KeyNorm", lambda cr: KnormPress(compression_ratio=cr), "key_norm"),
             ("SnapKV", lambda cr: SnapKVPress(compression_ratio=cr, window_size=32, kernel_size=5), "snapkv"),
             ("TOVA", lambda cr: TOVAPress(compression_ratio=cr), "tova")]
    only_kvpress = [("ExpectedAttention", lambda cr: ExpectedAttentionPress(compression_ratio=cr)),
                    ("AdaKV(SnapKV)", lambda cr: AdaKVPress(SnapKVPress(compression_ratio=cr, window_size=32, kernel_size=5)))]
    only_kvevict = ["restkv", "criticalkv", "pyramidkv", "h2o"]
    rows = []
    print(f"# kvevict {kvevict.__version__} vs kvpress {getattr(kvpress, '__version__', '0.5.x')} on transformers "
          f"{transformers.__version__}, torch {torch.__version__}, 1 thread; stories260K (LlamaForCausalLM)", file=sys.stderr)
    for tname, path in texts:
        for e, prompt in enumerate(excerpts(path, tok, a.excerpts, a.prompt)):
            full, _, last = run(model, prompt, [])
            fed, nxt = [], int(last.argmax())
            with torch.no_grad():  # the full cache's greedy continuation
                from transformers import DynamicCache
                cache = DynamicCache()
                model(torch.tensor([prompt]), past_key_values=cache)
                for i in range(a.steps):
                    fed.append(nxt)
                    o = model(torch.tensor([[nxt]]), past_key_values=cache, position_ids=torch.tensor([[len(prompt) + i]]))
                    nxt = int(o.logits[0, -1].argmax())
            full, _, _ = run(model, prompt, fed)
            for keep in keeps:
                cr = 1.0 - keep
                for name, make, method in pairs:
                    kp = make(cr)
                    rec = Recorder(kp)
                    lp, _, _ = run(model, prompt, fed, kp(model))
                    ke = KvevictPress(method, compression_ratio=cr)
                    lq, _, _ = run(model, prompt, fed, ke(model))
                    same = total = 0
                    for (l, h), kept in rec.kept.items():
                        total += 1
                        same += kept == ke.selections[l].indices[ke.selections[l].indptr[h]:ke.selections[l].indptr[h + 1]].tolist()
                    rows.append(dict(text=tname, excerpt=e, keep=keep, row=name, kvpress_kl=kl(full, lp), kvevict_kl=kl(full, lq),
                                     same_sets=f"{same}/{total}", kvpress_ms=1e3 * rec.seconds, kvevict_ms=1e3 * ke.seconds))
                for name, make in only_kvpress:
                    kp = make(cr)
                    rec = Recorder(kp)
                    lp, _, _ = run(model, prompt, fed, kp(model))
                    rows.append(dict(text=tname, excerpt=e, keep=keep, row=name, kvpress_kl=kl(full, lp), kvevict_kl=float("nan"),
                                     same_sets="", kvpress_ms=1e3 * rec.seconds, kvevict_ms=float("nan")))
                for method in only_kvevict:
                    ke = KvevictPress(method, compression_ratio=cr)
                    lq, _, _ = run(model, prompt, fed, ke(model))
                    rows.append(dict(text=tname, excerpt=e, keep=keep, row=method, kvpress_kl=float("nan"), kvevict_kl=kl(full, lq),
                                     same_sets="", kvpress_ms=float("nan"), kvevict_ms=1e3 * ke.seconds))
            print(f"  {tname} excerpt {e} done", file=sys.stderr)
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    # summary: per text, keep and row: mean KL of each side, paired difference and its SE, sets, median ms
    print("| text | keep | row | kvpress KL | kvevict KL | paired diff (kvevict - kvpress) +- SE | equal kept sets | kvpress ms | kvevict ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    keyset = []
    for r in rows:
        k = (r["text"], r["keep"], r["row"])
        if k not in keyset:
            keyset.append(k)
    for k in keyset:
        rs = [r for r in rows if (r["text"], r["keep"], r["row"]) == k]
        n = len(rs)
        mp = statistics.fmean(r["kvpress_kl"] for r in rs)
        me = statistics.fmean(r["kvevict_kl"] for r in rs)
        d = [r["kvevict_kl"] - r["kvpress_kl"] for r in rs]
        diff = "" if math.isnan(mp) or math.isnan(me) else \
            f"{statistics.fmean(d):+.5f} +- {(statistics.stdev(d) / math.sqrt(n)) if n > 1 else 0:.5f}"
        sets = ""
        if rs[0]["same_sets"]:
            s = sum(int(r["same_sets"].split("/")[0]) for r in rs)
            t = sum(int(r["same_sets"].split("/")[1]) for r in rs)
            sets = f"{s}/{t}"
        f = lambda x: "" if math.isnan(x) else f"{x:.5f}"
        ms = lambda key: "" if math.isnan(rs[0][key]) else f"{statistics.median(r[key] for r in rs):.2f}"
        print(f"| {k[0]} | {k[1]:.0%} | {k[2]} | {f(mp)} | {f(me)} | {diff} | {sets} | {ms('kvpress_ms')} | {ms('kvevict_ms')} |")
    print(f"\n{len(rows)} runs; per-excerpt rows in {a.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
