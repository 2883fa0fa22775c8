#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the seed corpus of tests/fuzz/fuzz_views.cpp (tests/fuzz/corpus_views/).

Byte format (read front to back by fuzz_views.cpp; zeros once the input ends): preset (fuzz_evictor's
numbering, % 15), storage type (% 3), flags (bit 0 NHD, 1 queries, 2 ragged lengths, 3 check_finite
off, 4 positions, 6-7 threads), view (bits 0-2 page size 1, 1, 2, 3, 4, 8, 16, 64; 3-4 pool NHD / HND
/ token-innermost; 5 per-(sequence, KV head) tables; 6 one-head pages; 7 no last_page_len), view
options (% 3 start offsets none / every row / no extra page; bit 2 descending page ids; 3-4 spare
pages - 1; 5 protected prefix), corruption (% 11: none, indptr[0], a negative page count, too many
pages, an index out of range, a repeated index, last_page_len, start_offset, lengths,
protected_prefix, max_pages_per_row; bit 7 the high side), its row, then batch, KV heads, group,
seq, window, head_dim, row pad (each byte mod its range), lengths (ragged), budget (bit 0 tokens, then
a byte), parameter mutation flag, layers, layer index, value seed (4 bytes), poison, NaN rate, the
LKV table byte (LKV presets), prefix lengths (with a prefix), workspace fill, dense-compaction byte.
Usage: python3 tests/fuzz/make_seeds_views.py   (deterministic; rewrites its named seeds and keeps
the other files: inputs merged from fuzzing runs, `fuzz_views -merge=1 tests/fuzz/corpus_views DIR`)
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus_views")
NAMES = ["restkv", "snapkv", "pyramidkv", "adakv", "h2o", "tova", "streaming_llm", "key_norm", "criticalkv",
         "critical_adakv", "adakv_published", "lkv", "lkv_uniform_budgets", "lkv_budgets_restkv", "lkv_budgets_attention"]
CORRUPT = ["none", "indptr_first", "indptr_negative", "indptr_too_many", "index_out_of_range", "index_repeated",
           "last_page_len", "start_offset", "lengths", "prefix", "max_pages"]


def mod_byte(value, modulus, high=False):
    """A byte b with b % modulus == value, >= 128 when high."""
    return value + (((128 - value + modulus - 1) // modulus) * modulus if high else 0)


def seed(preset, dtype, *, nhd=False, ragged=False, positions=False, threads=1, page=2, pool=0, per_head=False,
         one_head=False, no_last=False, start=0, reversed_ids=False, spare=0, prefix=None, corrupt=0, high=False,
         row=0, B=2, H=2, G=2, S=24, W=4, D=8, pad=1, lens=None, tokens=None, fraction=102, layers=2, layer=1,
         value_seed=7, rate=0, compact=0, fill=0x5a):
    flags = (1 if nhd else 0) | (4 if ragged else 0) | (16 if positions else 0) | (threads << 6)
    view = page | (pool << 3) | (32 if per_head else 0) | (64 if one_head else 0) | (128 if no_last else 0)
    opts = start | (4 if reversed_ids else 0) | (spare << 3) | (32 if prefix is not None else 0)
    b = bytearray([preset, dtype, flags, view, opts, mod_byte(corrupt, 11, high), row])
    b += bytes([B - 1, H - 1, G - 1, S - 1, W - 1, D - 1, pad])
    if ragged:
        b += bytes(lens)
    b += bytes([1, tokens]) if tokens is not None else bytes([0, fraction])
    b += bytes([0, layers - 1, layer])
    b += struct.pack("<I", value_seed)
    b += bytes([8, rate])  # poison: special(8) = 0.0
    if preset >= 11:
        b.append(0x41)  # LKV tables: hidden 2, num_tokens = the capacity
    if prefix is not None:
        b += bytes(prefix)
    b += bytes([fill, compact])
    return b


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    ragged = [24, 17, 3, 0]
    for p in range(15):
        for t in (p % 3, (p + 1) % 3):
            # a clean table of every page size, pool and table kind over the presets
            seeds["v%02d_t%d_page%d" % (p, t, (p + t) % 8)] = seed(p, t, page=(p + t) % 8, pool=p % 3, per_head=bool(t & 1),
                                                                  one_head=bool(p & 1), nhd=bool(p & 2), positions=bool(p & 4))
        seeds["v%02d_ragged_start" % p] = seed(p, 0, ragged=True, lens=ragged, start=1 + p % 2, page=3 + p % 5, no_last=bool(p & 1))
        seeds["v%02d_cells" % p] = seed(p, 2, page=0, per_head=False, reversed_ids=True, spare=3, tokens=9)
        seeds["v%02d_prefix" % p] = seed(p, 1, prefix=[5, 2], page=2 + p % 4, start=p % 3)
        seeds["v%02d_nan" % p] = seed(p, 0, rate=5, value_seed=11 + p)
    for c in range(1, 11):
        for high in (False, True):
            for k, p in enumerate((c % 15, (c + 5) % 15, (c + 10) % 15)):
                seeds["c%02d_%s_%s_%s" % (c, CORRUPT[c], "hi" if high else "lo", NAMES[p])] = seed(
                    p, k % 3, corrupt=c, high=high, row=c, per_head=bool(k & 1), one_head=bool(k & 1), page=1 + k * 2,
                    start=1 if c == 7 else 0, ragged=(c == 8), no_last=(c == 8), lens=ragged, prefix=[4, 3] if c == 9 else None)
    for m, name in ((0, "hnd"), (1, "nhd"), (2, "in_place"), (4, "unsorted"), (8 | 16, "out_of_range_low"), (8, "out_of_range_high"),
                    (12, "dst_too_short"), (64 | 1, "dst_longer")):
        seeds["compact_%s" % name] = seed(0, 0, compact=m, G=1, tokens=10)
        seeds["compact_%s_gqa" % name] = seed(10, 1, compact=m, tokens=10)
    # regression inputs found by fuzzing (raw bytes): lkv_budgets_attention, ratios of exactly 0
    # (see make_seeds.py's regress_lkv_zero_ratio_apportion)
    seeds["regress_lkv_zero_ratio_apportion"] = bytes.fromhex("771b303f5d5d23ab2f44454249414e5fc046524f4e54454e44e30383a4828383a54ab6a4")
    for name, b in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(b)
    print("wrote %d seeds to %s" % (len(seeds), OUT))


if __name__ == "__main__":
    main()
