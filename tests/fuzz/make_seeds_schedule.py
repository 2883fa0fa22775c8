#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the seed corpus of tests/fuzz/fuzz_schedule.cpp (tests/fuzz/corpus_schedule/).

Byte format (read front to back by fuzz_schedule.cpp; zeros once the input ends): the options block
(interval, budget kind and value, protect_prefix, protect_recent, evict_after_prefill; a byte < 224 is
a small value, >= 224 is followed by a raw int32), then ops of two bytes (op % 9, argument):
0-1 a prompt of arg % 64 (+200 when arg >= 192; arg % 64 == 63: -1) tokens, 2-4 generated tokens
(arg % 16 == 15: 0; arg % 4 == 0: 1 + arg % 7), 5 the due eviction (window arg % 40), 6 a forged
action, 7 reset, 8 apply() with a null budget or a negative window.
Usage: python3 tests/fuzz/make_seeds_schedule.py   (deterministic; rewrites its named seeds and keeps the
other files: inputs merged from fuzzing runs, `fuzz_schedule -merge=1 tests/fuzz/corpus_schedule DIR`)
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus_schedule")


def options(interval=16, tokens=None, fraction=None, prefix=0, recent=0, after_prefill=True):
    b = bytearray([interval])
    if fraction is not None:
        b += bytes([0, fraction])  # kind % 4 == 0: fraction = byte / 200
    else:
        b += bytes([1, tokens])
    b += bytes([0, prefix]) if prefix else bytes([1])
    b += bytes([0, recent]) if recent else bytes([1])
    b.append(1 if after_prefill else 0)
    return b


def decode_run(steps, interval, window=8, prompt_arg=36):
    ops = bytearray([0, prompt_arg, 5, window])
    for i in range(1, steps + 1):
        ops += bytes([2, 1])
        if i % interval == 0:
            ops += bytes([5, window])
    return ops


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    seeds["cap_interval16"] = options(16, tokens=50) + decode_run(80, 16)
    seeds["cap_interval1_protected"] = options(1, tokens=40, prefix=4, recent=8) + decode_run(30, 1)
    seeds["fraction_interval4"] = options(4, fraction=20) + decode_run(40, 4, window=32)
    seeds["no_prefill_eviction"] = options(8, tokens=30, after_prefill=False) + decode_run(40, 8)
    seeds["late_engine"] = options(4, tokens=20) + bytes([0, 36, 2, 4, 2, 4, 2, 4, 5, 8, 2, 1, 2, 1])
    seeds["multi_turn"] = options(8, tokens=30, prefix=6) + decode_run(20, 8) + bytes([1, 20, 5, 8]) + decode_run(20, 8)
    seeds["forged_and_reset"] = options(4, tokens=20) + bytes([0, 36, 6, 0, 6, 1, 6, 2, 5, 8, 8, 1, 8, 2, 7, 0, 0, 10, 5, 4])
    seeds["cap_below_protection"] = options(4, tokens=5, recent=3) + bytes([0, 36, 5, 8, 5, 0])
    seeds["bad_options"] = bytes([0, 1, 10, 1, 1, 1])
    seeds["raw_values"] = bytes([224, 0xff, 0xff, 0xff, 0x7f, 1, 224, 0, 0, 0, 0x80, 0, 224, 0xff, 0xff, 0xff, 0x7f]) + bytes([0, 36, 5, 8])
    seeds["huge_prompt"] = options(2, tokens=100) + bytes([0, 250] * 8 + [5, 39] + [2, 0] * 10)
    for name, data in sorted(seeds.items()):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(bytes(data))
    print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()
