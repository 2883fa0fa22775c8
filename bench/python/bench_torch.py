#!/usr/bin/env python3
"""kvevict against plain PyTorch on the CPU, in the same run (issue 37).

For each method, a plain-PyTorch implementation of the method's selection (the way a researcher
writes it: one batched matmul of the G * w window rows of a GQA group per KV head, fp32 softmax,
reductions, pooling and top-k as separate torch ops) is timed beside ``kvevict.Evictor.select``
on the same tensors, with interleaved repetitions; the table reports medians. Before timing, the
kept sets of both are compared (per KV head, as sets): a row whose sets differ is marked, since
it would compare different work.

Methods and the torch side (kvevict's published defaults; ../shared/spec/baselines.md,
../shared/spec/restkv.md):
- snapkv: window attention (causal inside the window), sum over the window rows, mean over the
  GQA group, avg-pool 5 (zero padding, divisor 5), top (B - w) of the past + the window;
- restkv: the same attention, EMA (alpha 0.3) over the rows, the "after" reconstruction score
  a / (1 - a) * ||R z - R v_n|| with the W_O factor R (kvevict.wo_factors), the adaptive-window
  drift from the top-(B - w) mean index of every row, group mean, replicate-padded box filter,
  top-k + window (the math of bench/cuda/torch_restkv.py, which follows the authors' code);
- tova: the last query's attention averaged over all query heads of the layer, top B (one set
  for every KV head);
- h2o: column sums of the full causal attention of all L queries (query blocks of 256 rows, never
  the L x L matrix), group mean, the last B/2 tokens + the top B/2 of the others (L = 4k only by
  default: O(L^2 d) for both sides, about 1.1 TFLOP for the causal half at 16k);
- key_norm: the B lowest ||k_n|| (query-free, so no window is protected);
- streaming_llm: 4 sinks + the last B - 4 tokens.
Shape: batch 1, q_heads 32, kv_heads 8, head_dim 128, window 32 (HND), budget B = 1024 tokens per
head (window included). Storage fp32 or bf16; the torch side widens bf16 to fp32 first, as the
reference code does (``.float()``), and computes in fp32 like kvevict.

Columns: torch ms and kvevict ms (wall per call, medians), kvevict's C++ time (inside the call;
the rest is the binding's argument checks and result tensors), speedup = torch / kvevict.
A call shorter than 1 ms (StreamingLLM's few microseconds, where a single timing is mostly
timer and scheduler noise) is timed as a batch of calls, the same batch size for both sides,
doubled until it lasts at least 1 ms for the faster side, and reported per call (``calls`` in
the JSON rows). Each timed side starts after ``--settle`` seconds idle (0.2): OpenBLAS's
pthread workers spin for about 0.1 s after a call (OPENBLAS_THREAD_TIMEOUT), and took the second
core from a 2-thread kvevict call that ran right after torch (measured: a 1-thread kvevict call
used 2 cores' CPU time). A side whose own call takes under 50 ms is then called once, untimed,
right before each of its timings, so that it starts with its own threads awake (on this machine
a team that slept 0.2 s can take longer to wake than a whole TOVA call).

    PYTHONPATH=<build>/python python3 bench/python/bench_torch.py [--seqs 4096,16384,32768]
        [--dtypes fp32,bf16] [--threads 1,2] [--methods snapkv,restkv,...] [--reps 5] [--json out.json]
    python3 bench/python/bench_torch.py --render a.json b.json ...   # markdown table of runs side by side

Threads: torch.set_num_threads(t) and kvevict's num_threads=t, per row. Run it with the torch you
want to compare against (Debian's python3-torch uses the system BLAS: check
``torch.__config__.show()``; a PyPI torch carries its own CPU kernels), with the kvevict binding
built for that interpreter (pip install . builds it with -march=native; docs/python.md).
"""
import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time

def render(paths) -> str:
    """A markdown table of several --json runs side by side: per (method, L, dtype, threads) and run,
    "torch ms / kvevict ms (speedup)"; runs are labelled by their torch version and kvevict build."""
    runs = [json.load(open(p)) for p in paths]
    labels = [f"torch {r['torch']} vs kvevict {r.get('build', {}).get('cpu_gemm', '?')}" for r in runs]
    keys = []
    for r in runs:
        for x in r["rows"]:
            k = (x["method"], x["L"], x["dtype"], x["threads"])
            if k not in keys:
                keys.append(k)
    out = ["| method | L | dtype | threads | " + " | ".join(labels) + " |", "|---|---|---|---|" + "---|" * len(runs)]
    for k in keys:
        cells = []
        for r in runs:
            x = next((y for y in r["rows"] if (y["method"], y["L"], y["dtype"], y["threads"]) == k), None)
            cells.append("-" if x is None else f"{x['torch_ms']:.3g} / {x['kvevict_ms']:.3g} (**{x['speedup']:.2f}x**)"
                         + ("" if x["same_sets"] == x["heads"] else f", sets {x['same_sets']}/{x['heads']}"))
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__" and sys.argv[1:2] == ["--render"]:  # needs neither torch nor kvevict
    print(render(sys.argv[2:]))
    sys.exit(0)

import torch  # noqa: E402

import kvevict  # noqa: E402

B_, HQ, HKV, D, W = 1, 32, 8, 128, 32
G = HQ // HKV
BUDGET = 1024


def _window_probs(q, k, L):
    """[Hkv, G*W, L] fp32 softmax of the window rows of each GQA group (causal inside the window)."""
    qg = q[0].float().reshape(HKV, G * W, D) * (1.0 / math.sqrt(D))
    logits = torch.matmul(qg, k[0].float().transpose(-1, -2))  # Hkv, G*W, L
    j = torch.arange(W).repeat(G)[:, None]
    n = torch.arange(L)[None, :]
    logits.masked_fill_(n > L - W + j, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _with_window(past_idx, L):
    win = torch.arange(L - W, L).expand(past_idx.shape[0], W)
    return torch.cat([past_idx, win], dim=-1)


def torch_snapkv(q, k, v, R, L):
    p = _window_probs(q, k, L)  # Hkv, G*W, L
    s = p.view(HKV, G, W, L).sum(2).mean(1)[:, : L - W]  # Hkv, L-W
    s = torch.nn.functional.avg_pool1d(s[:, None, :], 5, stride=1, padding=2)[:, 0]
    return _with_window(torch.topk(s, BUDGET - W, dim=-1).indices, L)


def torch_restkv(q, k, v, R, L, alpha=0.3, beta=2000.0, k_min=5):
    p = _window_probs(q, k, L).view(HKV, G, W, L)
    c = torch.tensor([(1 - alpha) ** (W - 1)] + [alpha * (1 - alpha) ** (W - 1 - j) for j in range(1, W)])
    abar = (p * c[None, None, :, None]).sum(2)  # Hkv, G, L
    N = L - W
    vf = v[0].float()  # Hkv, L, D
    z = torch.einsum("hgs,hsd->hgd", abar[..., :N], vf[:, :N])  # Hkv, G, D
    Rg = R.view(HKV, G, D, D)
    rz = torch.einsum("hgij,hgj->hgi", Rg, z)
    y = torch.einsum("hgij,hsj->hgsi", Rg, vf)  # Hkv, G, L, D
    dist = (rz[:, :, None, :] - y).norm(dim=-1)
    s = (abar / (1 - abar) * dist).mean(1)[:, :N]  # Hkv, N
    K = BUDGET - W
    idx = torch.topk(p.view(HQ, W, L), K, dim=-1).indices.double().mean(-1)  # Hq, W
    t = float((idx[:, : W // 2].mean(-1) - idx[:, W // 2:].mean(-1)).mean())
    m = math.floor(abs(t) / beta)
    kk = max(k_min, 2 * m + 1)
    sh = math.floor(t / beta) if t > 0 else math.floor(t / beta) + 1
    sh = max(-(kk // 2), min(kk // 2, sh))
    xp = torch.nn.functional.pad(s[:, None, :], (kk // 2 - sh, kk // 2 + sh), mode="replicate")
    sm = torch.nn.functional.avg_pool1d(xp, kk, stride=1)[:, 0, :N]
    return _with_window(torch.topk(sm, K, dim=-1).indices, L)


def torch_tova(q, k, v, R, L):
    ql = q[0, :, -1:].float().reshape(HKV, G, D) * (1.0 / math.sqrt(D))
    p = torch.softmax(torch.matmul(ql, k[0].float().transpose(-1, -2)), dim=-1)  # Hkv, G, L
    s = p.mean(dim=(0, 1))  # L
    return torch.topk(s, BUDGET).indices[None, :].expand(HKV, BUDGET)


def torch_h2o(q, k, v, R, L, rows=256):
    kf = k[0].float()
    acc = torch.zeros(HKV, G, L)
    qf = q[0].float().view(HKV, G, L, D) * (1.0 / math.sqrt(D))
    n = torch.arange(L)[None, :]
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        lg = torch.matmul(qf[:, :, r0:r1], kf[:, None, :r1].transpose(-1, -2))  # Hkv, G, rb, r1
        lg.masked_fill_(n[:, :r1] > torch.arange(r0, r1)[:, None], float("-inf"))
        acc[..., :r1] += torch.softmax(lg, dim=-1).sum(2)
    s = acc.mean(1)
    recent = BUDGET // 2
    heavy = torch.topk(s[:, : L - recent], BUDGET - recent, dim=-1).indices
    return torch.cat([heavy, torch.arange(L - recent, L).expand(HKV, recent)], dim=-1)


def torch_key_norm(q, k, v, R, L):
    nrm = k[0].float().norm(dim=-1)  # Hkv, L (query-free: no window is protected)
    return torch.topk(-nrm, BUDGET, dim=-1).indices


def torch_streaming_llm(q, k, v, R, L):
    idx = torch.cat([torch.arange(4), torch.arange(L - (BUDGET - 4), L)])
    return idx[None, :].expand(HKV, BUDGET)


TORCH = {"snapkv": torch_snapkv, "restkv": torch_restkv, "tova": torch_tova, "h2o": torch_h2o,
         "key_norm": torch_key_norm, "streaming_llm": torch_streaming_llm}


def same_sets(a, b):
    """Rows of a and b (Hkv x k index tensors) that hold the same set."""
    return sum(int(torch.equal(torch.sort(x).values, torch.sort(y).values)) for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="4096,16384,32768")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--methods", default="snapkv,restkv,tova,key_norm,streaming_llm,h2o")
    ap.add_argument("--h2o-max-seq", type=int, default=4096, help="skip h2o above this L (O(L^2))")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settle", type=float, default=0.2, help="seconds idle before each timed side")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    cfg = torch.__config__.show()
    blas = re.findall(r"BLAS_INFO=\w+", cfg)
    torch.matmul(torch.ones(64, 64), torch.ones(64, 64))  # the BLAS torch really loaded (Debian: an alternative)
    with open("/proc/self/maps") as f:
        libs = sorted({ln.split()[-1] for ln in f if re.search(r"lib(open)?blas|libblis|libmkl", ln)})
    blas += [os.path.realpath(x) for x in libs]
    print(f"# torch {torch.__version__} ({'; '.join(blas) or 'BLAS info not reported'}), kvevict {kvevict.__version__} "
          f"{kvevict.build_info()}, python {platform.python_version()}, {platform.machine()}")
    print(f"# batch 1, q_heads {HQ}, kv_heads {HKV}, head_dim {D}, window {W}, budget {BUDGET}; medians of {a.reps} "
          f"interleaved repetitions")
    print(f"{'method':14s} {'L':>6s} {'dtype':5s} {'thr':>3s} {'torch ms':>10s} {'kvevict ms':>11s} {'C++ ms':>9s} "
          f"{'speedup':>8s}  same sets")
    for L in seqs:
        g = torch.Generator().manual_seed(L)
        k32 = torch.randn(B_, HKV, L, D, generator=g)
        v32 = torch.randn(B_, HKV, L, D, generator=g)
        qw32 = torch.randn(B_, HQ, W, D, generator=g)
        R = kvevict.wo_factors(torch.randn(4096, HQ * D, generator=g) / 64, HQ)  # Hq, D, D fp32
        qall32 = None
        for dname in a.dtypes.split(","):
            dt = dtypes[dname]
            k, v, qw = k32.to(dt), v32.to(dt), qw32.to(dt)
            for thr in [int(x) for x in a.threads.split(",")]:
                torch.set_num_threads(thr)
                for m in a.methods.split(","):
                    if m == "h2o" and L > a.h2o_max_seq:
                        continue
                    q = qw
                    if m == "h2o":
                        if qall32 is None:
                            qall32 = torch.randn(B_, HQ, L, D, generator=g)
                        q = qall32.to(dt)
                    ev = kvevict.Evictor(m)
                    kw = dict(queries=q, keys=k, values=v, budget=BUDGET, num_threads=thr, layout="HND")
                    if m == "restkv":
                        kw["wo_factor"] = R
                    if m in ("key_norm", "streaming_llm"):
                        kw.pop("queries")
                    if m not in ("restkv",):
                        kw.pop("values")
                    tfn = TORCH[m]
                    ref = tfn(q, k, v, R, L)
                    sel = ev.select(**kw)
                    same = same_sets(ref, sel.padded()[0])
                    # Calls per timing: one, or a batch that lasts at least 1 ms for the faster side
                    # (doubled until it does, warm); the same batch size for both sides.
                    def seconds(f, n):
                        t0 = time.perf_counter()
                        for _ in range(n):
                            f()
                        return time.perf_counter() - t0
                    run_t, run_k = (lambda: tfn(q, k, v, R, L)), (lambda: ev.select(**kw))
                    t_t, t_k = seconds(run_t, 1), seconds(run_k, 1)
                    calls = 1
                    if min(t_t, t_k) < 1e-3:
                        while min(seconds(run_t, calls), seconds(run_k, calls)) < 1e-3 and calls < 100000:
                            calls *= 2
                    warm_t, warm_k = t_t < 0.05, t_k < 0.05  # each side's own call time
                    tt, tk, tc = [], [], []
                    for _ in range(a.reps):
                        time.sleep(a.settle)
                        if warm_t:
                            tfn(q, k, v, R, L)
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            tfn(q, k, v, R, L)
                        tt.append((time.perf_counter() - t0) / calls)
                        time.sleep(a.settle)
                        if warm_k:
                            ev.select(**kw)
                        c0 = ev.stats()["cpp_seconds"]
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            ev.select(**kw)
                        tk.append((time.perf_counter() - t0) / calls)
                        tc.append((ev.stats()["cpp_seconds"] - c0) / calls)
                    mt, mk, mc = statistics.median(tt), statistics.median(tk), statistics.median(tc)
                    row = dict(method=m, L=L, dtype=dname, threads=thr, torch_ms=mt * 1e3, kvevict_ms=mk * 1e3,
                               cpp_ms=mc * 1e3, speedup=mt / mk, same_sets=same, heads=HKV, calls=calls)
                    rows.append(row)
                    print(f"{m:14s} {L:6d} {dname:5s} {thr:3d} {mt * 1e3:10.2f} {mk * 1e3:11.2f} {mc * 1e3:9.2f} "
                          f"{mt / mk:7.2f}x  {same}/{HKV}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, blas=blas, kvevict=kvevict.__version__, build=kvevict.build_info(),
                           reps=a.reps, settle=a.settle, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
