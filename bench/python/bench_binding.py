"""Per-call overhead of the Python binding at L = 4k tokens (one layer), next to the C++ call.

For each method, one Evictor selects on the same layer REPS times (the plan and workspace are
cached after the first call); the wall time per call is measured around Evictor.select and the
C++ time per call inside it (Evictor.stats()["cpp_seconds"]: plan, run, result buffers), in the
same run. overhead = wall - C++: argument checks, DLPack export, result tensors.

    PYTHONPATH=<build>/python /usr/bin/python3 bench/python/bench_binding.py [--seq 4096] [--reps 30]
Shape: batch 1, 32 query heads over 8 KV heads, head_dim 128, window 32, fp16 (HND), budget 1024.
"""
import argparse
import statistics
import time

import torch

import kvevict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, d, w, L = 1, 32, 8, 128, 32, a.seq
    k = torch.randn(B, Hkv, L, d, generator=g).half()
    v = torch.randn(B, Hkv, L, d, generator=g).half()
    q = torch.randn(B, Hq, w, d, generator=g).half()
    wf = kvevict.wo_factors(torch.randn(4096, Hq * d, generator=g) / 64, Hq)
    print(f"kvevict {kvevict.__version__} binding overhead: L={L}, q_heads {Hq}, kv_heads {Hkv}, head_dim {d}, window {w}, "
          f"fp16, budget 1024, {a.reps} calls each (median), torch threads {torch.get_num_threads()}")
    print(f"{'method':14s} {'wall/call':>11s} {'C++/call':>11s} {'overhead':>10s} {'overhead/C++':>13s}")
    for method in ("streaming_llm", "key_norm", "snapkv", "restkv"):
        ev = kvevict.Evictor(method)
        kw = dict(queries=q, keys=k, values=v, budget=1024, num_threads=a.threads)
        if method == "restkv":
            kw["wo_factor"] = wf
        ev.select(**kw)  # plan + workspace
        walls, cpps = [], []
        for _ in range(a.reps):
            c0 = ev.stats()["cpp_seconds"]
            t0 = time.perf_counter()
            ev.select(**kw)
            walls.append(time.perf_counter() - t0)
            cpps.append(ev.stats()["cpp_seconds"] - c0)
        s = ev.stats()
        assert s["plans"] == 1 and s["workspace_allocs"] == 1
        wall, cpp = statistics.median(walls), statistics.median(cpps)
        over = statistics.median([x - y for x, y in zip(walls, cpps)])
        print(f"{method:14s} {wall * 1e3:9.3f} ms {cpp * 1e3:9.3f} ms {over * 1e6:7.1f} us {over / cpp:12.2%}")


if __name__ == "__main__":
    main()
