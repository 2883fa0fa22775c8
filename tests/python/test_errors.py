"""Bad input to the Python binding raises kvevict.Error (a ValueError) with the library's message,
naming the argument; nothing is written."""
import os

import pytest
import torch

import kvevict
from conftest import torch_gen


@pytest.fixture
def layer():
    g = torch_gen(2)
    k = torch.randn(1, 2, 40, 8, generator=g)
    return torch.randn(1, 4, 6, 8, generator=g), k, torch.randn_like(k)


def test_error_is_a_value_error():
    assert issubclass(kvevict.Error, ValueError)


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=0), "budget = 0"),
    (dict(budget=1.5), r"budget = 1.5"),
    (dict(budget=True), "budget must be an int"),
    (dict(budget="10"), "budget must be an int"),
    (dict(budget=10, layout="BHSD"), "layout"),
    (dict(budget=10, spatial_kernel=4), "spatial.kernel = 4"),
    (dict(budget=10, spatial_kernel=True), "spatial.kernel must be an int"),
    (dict(budget=10, gqa="median"), "gqa = 'median' is not one of"),
    (dict(budget=10, temporal_alpha=0.5), "temporal.alpha is not a parameter of method 'snapkv'"),
    (dict(budget=10, lengths=torch.full((1, 2), 41, dtype=torch.int32)), "lengths"),
    (dict(budget=10, lengths=torch.full((1, 2), 20, dtype=torch.int64)), "lengths.dtype"),
    (dict(budget=10, lengths=torch.full((2, 2), 20, dtype=torch.int32)), "lengths shape"),
    (dict(budget=10, positions=torch.zeros(1, 2, 40, dtype=torch.int64)), "positions.dtype"),
    (dict(budget=10, lengths=torch.full((1, 1), 20, dtype=torch.int32)), "lengths shape"),  # too small: never read past
    (dict(budget=10, positions=torch.zeros(1, 2, 7, dtype=torch.int32)), "positions shape"),
    (dict(budget=10, selector_num_sink=2**70), "selector.num_sink = .* is out of range"),
    (dict(budget=10, num_threads=10**6), "num_threads"),
    (dict(budget=10, artifact="x.lkv"), "reads no LKV artifact"),
])
def test_bad_arguments(layer, kwargs, match):
    q, k, v = layer
    with pytest.raises(kvevict.Error, match=match):
        kvevict.select("snapkv", queries=q, keys=k, values=v, **kwargs)


def test_bad_tensors(layer):
    q, k, v = layer
    with pytest.raises(kvevict.Error, match="keys.dtype = torch.int32"):
        kvevict.select("snapkv", queries=q, keys=k.int(), budget=10)
    with pytest.raises(kvevict.Error, match="keys has 3 dimensions"):
        kvevict.select("snapkv", queries=q, keys=k[0], budget=10)
    with pytest.raises(kvevict.Error, match="queries.dtype = float16"):
        kvevict.select("snapkv", queries=q.half(), keys=k, budget=10)
    with pytest.raises(kvevict.Error, match="device 'meta'"):
        kvevict.select("snapkv", queries=q, keys=torch.empty(1, 2, 40, 8, device="meta"), budget=10)
    with pytest.raises(kvevict.Error, match="must be a torch.Tensor"):
        kvevict.select("snapkv", queries=q, keys=k.numpy(), budget=10)
    with pytest.raises(kvevict.Error, match="q_heads = 3 is not a positive multiple"):
        kvevict.select("snapkv", queries=q[:, :3], keys=k, budget=10)
    with pytest.raises(kvevict.Error, match="queries head_dim"):
        kvevict.select("snapkv", queries=q[..., :4], keys=k, budget=10)
    with pytest.raises(kvevict.Error, match="queries.data is null"):
        kvevict.select("snapkv", keys=k, budget=10, layout="HND")
    with pytest.raises(kvevict.Error, match="values.data is null"):
        kvevict.select("restkv", queries=q, keys=k, budget=10, scorer_use_wo=False)
    with pytest.raises(kvevict.Error, match=r"wo_factor.data is null.*kvevict.wo_factors\(o_proj.weight"):
        kvevict.select("restkv", queries=q, keys=k, values=v, budget=10)
    with pytest.raises(kvevict.Error, match="wo.data is null"):
        kvevict.select("criticalkv", queries=q, keys=k, values=v, budget=10)
    bad = k.clone()
    bad[0, 1, 7, 3] = float("nan")
    with pytest.raises(kvevict.Error, match="non_finite"):
        kvevict.select("snapkv", queries=q, keys=bad, budget=10)


def test_bad_methods_and_artifacts(tmp_path):
    with pytest.raises(kvevict.Error, match="method = 'snapkvv' is not a kvevict method"):
        kvevict.Evictor("snapkvv")
    with pytest.raises(kvevict.Error, match="artifact is required"):
        kvevict.Evictor("lkv")
    with pytest.raises(kvevict.Error, match="io_error"):
        kvevict.Evictor("lkv", artifact=str(tmp_path / "missing.lkv"))
    junk = tmp_path / "junk.lkv"
    junk.write_bytes(b"not an artifact" * 20)
    with pytest.raises(kvevict.Error, match="format_error"):
        kvevict.Evictor("lkv", artifact=str(junk))


def test_wo_factors_errors():
    with pytest.raises(kvevict.Error, match="q_heads = 3"):
        kvevict.wo_factors(torch.randn(16, 32), 3)
    w = torch.randn(16, 32)
    w[2, 5] = float("inf")
    with pytest.raises(kvevict.Error, match="not finite"):
        kvevict.wo_factors(w, 4)


def test_compact_refuses_malformed_selections_and_shared_rows():
    g = torch_gen(9)
    k = torch.randn(1, 2, 30, 4, generator=g)
    keep = k.clone()
    bad = kvevict.Selection(indptr=torch.tensor([0, 3, 2], dtype=torch.int32), indices=torch.tensor([0, 1], dtype=torch.int32),
                            positions=torch.tensor([0, 1], dtype=torch.int32), batch=1, heads=2)
    with pytest.raises(kvevict.Error, match="indptr"):
        kvevict.compact(k, bad)
    bad.indptr = torch.tensor([1, 1, 2], dtype=torch.int32)
    with pytest.raises(kvevict.Error, match=r"indptr\[0\]"):
        kvevict.compact(k, bad)
    assert torch.equal(k, keep)
    base = torch.randn(1, 1, 30, 4, generator=g)
    shared = base.expand(1, 2, 30, 4)  # both heads are the same memory
    sel = kvevict.select("key_norm", keys=shared.contiguous(), budget=8, layout="HND")
    before = base.clone()
    with pytest.raises(kvevict.Error, match="share memory"):
        kvevict.compact(shared, sel)
    assert torch.equal(base, before)


def test_compact_when_nothing_is_kept():
    k = torch.randn(1, 2, 16, 4)
    sel = kvevict.select("key_norm", keys=k, budget=8, lengths=torch.zeros(1, 2, dtype=torch.int32))
    assert int(sel.indptr[-1]) == 0
    keep = k.clone()
    assert kvevict.compact(k, sel).tolist() == [[0, 0]]
    assert torch.equal(k, keep)


def test_empty_tensors_are_checked_not_taken_as_absent(layer):
    q, k, v = layer
    with pytest.raises(kvevict.Error, match="lengths shape"):
        kvevict.select("snapkv", queries=q, keys=k, budget=10, lengths=torch.empty((0, 2), dtype=torch.int32))
    with pytest.raises(kvevict.Error, match="values.extent"):
        kvevict.select("snapkv", queries=q, keys=k, values=torch.empty(1, 2, 0, 8), budget=10)
    with pytest.raises(kvevict.Error, match="window = 0"):
        kvevict.select("snapkv", queries=torch.empty(1, 4, 0, 8), keys=k, budget=10)


def test_scalar_arguments_are_typed(layer):
    q, k, _ = layer
    for kw, match in [(dict(layer_idx=1.7), "layer_idx must be an int"), (dict(layer_idx=True), "layer_idx must be an int"),
                      (dict(num_layers=2**64), "num_layers"), (dict(num_threads=None), "num_threads must be an int"),
                      (dict(return_scores="no"), "return_scores must be a bool")]:
        with pytest.raises(kvevict.Error, match=match):
            kvevict.select("snapkv", queries=q, keys=k, budget=10, **kw)
    with pytest.raises(kvevict.Error, match="method must be a str"):
        kvevict.Evictor(5)
    with pytest.raises(kvevict.Error, match="given twice"):
        kvevict.Evictor("restkv", temporal_alpha=0.1, **{"temporal.alpha": 0.9})
    with pytest.raises(kvevict.Error, match="artifact: "):
        kvevict.Evictor("lkv", artifact="/nonexistent/x.lkv")


def test_compact_refuses_overlapping_or_grad_caches(layer):
    q, k, _ = layer
    sel = kvevict.select("snapkv", queries=q, keys=k, budget=8)
    buf = torch.randn(64)
    keep = buf.clone()
    with pytest.raises(kvevict.Error, match="share memory"):
        kvevict.compact(buf.as_strided((1, 2, 16, 8), (0, 4, 1, 1)), sel)
    assert torch.equal(buf, keep)
    leaf = k.clone().requires_grad_(True)
    with pytest.raises(kvevict.Error, match="requires grad"):
        kvevict.compact(leaf, sel)


def test_press_checks_its_arguments_at_construction():
    from kvevict.press import Press
    with pytest.raises(kvevict.Error, match="budget"):
        Press("snapkv", budget=0)
    with pytest.raises(kvevict.Error, match="window"):
        Press("snapkv", budget=8, window="32")
