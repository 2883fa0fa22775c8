#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the seed corpus of tests/fuzz/fuzz_sharded.cpp (tests/fuzz/corpus_sharded/).

Byte format (read front to back by fuzz_sharded.cpp; zeros once the input ends): preset (bits 0-2 % 6:
adakv, critical_adakv, pyramidkv, lkv, adakv_published, snapkv; bits 3-4 the storage type: 0 and 3
fp32, 1 fp16, 2 bf16), shape (bits 0-1 ranks - 1, at most the KV
heads; 2 batch - 1; 3-7 % 3 group - 1), fault (bit 7 set: fault % 14 of none, a head twice, a head
missing, a head outside the layer, budget, sinks, gqa, dtype, group, window, layer_idx,
global_kv_heads, a bad length, capacity; bit 6 the high side), shard layout (bits 0-1 contiguous /
strided / shuffled; the rest the cuts), flags (bit 0 ragged lengths, 1 check_finite off, 2 tied
keys, 3 odd heads copying the head before), KV heads - 1 (% 6), seq - 1 (% 32), window - 1, head_dim - 1
(% 8), value seed (4 bytes), NaN rate, lengths (ragged), budget (bit 0 tokens, then a byte),
parameter mutation flag, layers - 1, layer index, LKV hidden size - 1 (lkv).
Usage: python3 tests/fuzz/make_seeds_sharded.py   (deterministic; rewrites its named seeds and keeps
the other files: inputs merged from fuzzing runs, `fuzz_sharded -merge=1 tests/fuzz/corpus_sharded DIR`)
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus_sharded")
NAMES = ["adakv", "critical_adakv", "pyramidkv", "lkv", "adakv_published", "snapkv"]
FAULTS = ["none", "head_twice", "head_missing", "head_outside", "budget", "sinks", "gqa", "dtype", "group", "window",
          "layer_idx", "global_heads", "bad_length", "capacity"]


def seed(preset, *, dtype=0, ranks=2, B=1, G=2, fault=0, high=False, layout=0, cut=0, ragged=False, unchecked=False, ties=False,
         copies=False, H=4, S=24, W=4, d=8, value_seed=3, rate=0, lens=None, tokens=None, fraction=80, layers=3, layer=1, hid=2):
    f = 0
    if fault:
        f = 128 + ((fault - 128) % 14)
        if high:
            f |= 64
            f = f - (f % 14) + fault if (f - (f % 14) + fault) >= 192 else f - (f % 14) + fault + 14
    flags = (1 if ragged else 0) | (2 if unchecked else 0) | (4 if ties else 0) | (8 if copies else 0)
    b = bytearray([preset | (dtype << 3), (ranks - 1) | ((B - 1) << 2) | ((G - 1) << 3), f, layout | (cut << 2), flags])
    b += bytes([H - 1, S - 1, W - 1, d - 1])
    b += struct.pack("<I", value_seed)
    b.append(rate)
    if ragged:
        b += bytes(lens)
    b += bytes([1, tokens]) if tokens is not None else bytes([0, fraction])
    b += bytes([0, layers - 1, layer])
    if preset == 3:
        b.append(hid - 1)
    return b


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    for p in range(6):
        for ranks in (1, 2, 3, 4):
            for layout in (0, 1, 2):
                seeds["s_%s_r%d_l%d" % (NAMES[p], ranks, layout)] = seed(p, dtype=(ranks + layout) % 3, ranks=ranks, layout=layout, H=4 + layout % 3,
                                                                      G=1 + (ranks + layout) % 3, cut=ranks + layout,
                                                                      value_seed=10 * p + ranks)
        seeds["s_%s_ragged" % NAMES[p]] = seed(p, ranks=3, B=2, H=5, ragged=True, lens=[24, 20, 3, 0, 24, 11, 9, 24, 1, 7], tokens=6)
        seeds["s_%s_ties" % NAMES[p]] = seed(p, ranks=2, ties=True, copies=True, tokens=5)
        seeds["s_%s_nan" % NAMES[p]] = seed(p, ranks=3, rate=6, value_seed=99)
        seeds["s_%s_nan_unchecked" % NAMES[p]] = seed(p, ranks=3, rate=6, unchecked=True, value_seed=98)
        for fault in range(1, 14):
            for high in (False, True):
                name = "f_%s_%s%s" % (NAMES[p], FAULTS[fault], "_hi" if high else "")
                seeds[name] = seed(p, dtype=fault % 3, ranks=2 + (fault + p) % 3, fault=fault, high=high, H=4, layout=fault % 3, ragged=(fault == 12),
                                   lens=[24, 23, 22, 21], value_seed=fault)
    for name, b in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(b)
    print("wrote %d seeds to %s" % (len(seeds), OUT))


if __name__ == "__main__":
    main()
