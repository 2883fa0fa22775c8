# SPDX-License-Identifier: Apache-2.0
"""Tests of tools/lkv/softtopk.py. Run: /usr/bin/python3 tools/lkv/test_softtopk.py"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from softtopk import soft_topk, soft_topk_with_theta  # noqa: E402

torch.set_num_threads(2)
SEED = 1234


def test_sums_match_beta():
    g = torch.Generator().manual_seed(SEED)
    worst = 0.0
    for dtype in (torch.float32, torch.float64):
        for n in (1, 2, 7, 37, 512):
            for tau in (1e-3, 0.05, 0.5, 1.0, 10.0):
                u = (torch.randn(5, 4, 3, n, generator=g) * 3).to(dtype)
                beta = (torch.rand(5, 4, 3, generator=g) * n).clamp_min(1e-3).to(dtype)
                beta[0, 0, 0] = n  # full budget
                beta[0, 0, 1] = min(1e-3, n)  # almost nothing
                if n >= 2:
                    beta[0, 0, 2] = 1.0  # integer
                m = soft_topk(u, beta, tau)
                assert m.dtype == dtype and m.shape == u.shape
                assert bool(((m >= 0) & (m <= 1)).all())
                err = float((m.double().sum(-1) - beta.double()).abs().max())
                worst = max(worst, err)
                assert err < 1e-4, (dtype, n, tau, err)
    print(f"  sums: max |sum m - beta| = {worst:.3g} (float32+float64, n in 1..512, "
          f"tau in 1e-3..10)")


def test_vectorised_equals_rowwise():
    g = torch.Generator().manual_seed(SEED + 1)
    u = torch.randn(6, 11, generator=g, dtype=torch.float64)
    beta = torch.rand(6, generator=g, dtype=torch.float64) * 10 + 0.5
    tau = torch.tensor([0.1, 0.3, 1.0, 2.0, 0.05, 0.7], dtype=torch.float64)
    m = soft_topk(u, beta, tau)
    for r in range(6):
        mr = soft_topk(u[r], beta[r], float(tau[r]))
        assert torch.allclose(m[r], mr, atol=1e-12, rtol=0), r
    # scalar beta broadcasts
    m2 = soft_topk(u, 3.0, 0.5)
    assert torch.allclose(m2.sum(-1), torch.full((6,), 3.0, dtype=torch.float64), atol=1e-10)


def test_gradcheck():
    g = torch.Generator().manual_seed(SEED + 2)
    cases = 0
    for shape, tau in (((3, 7), 0.7), ((2, 2, 5), 0.2), ((4, 16), 2.0), ((1,), 1.0)):
        n = shape[-1]
        u = torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
        lead = shape[:-1]
        beta = (torch.rand(tuple(lead), generator=g, dtype=torch.float64) * (n - 0.4) + 0.2)
        beta = beta.clamp(max=n - 0.05).requires_grad_()
        f = lambda uu, bb: soft_topk(uu, bb, tau)
        assert torch.autograd.gradcheck(f, (u, beta), eps=1e-6, atol=1e-6, rtol=1e-4)
        cases += 1
    # per-row tau tensor
    u = torch.randn(3, 9, generator=g, dtype=torch.float64).requires_grad_()
    beta = torch.tensor([1.5, 4.0, 8.2], dtype=torch.float64, requires_grad=True)
    tau = torch.tensor([0.3, 1.0, 3.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda uu, bb: soft_topk(uu, bb, tau), (u, beta),
                                    eps=1e-6, atol=1e-6, rtol=1e-4)
    cases += 1
    # second-order not supported; first-order identities: d(sum m)/du = 0, d(sum m)/dbeta = 1
    u = torch.randn(4, 13, generator=g, dtype=torch.float64).requires_grad_()
    beta = torch.tensor([1.0, 2.5, 6.0, 12.9], dtype=torch.float64, requires_grad=True)
    soft_topk(u, beta, 0.4).sum().backward()
    assert float(u.grad.abs().max()) < 1e-10
    assert torch.allclose(beta.grad, torch.ones(4, dtype=torch.float64), atol=1e-10)
    # float32 path gives gradients in float32
    u32 = torch.randn(2, 6, generator=g).requires_grad_()
    b32 = torch.tensor([2.0, 3.5], requires_grad=True)
    (soft_topk(u32, b32, 0.5) * torch.arange(6.0)).sum().backward()
    assert u32.grad.dtype == torch.float32 and b32.grad.dtype == torch.float32
    assert bool(torch.isfinite(u32.grad).all()) and bool(torch.isfinite(b32.grad).all())
    print(f"  gradcheck: {cases} double-precision cases passed (u and beta)")


def test_full_budget_gradients_finite():
    u = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    beta = torch.tensor([5.0, 5.0], dtype=torch.float64, requires_grad=True)
    m = soft_topk(u, beta, 0.01)
    (m * torch.arange(5.0, dtype=torch.float64)).sum().backward()
    assert bool(torch.isfinite(u.grad).all()) and bool(torch.isfinite(beta.grad).all())
    assert float((m.sum(-1) - 5).abs().max()) < 1e-4


def test_hard_topk_limit():
    g = torch.Generator().manual_seed(SEED + 3)
    rows, n = 8, 40
    # distinct scores with gaps >= 0.05
    u = torch.stack([torch.randperm(n, generator=g).double() * 0.05 for _ in range(rows)])
    u = u + torch.randn(rows, 1, generator=g, dtype=torch.float64)
    k = torch.randint(1, n, (rows,), generator=g)
    hard = torch.zeros(rows, n, dtype=torch.float64)
    for r in range(rows):
        hard[r, u[r].topk(int(k[r])).indices] = 1.0
    errs = []
    for tau in (1.0, 0.1, 0.01, 1e-3, 1e-4):
        m = soft_topk(u, k.double(), tau)
        errs.append(float((m - hard).abs().max()))
    for a, b in zip(errs, errs[1:]):
        assert b <= a + 1e-12, errs
    assert errs[-1] < 1e-6, errs
    print("  hard limit: max |m - topk| for tau = 1, 0.1, 0.01, 1e-3, 1e-4: "
          + ", ".join(f"{e:.2g}" for e in errs))


def test_theta_monotone_and_checks():
    u = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    th = [float(soft_topk_with_theta(u, torch.tensor([b], dtype=torch.float64), 0.5)[1])
          for b in (0.5, 1.0, 2.0, 3.5)]
    assert th == sorted(th)
    for bad in (0.0, -1.0, 4.5):
        try:
            soft_topk(u, torch.tensor([bad], dtype=torch.float64), 0.5)
        except ValueError:
            pass
        else:
            raise AssertionError(f"beta={bad} accepted")
    try:
        soft_topk(u, 1.0, 0.0)
    except ValueError:
        pass
    else:
        raise AssertionError("tau=0 accepted")


def test_speed_shape():
    # the LKV training shape: (layers=5, B=4, kv_heads=4, t=512)
    g = torch.Generator().manual_seed(SEED + 4)
    u = torch.randn(5, 4, 4, 512, generator=g, requires_grad=True)
    beta = torch.full((5, 4, 4), 0.15 * 512, requires_grad=True)
    t0 = time.perf_counter()
    m = soft_topk(u, beta, 0.1)
    (m * torch.randn_like(m)).sum().backward()
    dt = time.perf_counter() - t0
    assert float((m.sum(-1) - beta).abs().max()) < 1e-4
    print(f"  forward+backward on (5, 4, 4, 512) float32: {dt * 1e3:.1f} ms")


def main():
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_") and callable(v)]
    failed = 0
    for t in tests:
        try:
            t()
            print(f"ok   {t.__name__}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            import traceback
            traceback.print_exc()
            print(f"FAIL {t.__name__}: {e!r}")
    print(f"{len(tests) - failed}/{len(tests)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
