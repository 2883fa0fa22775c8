"""The Python API as a PyTorch / kvpress user meets it: adakv_published, compression_ratio, numpy
and torch scalars, int64 indices for torch.gather, ArgumentError for calls Python cannot bind, no
silent layout guess, and DecodeSchedule (the C++ kvevict::decode_schedule)."""
import numpy as np
import pytest
import torch

import kvevict


def layer(b=1, hk=4, g=2, n=300, d=16, w=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hk, n, d, generator=gen)
    return torch.randn(b, hk * g, w, d, generator=gen), k, torch.randn(b, hk, n, d, generator=gen)


def test_adakv_published_is_callable_and_per_query_head():
    q, k, v = layer()
    sel = kvevict.select("adakv_published", queries=q, keys=k, values=v, budget=40)
    assert "adakv_published" in kvevict.methods()
    # one row per query head; the reference's per-head rounding keeps the total give or take a token per head
    assert sel.heads == q.shape[1] and abs(int(sel.counts().sum()) - q.shape[1] * 40) <= q.shape[1]
    p = kvevict.defaults("adakv_published")
    assert p["spatial.kernel"] == 7 and abs(p["budgeter.alpha"] - 0.2) < 1e-7 and p["gqa"] == "per_query_head"
    assert p["budgeter.exact_total"] is False
    # exact_total = True is AdaKV's exact layer total on the same scores
    exact = kvevict.select("adakv_published", queries=q, keys=k, values=v, budget=40, budgeter_exact_total=True)
    assert int(exact.counts().sum()) == q.shape[1] * 40


@pytest.mark.parametrize("cr", [0.0, 0.5, 0.8, 0.9])
def test_compression_ratio_is_kvpress_fraction_removed(cr):
    q, k, v = layer(n=333)
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, compression_ratio=cr)
    want = max(int(333 * (1 - cr)), 8)  # kvpress: n_kept = int(k_len * (1 - compression_ratio)); the window is kept
    assert (sel.counts() == want).all()
    same = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=1.0 - cr)
    assert torch.equal(sel.indices, same.indices)


@pytest.mark.parametrize("budget", [np.int64(50), np.int32(50), torch.tensor(50), torch.tensor(50, dtype=torch.int32)])
def test_integer_scalars_are_budgets_in_tokens(budget):
    q, k, v = layer()
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=budget, layer_idx=np.int64(0), num_layers=torch.tensor(1))
    assert (sel.counts() == 50).all()


@pytest.mark.parametrize("budget", [np.float64(0.25), np.float32(0.25), torch.tensor(0.25)])
def test_float_scalars_are_keep_fractions(budget):
    q, k, v = layer(n=400)
    assert (kvevict.select("snapkv", queries=q, keys=k, values=v, budget=budget).counts() == 100).all()


def test_numpy_parameter_values():
    ev = kvevict.Evictor("restkv", temporal_alpha=np.float32(0.5), spatial_k_min=np.int64(3))
    assert ev.params["temporal.alpha"] == 0.5 and ev.params["spatial.k_min"] == 3


def test_padded_is_int64_and_gathers():
    q, k, v = layer()
    sel = kvevict.select("adakv", queries=q, keys=k, values=v, budget=40)  # ragged rows: padded with fill
    idx = sel.padded(fill=0)
    assert idx.dtype == torch.int64 and idx.shape == (1, 4, int(sel.counts().max()))
    kept = torch.gather(k, 2, idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1]))
    for h in range(4):
        n = int(sel.counts()[0, h])
        assert torch.equal(kept[0, h, :n], k[0, h, sel.indices[sel.indptr[h]:sel.indptr[h + 1]].long()])
    uni = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=40).padded()
    assert uni.dtype == torch.int64 and uni.shape == (1, 4, 40)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: kvevict.select("snapkv", queries=q, keys=k, values=v), "budget is required"),
    (lambda q, k, v: kvevict.select(queries=q, keys=k, values=v, budget=4), "method"),
    (lambda q, k, v: kvevict.select("snapkv", q, k, v, 40), "positional"),
    (lambda q, k, v: kvevict.Evictor().select(keys=k, budget=4), "method"),
    (lambda q, k, v: kvevict.Evictor("snapkv").select(queries=q, values=v, budget=40), "keys"),
    (lambda q, k, v: kvevict.compact(k), "selection"),
    (lambda q, k, v: kvevict.wo_factors(torch.eye(4)), "q_heads"),
    (lambda q, k, v: kvevict.DecodeSchedule(interval=2), "budget is required"),
    (lambda q, k, v: kvevict.DecodeSchedule(2, 40), "positional"),
])
def test_unbindable_calls_raise_argument_error(call, match):
    q, k, v = layer()
    with pytest.raises(kvevict.ArgumentError, match=match) as e:
        call(q, k, v)
    assert isinstance(e.value, kvevict.Error) and isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


def test_misspelt_keyword_names_itself():
    q, k, v = layer()
    with pytest.raises(kvevict.Error, match="budjet"):
        kvevict.select("snapkv", queries=q, keys=k, values=v, budget=40, budjet=3)


@pytest.mark.parametrize("method", ["key_norm", "streaming_llm"])
def test_ambiguous_layout_is_refused(method):
    k = torch.randn(2, 64, 2, 16)
    with pytest.raises(kvevict.Error, match="pass layout="):
        kvevict.select(method, keys=k, values=k, budget=4)
    nhd = kvevict.select(method, keys=k, values=k, budget=4, layout="NHD")
    assert nhd.heads == 2 and (nhd.counts() == 4).all()
    # lengths tell the heads axis: [batch, kv_heads] = (2, 2) fits NHD only
    inferred = kvevict.select(method, keys=k, values=k, budget=4, lengths=torch.full((2, 2), 64, dtype=torch.int32))
    assert torch.equal(inferred.indices, nhd.indices)


def test_layout_inferred_only_when_the_shapes_decide():
    q, k, v = layer(hk=4, g=2, n=300)  # HND: queries' 8 heads a multiple of 4; NHD: 8 % 300 != 0
    assert torch.equal(kvevict.select("snapkv", queries=q, keys=k, values=v, budget=40).indices,
                       kvevict.select("snapkv", queries=q, keys=k, values=v, budget=40, layout="HND").indices)
    sq = torch.randn(1, 4, 4, 16)  # keys [1, 4, 4, 16] and queries [1, 4, 4, 16]: both layouts fit
    with pytest.raises(kvevict.Error, match="fit both layouts"):
        kvevict.select("snapkv", queries=sq, keys=sq, values=sq, budget=4)
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=40, layout="HND")
    square = torch.randn(1, 4, 4, 16)  # compact: the selection's 4 heads on both axes 1 and 2
    with pytest.raises(kvevict.Error, match="pass layout="):
        kvevict.compact(square, sel)


def test_decode_schedule_follows_the_cpp_schedule():
    s = kvevict.DecodeSchedule(interval=4, budget=40, protect_prefix=2, protect_recent=3)
    a = s.after_prefill(100)
    assert a.evict and a.keep_tokens == 40 and a.tokens_seen == 100 and a.periods == 0
    ev, budget = s.apply(a, kvevict.Evictor("snapkv"), window=8)
    assert budget == 40 and ev.params["selector.num_sink"] == 2 and ev.params["selector.num_recent"] == 8
    s.evicted(a)
    for i in range(3):
        assert not s.after_decode().evict
    a = s.after_decode()
    assert a.evict and a.periods == 1 and a.generated == 4
    c = s.copy()
    s.evicted(a)
    assert s.evictions == 2 and c.evictions == 1 and c.pending_tokens == 4  # the copy is independent
    with pytest.raises(kvevict.Error, match="evicted"):
        s.evicted(a)  # twice
    # PyramidKV: the reference length is the tokens seen; the evictor given is unchanged
    p = kvevict.Evictor("pyramidkv")
    s2 = kvevict.DecodeSchedule(interval=1, compression_ratio=0.5)
    a2 = s2.after_prefill(64)
    ev2, b2 = s2.apply(a2, p, window=8)
    assert b2 == 32 and ev2.params["budgeter.num_tokens"] == 64 and p.params["budgeter.num_tokens"] == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(interval=0, budget=4), "interval = 0"),
    (dict(interval=1, budget=4, protect_recent=5), "protect"),
    (dict(interval=1, budget=0.0), "budget = 0.0"),
    (dict(interval=1, budget=4, protect_prefix=-1), "protect_prefix = -1"),
    (dict(interval=1, budget=4, evict_after_prefill=1), "evict_after_prefill"),
])
def test_decode_schedule_refuses(kwargs, match):
    with pytest.raises(kvevict.Error, match=match):
        kvevict.DecodeSchedule(**kwargs)


def test_decode_schedule_refuses_out_of_order():
    s = kvevict.DecodeSchedule(interval=2, budget=10)
    with pytest.raises(kvevict.Error, match="no prefill"):
        s.after_decode()
    with pytest.raises(kvevict.Error, match="tokens = 0"):
        s.after_prefill(0)
    assert s.tokens_seen == 0


def test_evictor_docstring_states_thread_safety_as_the_docs():
    doc = kvevict.Evictor.__doc__
    assert "serialised" in doc and "Not thread-safe" not in doc


def test_build_info_names_the_gemm_and_the_isa():
    info = kvevict.build_info()
    assert info["cpu_gemm"] in ("eigen", "blis")
    assert info["cpu_isa"] in ("avx512", "avx2+fma", "avx2", "avx", "sse2", "generic")
    assert info["version"] == kvevict.__version__
    assert isinstance(info["cuda"], bool)
