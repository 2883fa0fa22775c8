"""kvevict.select on torch tensors: against float64 references (SnapKV, key norm, StreamingLLM),
across layouts, strides and storage types, for every method, with ragged lengths, positions,
per-query-head GQA, the plan cache and LKV from its artifact."""
import os

import pytest
import torch

import kvevict
from conftest import torch_gen
from reference import boundary_ok, budget_tokens, key_norm_scores, snapkv_scores, topk_select

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_layer(seed, B=2, Hkv=2, G=2, L=97, d=16, w=8, dtype=torch.float32, layout="HND", hidden=48):
    g = torch_gen(seed)
    k = torch.randn(B, Hkv, L, d, generator=g)
    v = torch.randn(B, Hkv, L, d, generator=g)
    q = torch.randn(B, Hkv * G, w, d, generator=g)
    wo = torch.randn(hidden, Hkv * G * d, generator=g) / d
    k, v, q, wo = (t.to(dtype) for t in (k, v, q, wo))
    if layout == "NHD":  # the same values stored [batch, seq, heads, dim]
        k, v, q = (t.permute(0, 2, 1, 3).contiguous() for t in (k, v, q))
    return q, k, v, wo


def hnd(t, layout):
    return t.permute(0, 2, 1, 3) if layout == "NHD" else t


def rows(sel):
    ip = sel.indptr.tolist()
    return [sel.indices[ip[r]:ip[r + 1]].tolist() for r in range(len(ip) - 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("budget", [40, 0.25])
def test_snapkv_matches_float64_reference(dtype, layout, G, budget):
    q, k, v, _ = make_layer(11 + G, G=G, dtype=dtype, layout=layout)
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=budget, layout=layout, return_scores=True)
    qh, kh = hnd(q, layout).double(), hnd(k, layout).double()
    B, Hkv, L, _ = kh.shape
    w = qh.shape[2]
    assert sel.batch == B and sel.heads == Hkv and sel.scores.shape == (B, Hkv, L)
    got = rows(sel)
    for b in range(B):
        for h in range(Hkv):
            ref_scores = snapkv_scores(qh[b, h * G:(h + 1) * G], kh[b, h])
            lib_scores = sel.scores[b, h].double()
            cand = slice(0, L - w)  # protected window slots score 0 in the library's output
            assert torch.allclose(lib_scores[cand], ref_scores[cand], rtol=1e-4, atol=1e-6)
            assert torch.all(lib_scores[L - w:] == 0)
            bt = budget_tokens(L, *(budget, 0.0) if isinstance(budget, int) else (0, budget), protected=w)
            ref = topk_select(ref_scores, L, bt, 0, w)
            assert boundary_ok(got[b * Hkv + h], ref, ref_scores), (b, h, got[b * Hkv + h], ref)


def test_strided_inputs_equal_contiguous_copies():
    g = torch_gen(5)
    big_k = torch.randn(2, 5, 200, 24, generator=g)
    big_q = torch.randn(2, 10, 20, 24, generator=g)
    k = big_k[:, 1:3, ::2, 4:20]   # every stride differs from a contiguous tensor's
    q = big_q[:, 2:6, ::2, 4:20]
    assert not k.is_contiguous() and not q.is_contiguous()
    a = kvevict.select("snapkv", queries=q, keys=k, budget=30, return_scores=True)
    b = kvevict.select("snapkv", queries=q.contiguous(), keys=k.contiguous(), budget=30, return_scores=True)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.indptr, b.indptr)
    assert torch.equal(a.scores, b.scores)


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_norm_and_streaming_llm_match_references(dtype):
    _, k, _, _ = make_layer(3, dtype=dtype)
    kd = k.double()
    B, H, L, _ = k.shape
    sel = kvevict.select("key_norm", keys=k, budget=30, layout="HND")
    for r, got in enumerate(rows(sel)):
        sc = key_norm_scores(kd[r // H, r % H])
        assert boundary_ok(got, topk_select(sc, L, 30, 0, 0), sc)
    sel = kvevict.select("streaming_llm", keys=k, budget=30, layout="HND")
    for got in rows(sel):
        assert got == list(range(4)) + list(range(L - 26, L))


def run_method(method, q, k, v, wo, layout="HND", budget=32, **kw):
    d = hnd(k, layout).shape[-1]
    qh = hnd(q, layout)
    extra = {}
    if method == "restkv":
        extra["wo_factor"] = kvevict.wo_factors(wo, qh.shape[1])
    if method in ("criticalkv", "critical_adakv", "defensivekv"):
        extra["wo"] = wo
    if method == "h2o":  # every prompt query: the window is the whole prompt
        L = hnd(k, layout).shape[2]
        g = torch_gen(99)
        full = torch.randn(qh.shape[0], qh.shape[1], L, d, generator=g).to(k.dtype)
        q = full.permute(0, 2, 1, 3).contiguous() if layout == "NHD" else full
    if method == "pyramidkv":
        extra.update(layer_idx=1, num_layers=4)
    return kvevict.select(method, queries=q, keys=k, values=v, budget=budget, layout=layout, **extra, **kw)


TRAINING_FREE = [m for m in kvevict.methods() if not m.startswith("lkv")]


@pytest.mark.parametrize("method", TRAINING_FREE)
def test_every_method_layouts_and_storage_types_agree(method):
    q, k, v, wo = make_layer(21, G=2)
    base = run_method(method, q, k, v, wo)
    B, H, L, _ = k.shape
    H = base.heads  # kv_heads; q_heads for adakv_published (one selection per query head)
    assert base.indptr.shape == (B * H + 1,) and base.indptr[0] == 0
    for r in rows(base):
        assert r == sorted(set(r)) and all(0 <= i < L for i in r)
    if method == "pyramidkv":  # layer 1 of 4 gets its schedule's share, the same for every head
        assert base.uniform and 32 < int(base.counts().flatten()[0]) < L
    elif method in ("adakv", "critical_adakv"):  # head-wise budgets keep each sequence's total
        assert torch.equal(base.counts().sum(dim=1), torch.full((B,), H * 32, dtype=base.counts().dtype))
    elif method == "adakv_published":  # the reference's per-head rounding: the total give or take a token per head
        assert ((base.counts().sum(dim=1) - H * 32).abs() <= H).all()
    else:
        assert base.uniform and base.counts().flatten()[0] == 32
    # NHD storage of the same values selects the same tokens.
    qn, kn, vn = (t.permute(0, 2, 1, 3).contiguous() for t in (q, k, v))
    nhd = run_method(method, qn, kn, vn, wo, layout="NHD")
    assert torch.equal(base.indices, nhd.indices) and torch.equal(base.indptr, nhd.indptr)
    # fp16 storage selects what fp32 storage of the same (rounded) values selects.
    q16, k16, v16, wo16 = (t.half() for t in (q, k, v, wo))
    a = run_method(method, q16, k16, v16, wo16)
    b = run_method(method, q16.float(), k16.float(), v16.float(), wo16.float())
    assert torch.equal(a.indices, b.indices) and torch.equal(a.indptr, b.indptr)


@pytest.mark.parametrize("method", ["snapkv", "restkv", "adakv", "key_norm"])
def test_ragged_lengths_and_positions(method):
    q, k, v, wo = make_layer(8, G=2)
    B, H, L, _ = k.shape
    lengths = torch.tensor([[97, 60], [33, 80]], dtype=torch.int32)
    positions = (torch.arange(L, dtype=torch.int32) * 3 + 7).expand(B, H, L).contiguous()
    sel = run_method(method, q, k, v, wo, lengths=lengths, positions=positions, return_scores=True)
    for r, got in enumerate(rows(sel)):
        n = int(lengths.flatten()[r])
        assert all(i < n for i in got)
        assert torch.all(sel.scores[r // H, r % H, n:] == 0)
    assert torch.equal(sel.positions, sel.indices * 3 + 7)


def test_per_query_head_selects_per_query_head():
    q, k, v, _ = make_layer(9, G=4)
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=20, gqa="per_query_head")
    assert sel.heads == q.shape[1] and sel.padded().shape == (2, 8, 20)
    with pytest.raises(kvevict.Error, match="heads"):
        kvevict.compact(k.clone(), sel)


def test_plan_and_workspace_are_reused():
    ev = kvevict.Evictor("snapkv", spatial_kernel=7)
    assert ev.params["spatial.kernel"] == 7
    for seed in range(6):  # new data of the same shapes: one plan, and each result is a fresh evictor's
        q, k, v, _ = make_layer(100 + seed)
        got = ev.select(queries=q, keys=k, values=v, budget=32)
        fresh = kvevict.Evictor("snapkv", spatial_kernel=7).select(queries=q, keys=k, values=v, budget=32)
        assert torch.equal(got.indices, fresh.indices) and torch.equal(got.indptr, fresh.indptr)
    s = ev.stats()
    assert s["plans"] == 1 and s["runs"] == 6 and s["workspace_allocs"] == 1 and s["workspace_bytes"] > 0
    ev.select(queries=q, keys=k, values=v, budget=0.5)  # another budget: a new plan, same workspace
    # lengths of the same shape but other values: a new plan (they fix the kept count)
    a = ev.select(queries=q, keys=k, values=v, budget=0.5, lengths=torch.tensor([[90, 60], [97, 40]], dtype=torch.int32))
    b = ev.select(queries=q, keys=k, values=v, budget=0.5, lengths=torch.tensor([[40, 97], [60, 90]], dtype=torch.int32))
    assert a.counts().tolist() == [[45, 30], [48, 20]] and b.counts().tolist() == [[20, 48], [30, 45]]
    s = ev.stats()
    assert s["plans"] == 4 and s["workspace_allocs"] == 1
    # a loop over layers plans once per layer
    ev2 = kvevict.Evictor("pyramidkv")
    for _ in range(3):
        for layer in range(4):
            ev2.select(queries=q, keys=k, values=v, budget=32, layer_idx=layer, num_layers=4)
    assert ev2.stats()["plans"] == 4 and ev2.stats()["runs"] == 12
    # The module-level select() keeps one evictor per (method, artifact, params).
    a = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=32, spatial_kernel=7)
    assert torch.equal(a.indices, fresh.indices)
    assert kvevict.select("snapkv", queries=q, keys=k, budget=32, spatial_kernel=7) is not None


def test_defaults_are_the_papers():
    r = kvevict.defaults("restkv")
    assert r["temporal.alpha"] == pytest.approx(0.3) and r["spatial.beta"] == 2000.0 and r["spatial.k_min"] == 5
    assert r["scorer.aggregation"] == "after" and r["scorer.use_wo"] is True and r["gqa"] == "mean"
    assert kvevict.defaults("snapkv")["spatial.kernel"] == 5
    assert kvevict.defaults("adakv")["budgeter.alpha"] == pytest.approx(0.2)
    assert kvevict.defaults("pyramidkv")["budgeter.beta"] == 20.0
    assert kvevict.defaults("h2o")["selector.recent_share"] == 0.5
    assert kvevict.defaults("tova")["gqa"] == "layer_mean"
    assert kvevict.defaults("streaming_llm")["selector.num_sink"] == 4


def artifact_path(repo):
    p = os.path.join(repo, "artifacts", "lkv", "stories260K.lkv")
    if not os.path.exists(p):
        pytest.skip(f"no LKV artifact at {p}")
    return p


@pytest.mark.parametrize("method", ["lkv", "lkv_uniform_budgets", "lkv_budgets_restkv", "lkv_budgets_attention"])
def test_lkv_methods_from_the_artifact(repo, method):
    art = artifact_path(repo)
    # stories260K's shapes: 5 layers, 4 KV heads (8 query heads), head_dim 8.
    q, k, v, wo = make_layer(12, B=1, Hkv=4, G=2, L=120, d=8, w=32, hidden=64)
    extra = {"wo_factor": kvevict.wo_factors(wo, 8)} if method == "lkv_budgets_restkv" else {}
    total = None
    for layer in range(5):
        sel = kvevict.select(method, queries=q, keys=k, values=v, budget=0.3, artifact=art, layer_idx=layer, num_layers=5,
                             **extra)
        for r in rows(sel):
            assert r == sorted(set(r)) and all(0 <= i < 120 for i in r)
        total = (total or 0) + int(sel.counts().sum())
    if method == "lkv_uniform_budgets":  # uniform: floor(0.3 * 120) = 36 per head and layer
        assert total == 5 * 4 * 36
    elif method == "lkv":  # learned head-wise budgets over all layers keep the model's total
        assert total == 5 * 4 * 36
    else:  # learned budgets with the window protected: at least the window per head
        assert 5 * 4 * 32 <= total <= 5 * 4 * 120
    assert "budgeter.temperature" in kvevict.defaults("lkv", artifact=art)


def test_threads_share_a_module_level_evictor_safely():
    """kvevict.select keeps one evictor per (method, params): calls from several threads are
    serialised on it and each gets its own inputs' result."""
    import threading
    layers = [make_layer(300 + i, L=60 + 7 * i) for i in range(6)]
    want = [kvevict.Evictor("snapkv").select(queries=q, keys=k, budget=16).indices for q, k, _, _ in layers]
    errors = []

    def work(t):
        for rep in range(40):
            i = (t + rep) % len(layers)
            q, k, _, _ = layers[i]
            got = kvevict.select("snapkv", queries=q, keys=k, budget=16).indices
            if not torch.equal(got, want[i]):
                errors.append((t, rep, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
