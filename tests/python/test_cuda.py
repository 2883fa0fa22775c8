"""CUDA tensors through the binding's CUDA backend, against the CPU backend on the same values.
Runs only when torch has a CUDA device and the module was built with the CUDA backend
(kvevict._C.cuda); Debian's python3-torch has no CUDA, so on this project's machines it skips."""
import pytest
import torch

import kvevict
from test_select import make_layer, run_method

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and kvevict._C.cuda),
                               reason="no CUDA device in torch, or kvevict built without the CUDA backend")
CUDA_METHODS = [m for m in kvevict.methods() if not m.startswith(("lkv", "critical"))]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", CUDA_METHODS)
def test_cuda_selects_what_the_cpu_selects(method, dtype):
    q, k, v, wo = (t.to(dtype) for t in make_layer(31, G=2))
    cpu = run_method(method, q, k, v, wo, return_scores=True)
    dev = run_method(method, q.cuda(), k.cuda(), v.cuda(), wo.cuda(), return_scores=True)
    assert dev.indices.is_cuda
    assert torch.equal(dev.indptr.cpu(), cpu.indptr) and torch.equal(dev.indices.cpu(), cpu.indices)
    assert torch.allclose(dev.scores.cpu(), cpu.scores, rtol=1e-4, atol=1e-6)


@needs_gpu
def test_cuda_compact_and_errors():
    q, k, v, _ = make_layer(32, G=2)
    kc = k.cuda()
    sel = kvevict.select("snapkv", queries=q.cuda(), keys=kc, values=v.cuda(), budget=24)
    ref = k.clone()
    kvevict.compact(ref, kvevict.select("snapkv", queries=q, keys=k, values=v, budget=24))
    kvevict.compact(kc, sel)
    assert torch.equal(kc.cpu()[:, :, :24], ref[:, :, :24])
    with pytest.raises(kvevict.Error, match="device"):
        kvevict.select("snapkv", queries=q, keys=kc, budget=24)  # queries on the CPU
    with pytest.raises(kvevict.Error, match="CPU backend only"):
        kvevict.select("criticalkv", queries=q.cuda(), keys=kc, values=v.cuda(), wo=torch.randn(48, 64).cuda(), budget=24)
    bad = k.cuda().clone()
    bad[0, 1, 3, 2] = float("nan")
    with pytest.raises(kvevict.Error, match="NaN"):
        kvevict.select("snapkv", queries=q.cuda(), keys=bad, budget=24)


def test_cuda_tensors_without_the_backend_are_refused():
    if kvevict._C.cuda:
        pytest.skip("this module has the CUDA backend")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device to make a CUDA tensor with")
    k = torch.randn(1, 2, 16, 8, device="cuda")
    with pytest.raises(kvevict.Error, match="without the CUDA backend"):
        kvevict.select("key_norm", keys=k, budget=8)
