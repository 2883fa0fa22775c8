# SPDX-License-Identifier: Apache-2.0
"""Tests of tools/lkv/lkv.py and the trainer's pieces. Run: /usr/bin/python3 tools/lkv/test_lkv.py
(model-dependent tests print "skipping: ..." when the stories260K folder is missing)."""

import math
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import lkv  # noqa: E402
import llama2c  # noqa: E402
from softtopk import soft_topk  # noqa: E402

torch.set_num_threads(1)
SEED = 4321


def ref_water_fill(z, total, cap):
    """Independent reference: clip loop, floor, one unit to the largest fractional parts (sorted)."""
    n = len(z)
    mx = max(z)
    r = [math.exp(x - mx) for x in z]
    s = sum(r)
    r = [x / s for x in r]
    clipped = [False] * n
    while True:
        rest = total - cap * sum(clipped)
        rs = sum(r[i] for i in range(n) if not clipped[i])
        share = [cap if clipped[i] else r[i] / rs * rest for i in range(n)]
        over = [i for i in range(n) if not clipped[i] and share[i] > cap]
        if not over:
            break
        for i in over:
            clipped[i] = True
    out = [int(math.floor(x)) for x in share]
    left = total - sum(out)
    order = sorted(range(n), key=lambda i: (-(share[i] - math.floor(share[i])), i))
    for i in order:
        if left == 0:
            break
        if out[i] < cap:
            out[i] += 1
            left -= 1
    return out


def test_water_fill():
    rng = random.Random(SEED)
    for trial in range(200):
        n = rng.randint(1, 30)
        t = rng.randint(1, 300)
        spread = 6.0 if trial % 3 == 0 else 1.0
        z = [float(torch.tensor(rng.uniform(-spread, spread), dtype=torch.float32)) for _ in range(n)]
        for R in (0.05, 0.1, 0.2, 0.5):
            total = lkv.total_budget(R, n, t)
            out = lkv.water_fill(z, 1.0, total, t)
            assert sum(out) == total, (trial, R)
            assert all(0 <= b <= t for b in out)
            assert out == ref_water_fill(z, total, t), (trial, n, t, R, z)
    assert lkv.water_fill([0.0] * 4, 1.0, 10, 10) == [3, 3, 2, 2]  # ties: lower index first
    # ratios that underflow to 0 share the rest equally (as tests/lkv/test_lkv.cpp)
    assert lkv.water_fill([0.0, 1.0, 2.0, -1.0], 1e-30, 10, 4) == [2, 2, 4, 2]


def test_soft_budgets_and_gradients():
    g = torch.Generator().manual_seed(SEED)
    z = torch.randn(20, generator=g, requires_grad=True)
    for R, t in ((0.1, 64), (0.5, 10), (0.9, 7)):
        beta = lkv.soft_budgets(z * 3, 1.0, R, t)
        assert abs(float(beta.sum()) - R * 20 * t) < 1e-3 * t, (R, t, float(beta.sum()))
        assert float(beta.max()) <= t + 1e-9
    p = lkv.LkvParams(2, 3, 4, 8, seed=1)
    k = torch.randn(1, 3, 16, 4, generator=g)
    v = torch.randn(1, 3, 16, 4, generator=g)
    u = torch.stack([p.utility(l, k, v) for l in range(2)])  # (2, 1, 3, 16)
    beta = lkv.soft_budgets(p.z, 1.0, 0.25, 16).reshape(2, 1, 3)
    m = soft_topk(u, beta, 0.3)
    assert torch.allclose(m.sum(-1), beta.detach(), atol=1e-4)
    w = torch.randn(m.shape, generator=g)
    (m * w).sum().backward()
    assert float(p.z.grad.abs().sum()) > 0 and float(p.W1.grad.abs().sum()) > 0
    assert all(torch.isfinite(x.grad).all() for x in (p.z, p.W1, p.b1, p.w2, p.b2))


def test_artifact_round_trip_and_errors():
    p = lkv.LkvParams(2, 3, 4, 5, seed=3)
    with torch.no_grad():
        p.z.copy_(torch.randn(2, 3))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.lkv")
        lkv.write_artifact(path, p, (24, 10, 2, 6, 3, 512, 512), 1000, 77, 0.1, 0.25, 1.0)
        back = lkv.read_artifact(path)
        for name in ("z", "W1", "b1", "w2", "b2"):
            assert torch.equal(getattr(back["params"], name), getattr(p, name).detach().float()), name
        assert back["ckpt_hash"] == 77 and back["model_header"][0] == 24
        data = open(path, "rb").read()
        for bad, what in ((data[:100], "truncated"), (b"X" + data[1:], "magic"),
                          (data[:300] + bytes([data[300] ^ 1]) + data[301:], "hash")):
            open(path, "wb").write(bad)
            try:
                lkv.read_artifact(path)
                raise AssertionError(f"no error for {what}")
            except ValueError as e:
                assert what in str(e), (what, str(e))


def test_cont_forward_matches_full_forward():
    model_path = os.path.join(llama2c.default_model_dir(), "stories260K.bin")
    if not os.path.exists(model_path):
        print("skipping: no model at", model_path)
        return
    import train
    m = llama2c.load_llama2c(model_path).double()
    g = torch.Generator().manual_seed(SEED)
    tok = torch.randint(3, 500, (2, 40), generator=g)
    C = 30
    kv = train.context_kv(m, tok[:, :C])
    bias = torch.randn(5, 2, 4, C, generator=g, dtype=torch.float64)
    b5 = torch.zeros(5, 2, 4, 40, 40, dtype=torch.float64)
    b5[:, :, :, C:, :C] = bias[:, :, :, None, :]
    full = m(tok, attn_bias=b5)
    part = train.cont_forward(m, kv, tok[:, C:], C, bias)
    err = float((full[:, C:] - part).abs().max())
    assert err < 1e-10, err
    # and the identity of the checkpoint matches the C++ definition's pieces
    header, size, h = lkv.checkpoint_identity(model_path)
    assert header[0] == 64 and size == os.path.getsize(model_path) and h != 0


def test_decode_steps():
    import train
    assert train.decode_steps(10, 5, 2) == [10, 12, 14]
    assert train.decode_steps(10, 5, 1) == [10, 11, 12, 13, 14]
    assert train.decode_steps(10, 1, 4) == [10]
    assert train.decode_steps(10, 9, 4) == [10, 14, 18]


def test_decode_cont_forward():
    """Mode-B simulation: with every token protected it is the unmasked forward; with masks, the
    bias a query sees is the sum of the logs of the masks of the steps before it (checked on layer 0,
    whose continuation K/V do not depend on the masks)."""
    model_path = os.path.join(llama2c.default_model_dir(), "stories260K.bin")
    if not os.path.exists(model_path):
        print("skipping: no model at", model_path)
        return
    import train
    m = llama2c.load_llama2c(model_path).double()
    g = torch.Generator().manual_seed(SEED)
    tok = torch.randint(3, 500, (2, 40), generator=g)
    C = 30
    kv = train.context_kv(m, tok[:, :C])
    params = lkv.LkvParams(5, 4, 8, 32, "silu", seed=SEED)
    params.z.data = params.z.data.double()
    for p in (params.W1, params.b1, params.w2, params.b2):
        p.data = p.data.double()
    full = m(tok)
    ident = train.decode_cont_forward(m, params, kv, tok[:, C:], C, 0.2, 1.0, 0.5, 1e-6, 3, protect_recent=40)
    err = float((full[:, C:] - ident).abs().max())
    assert err < 1e-10, err
    # masked: the whole model against an explicit per-query bias built from the same masks (layer by
    # layer, the continuation K/V of the biased forward), via llama2c's 5-D attn_bias
    S, T, L, H = 10, 40, 5, 4
    steps = train.decode_steps(C, S, 3)
    assert steps == [30, 33, 36, 39]
    out = train.decode_cont_forward(m, params, kv, tok[:, C:], C, 0.2, 1.0, 0.5, 1e-6, 3)
    # reference: iterate layers with the full model's attn_bias, recomputing masks from its own K/V
    b5 = torch.zeros(L, 2, H, T, T, dtype=torch.float64)
    for _ in range(L):  # fixed point: layer l's K/V depend on the biases of layers < l only
        _, kvs = m(tok, attn_bias=b5, return_kv=True)
        b5 = torch.zeros(L, 2, H, T, T, dtype=torch.float64)
        for l in range(L):
            k, v = kvs[l]
            u = params.utility(l, k, v)  # (2, H, T)
            bud = train.soft_budgets_lh(params, 1.0, 0.2, 0)
            for t in steps:
                bud = train.soft_budgets_lh(params, 1.0, 0.2, t)[l]
                mk = soft_topk(u[..., :t], bud.clamp(min=1e-3, max=float(t)).reshape(1, H).expand(2, H), 0.5)
                for q in range(t, C + S):
                    b5[l, :, :, q, :t] += torch.log(mk + 1e-6)
    ref = m(tok, attn_bias=b5)
    err = float((ref[:, C:] - out).abs().max())
    assert err < 1e-8, err
    assert float((full[:, C:] - out).abs().max()) > 1e-3  # the masks change the output


if __name__ == "__main__":
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print("ok", name)
    print("all LKV python tests passed")
