"""kvevict.compact: in place, equal to a torch gather of the kept slots, every layout and
storage type, ragged (head-wise) selections; nothing written on error."""
import pytest
import torch

import kvevict
from conftest import torch_gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_compact_equals_gather(dtype, layout, method):
    g = torch_gen(4)
    B, H, G, L, d, w = 2, 3, 2, 80, 16, 8
    k = torch.randn(B, H, L, d, generator=g).to(dtype)
    v = torch.randn(B, H, L, d, generator=g).to(dtype)
    q = torch.randn(B, H * G, w, d, generator=g).to(dtype)
    if layout == "NHD":
        k, v, q = (t.permute(0, 2, 1, 3).contiguous() for t in (k, v, q))
    sel = kvevict.select(method, queries=q, keys=k, values=v, budget=24, layout=layout)
    view = (lambda t: t.permute(0, 2, 1, 3)) if layout == "NHD" else (lambda t: t)
    before_k, before_v = view(k).clone(), view(v).clone()
    lk = kvevict.compact(k, sel, layout=layout)
    lv = kvevict.compact(v, sel, layout=layout)
    assert torch.equal(lk, sel.counts()) and torch.equal(lv, lk)
    ip = sel.indptr.tolist()
    for r in range(B * H):
        b, h = divmod(r, H)
        idx = sel.indices[ip[r]:ip[r + 1]].long()
        n = idx.numel()
        assert torch.equal(view(k)[b, h, :n], before_k[b, h, idx])
        assert torch.equal(view(v)[b, h, :n], before_v[b, h, idx])
        assert torch.equal(view(k)[b, h, n:], before_k[b, h, n:])  # slots past the count untouched


def test_compact_errors_leave_the_cache_untouched():
    g = torch_gen(6)
    k = torch.randn(1, 2, 50, 8, generator=g)
    q = torch.randn(1, 2, 4, 8, generator=g)
    sel = kvevict.select("snapkv", queries=q, keys=k, budget=10)
    other = torch.randn(1, 3, 50, 8, generator=g)
    keep = other.clone()
    with pytest.raises(kvevict.Error, match="heads"):
        kvevict.compact(other, sel)
    assert torch.equal(other, keep)
    short = k[:, :, :5].clone()  # a cache shorter than the selected slots
    keep = short.clone()
    with pytest.raises(kvevict.Error):
        kvevict.compact(short, sel)
    assert torch.equal(short, keep)
    bad = kvevict.Selection(indptr=sel.indptr.clone(), indices=sel.indices.flip(0).contiguous(), positions=sel.positions,
                            batch=1, heads=2)
    keep = k.clone()
    with pytest.raises(kvevict.Error, match="ascending"):
        kvevict.compact(k, bad)
    assert torch.equal(k, keep)
    with pytest.raises(kvevict.Error, match="dtype"):
        kvevict.compact(k.double(), sel)
