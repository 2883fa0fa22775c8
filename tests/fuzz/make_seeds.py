#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the seed corpus of tests/fuzz/fuzz_evictor.cpp (tests/fuzz/corpus/).

Each seed is one input in the byte format the target reads front to back (see the reader in
fuzz_evictor.cpp and docs/failure-kinds.md, "Fuzzing"): preset, storage type, flags, shape,
lengths, budget, parameters, layers, value seed and scale, poison, special-value rates,
workspace fill. The seeds cover every preset x storage type with ordinary inputs, padded
batches, degenerate sizes, fractions, extreme parameters and non-finite values, so a 60 s run
starts from inputs that already reach every stage.
Usage: python3 tests/fuzz/make_seeds.py   (deterministic; rewrites the folder)
"""
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")


def seed(preset, dtype, *, nhd=False, queries=False, len_mode=0, check_finite=True, positions=False, threads=1,
         B=2, Hkv=2, G=2, S=24, W=4, D=8, pad=1, lengths=None, budget=("tokens", 10), mutate=None,
         layers=(4, 1), vseed=1234, exp2=0, poison=0, rates=(0, 0, 0), ws_fill=0xFF, wo_mode=None):
    b = bytearray([preset, dtype])
    flags = (1 if nhd else 0) | (2 if queries else 0) | (len_mode << 2) | (0 if check_finite else 16) \
        | (32 if positions else 0) | (threads << 6)
    b.append(flags)
    b += bytes([B - 1, Hkv - 1, G - 1, S, (W - 1) % (S + 1) if S >= 0 else 0, D - 1, pad])
    if len_mode in (1, 2):
        lens = lengths or [S - (i * 5) % (S + 1) for i in range(B * Hkv)]
        assert len(lens) == B * Hkv
        b += bytes([x % 256 for x in lens])
    kind, val = budget
    if kind == "tokens":
        b += bytes([0, val])
    elif kind == "fraction":
        b += bytes([1, val])
    elif kind == "special_fraction":
        b += bytes([2, 192, val])  # param_float: special(val)
    else:  # raw 32-bit tokens
        b += bytes([3]) + struct.pack("<I", val)
    if mutate is None:
        b.append(0)
    else:
        b.append(1)
        b += bytes(mutate)
    b += bytes([layers[0] - 1, layers[1]])
    b += struct.pack("<I", vseed)
    b += struct.pack("<b", exp2)
    b += bytes([poison, rates[0], rates[1], rates[2], ws_fill])
    if wo_mode is not None:  # CriticalKV's W_O view and values (fuzz_case.hpp, wo_mode)
        b.append(wo_mode)
    return bytes(b)


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    seeds = {}
    for p in range(10):
        for t in range(3):
            name = f"p{p}_t{t}"
            seeds[name + "_plain"] = seed(p, t, vseed=100 + 3 * p + t)
            seeds[name + "_padded"] = seed(p, t, nhd=True, len_mode=1 if p == 5 else 2, positions=True, B=3, S=30,
                                           W=6, pad=2, budget=("fraction", 90), vseed=200 + p, poison=0)
            seeds[name + "_tiny"] = seed(p, t, B=1, Hkv=1, G=1, S=1, W=1, D=1, pad=0, budget=("tokens", 1),
                                         vseed=300 + p)
        # per-preset extremes (float)
        seeds[f"p{p}_huge"] = seed(p, 0, S=33, W=5, exp2=100, budget=("tokens", 12), vseed=400 + p)
        seeds[f"p{p}_denormal"] = seed(p, 1, S=33, W=5, exp2=-126, budget=("tokens", 12), vseed=500 + p)
        seeds[f"p{p}_nan_checked"] = seed(p, 2, S=20, W=3, rates=(6, 6, 6), vseed=600 + p)
        seeds[f"p{p}_nan_unchecked"] = seed(p, 0, S=20, W=3, rates=(8, 8, 8), check_finite=False, vseed=700 + p)
        seeds[f"p{p}_params"] = seed(p, 0, S=28, W=4, mutate=[0xff, 3, 0xC0, 5, 0xC1, 2, 0xE0, 9, 0x81, 0xC2, 3, 0x05],
                                     vseed=800 + p)
        seeds[f"p{p}_broadcast"] = seed(p, 0, len_mode=3, S=18, W=3, vseed=900 + p, threads=2)
        seeds[f"p{p}_bad_budget"] = seed(p, 0, budget=("raw", 0xFFFFFFFF), vseed=1000 + p)
        seeds[f"p{p}_frac_tiny"] = seed(p, 1, S=36, W=4, budget=("special_fraction", 3), vseed=1100 + p)
        seeds[f"p{p}_empty"] = seed(p, 0, S=0, W=1, vseed=1200 + p)
        seeds[f"p{p}_short_heads"] = seed(p, 0, len_mode=2, S=12, W=8, lengths=[0, 1, 7, 12], vseed=1300 + p)
        seeds[f"p{p}_many_layers"] = seed(p, 2, layers=(40, 39), S=40, W=4, budget=("tokens", 8), vseed=1400 + p)
    # CriticalKV presets (8 criticalkv, 9 critical_adakv): W_O views, special weights, stage params
    for p in (8, 9):
        for t in range(3):
            seeds[f"p{p}_t{t}_wo_aliased_rows"] = seed(p, t, S=26, W=4, vseed=1500 + 3 * p + t, wo_mode=4)
            seeds[f"p{p}_t{t}_wo_scalar"] = seed(p, t, S=26, W=4, vseed=1510 + 3 * p + t, wo_mode=5)
            seeds[f"p{p}_t{t}_wo_hidden1"] = seed(p, t, S=26, W=4, vseed=1520 + 3 * p + t, wo_mode=6)
            seeds[f"p{p}_t{t}_wo_transposed"] = seed(p, t, S=26, W=4, vseed=1530 + 3 * p + t, wo_mode=7)
        seeds[f"p{p}_wo_bad_extent"] = seed(p, 0, vseed=1540 + p, wo_mode=8)
        # wo_mode bit 4 writes special((vseed >> 8) % 16): 0x1000 -> NaN, 0x1100 -> inf
        seeds[f"p{p}_wo_special_checked"] = seed(p, 0, vseed=0x1000 + p, wo_mode=16)
        seeds[f"p{p}_wo_special_unchecked"] = seed(p, 0, vseed=0x1100 + p, wo_mode=16, check_finite=False)
        seeds[f"p{p}_wo_huge"] = seed(p, 0, S=30, W=4, exp2=100, vseed=1570 + p, wo_mode=32)
        # mutate_params bytes: selector flags, pooling kernel, (AdaKV alpha), first_stage_ratio, eps;
        # param_float: 0x80 + index = special value (NaN, inf, ...), 0xC0 + b = b / 64
        ada = [0x00] if p == 9 else []
        seeds[f"p{p}_stage_params"] = seed(p, 0, S=28, W=4, mutate=[0x00, 0x00] + ada + [0x80, 0, 0x80, 2], vseed=1580 + p)
        seeds[f"p{p}_stage_ratio_edges"] = seed(p, 0, S=28, W=4, mutate=[0x00, 0x00] + ada + [0xC0, 64, 0xC0, 0],
                                                vseed=1590 + p)
        seeds[f"p{p}_stage_ratio_zero"] = seed(p, 1, S=28, W=4, mutate=[0x00, 0x00] + ada + [0xC0, 0, 0x7F],
                                               vseed=1600 + p)
    # regression inputs found by fuzzing (raw bytes)
    # key_norm, half_t, layer_mean over 9 heads of keys scaled to the fp16 limit: the fp32 head sum
    # overflowed to -inf in maybe_scores (fixed in the CPU evictor and the CUDA layer_mean kernel)
    seeds["regress_layer_mean_overflow"] = bytes.fromhex("d940" + "71" * 25 + "f000000080e0")
    # adakv (bf16) and critical_adakv with num_recent = 0 and about 1 token per head: AdaKV's rounding
    # gave one head every token and another none (fixed: a floor of 1 for a head with nothing protected)
    seeds["regress_adakv_empty_head"] = bytes.fromhex("0302273e3e3e400101012805008c0101008c000101011202070307010001" "0800")
    seeds["regress_critical_adakv_empty_head"] = bytes.fromhex("090040030a011a05008c010101120207010003070100")
    # lkv_budgets_restkv at a tiny temperature: softmax ratios of exactly 0 left the budget to
    # apportion's one-unit loop (O(total) for a 2^40-token reference; fixed: equal shares)
    seeds["regress_lkv_zero_ratio_apportion"] = bytes.fromhex(
        "3a6f4c4450574441600101e201110000000000036c000000036c470101000060300011e9000080000080")
    for name, data in sorted(seeds.items()):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()
