"""A 1-thread kvevict call stays on one thread after torch.set_num_threads(n) (issue: Eigen
parallelised the products inside it, 3.8-10.3x slower wall time). Measured in a fresh interpreter
whose inputs come from numpy, so no torch thread pool is awake: the process's CPU time over the
calls must stay near their wall time (two busy threads would double it), and the selection must
not depend on the caller's thread count."""
import os
import subprocess
import sys

SCRIPT = r"""
import resource, sys, time
import numpy as np
import torch
import kvevict

rng = np.random.default_rng(5)
B, H, G, L, d, w = 1, 2, 4, 4096, 64, 32
k = torch.from_numpy(rng.standard_normal((B, H, L, d), dtype=np.float32))
q = torch.from_numpy(rng.standard_normal((B, H * G, w, d), dtype=np.float32))

def run(n_caller):
    torch.set_num_threads(n_caller)
    kvevict.select("snapkv", keys=k, values=k, queries=q, budget=0.25, num_threads=1)  # plan once
    time.sleep(0.3)  # thread pools woken by set_num_threads spin for ~0.1 s: not the call's CPU
    c0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(32):  # ~0.4 s of calls: a stray 0.1 s of another thread cannot pass for a second busy core
        sel = kvevict.select("snapkv", keys=k, values=k, queries=q, budget=0.25, num_threads=1)
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    return sel.indices.tolist(), cpu, wall

ref, _, _ = run(1)
for n in (2, 8):
    got, cpu, wall = run(n)
    assert got == ref, f"torch.set_num_threads({n}) changed the selection"
    print(f"caller threads {n}: cpu {cpu:.3f} s, wall {wall:.3f} s")
    assert cpu <= 1.3 * wall + 0.05, f"torch.set_num_threads({n}): a 1-thread call used {cpu:.3f} s CPU in {wall:.3f} s wall"
print("ok")
"""


def test_one_thread_call_after_torch_set_num_threads():
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr
