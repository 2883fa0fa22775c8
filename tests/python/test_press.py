"""kvevict.press end to end on the real stories260K model (tools/lkv/llama2c.py, PyTorch) against
the C++ engine's fidelity program on the same prompt: for every preset (and the LKV rows), the
press keeps exactly the positions the C++ engine keeps in every layer and KV head, and its KL
(full cache || evicted cache, teacher-forced continuation) equals the C++ report's within 1e-6.

One exception, by construction: key norm scores a token by its key's norm, and at layer 0 a token
repeated in the prompt has the same key norm at every position in exact arithmetic (RoPE
preserves norms); fp32 rounding of the rotation breaks those ties differently in C++ and PyTorch.
KeyNorm's selections must therefore agree up to such ties (the differing positions' float64 norms
equal within 1e-6), and its KL is compared only where the selections coincide.

Needs the model folder (../shared/models/stories260K or $KVEVICT_MODEL_DIR) and the fidelity
program ($KVEVICT_FIDELITY_BIN, which ctest sets); skips with a message when either is missing."""
import math
import os
import subprocess
import sys

import pytest
import torch

import kvevict
from conftest import REPO
from kvevict.press import Press

sys.path.insert(0, os.path.join(REPO, "tools", "lkv"))
import llama2c  # noqa: E402

# fidelity row -> kvevict method (the presets and the LKV rows; Random, the oracles and the custom
# AdaKV+LKV-T composition are not methods of the binding)
ROWS = {
    "ReST-KV": "restkv", "SnapKV": "snapkv", "PyramidKV": "pyramidkv", "AdaKV": "adakv", "H2O": "h2o", "TOVA": "tova",
    "StreamingLLM": "streaming_llm", "KeyNorm": "key_norm", "CriticalKV": "criticalkv", "CriticalAdaKV": "critical_adakv", "LKV": "lkv",
    "Uniform+LKV-T": "lkv_uniform_budgets", "LKV-H+ReST-KV": "lkv_budgets_restkv", "LKV-H+SnapKV": "lkv_budgets_attention",
}
ARTIFACT = os.environ.get("KVEVICT_LKV_ARTIFACT") or os.path.join(REPO, "artifacts", "lkv", "stories260K.lkv")


def model_dir():
    d = os.environ.get("KVEVICT_MODEL_DIR") or os.path.join(REPO, "..", "shared", "models", "stories260K")
    return d if os.path.isfile(os.path.join(d, "stories260K.bin")) else None


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The C++ fidelity program's smoke run (1 prompt, keep 20% and 50%, 8 steps) with --dump."""
    mdir = model_dir()
    if mdir is None:
        pytest.skip("stories260K model folder not found (../shared/models/stories260K or KVEVICT_MODEL_DIR): end-to-end press test skipped")
    exe = os.environ.get("KVEVICT_FIDELITY_BIN")
    if not exe or not os.path.isfile(exe):
        pytest.skip("KVEVICT_FIDELITY_BIN is not set to the kvevict_fidelity program (ctest sets it)")
    out = tmp_path_factory.mktemp("fidelity")
    dump = out / "dump.txt"
    r = subprocess.run([exe, "--smoke", "--model", mdir, "--out", str(out), "--dump", str(dump), "--methods", ",".join(ROWS)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    prompt, inputs, kl, kept = None, None, {}, {}
    for line in dump.read_text().splitlines():
        f = line.split("\t")
        if f[0] == "prompt":
            prompt = [int(x) for x in f[2].split()]
        elif f[0] == "inputs":
            inputs = [int(x) for x in f[2].split()]
        elif f[0] == "kl":
            kl[(f[1], float(f[2]))] = float(f[4])
        elif f[0] == "kept":
            kept[(f[1], float(f[2]), int(f[4]), int(f[5]))] = [int(x) for x in f[6].split()]
    assert prompt and inputs and kl and kept
    model = llama2c.load_llama2c(os.path.join(mdir, "stories260K.bin"))
    _, cache = run(model, prompt, [])
    keys = [k[0, :, :len(prompt)].double() for k in cache.keys]  # (kv_heads, L, head_dim) per layer
    return {"prompt": prompt, "inputs": inputs, "kl": kl, "kept": kept, "model": model, "keys": keys}


def run(model, prompt, inputs, press=None):
    """Prefill (through the press when given), then the continuation fed back one token at a time;
    the next-token log-probabilities (float64) of every continuation step, and the cache."""
    cache = llama2c.KVCache(model.cfg, batch=1, capacity=len(prompt) + len(inputs) + 1)
    with torch.no_grad():
        if press is None:
            model(torch.tensor([prompt]), cache=cache)
        else:
            with press(model):
                model(torch.tensor([prompt]), cache=cache)
        logp = []
        for t in inputs:
            logits = model(torch.tensor([[t]]), cache=cache)[0, -1]
            logp.append(torch.log_softmax(logits.double(), dim=-1))
    return logp, cache


def test_full_cache_reproduces_the_engine_continuation(engine_run):
    """The PyTorch model with a cache continues the prompt as the C++ engine does (greedy)."""
    m, prompt, inputs = engine_run["model"], engine_run["prompt"], engine_run["inputs"]
    logp, _ = run(m, prompt, inputs)
    assert [int(lp.argmax()) for lp in logp[:-1]] == inputs[1:]


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_press_equals_the_cpp_engine(engine_run, row, fraction):
    m, prompt, inputs = engine_run["model"], engine_run["prompt"], engine_run["inputs"]
    if not hasattr(test_press_equals_the_cpp_engine, "full"):
        test_press_equals_the_cpp_engine.full = run(m, prompt, inputs)[0]
    full = test_press_equals_the_cpp_engine.full
    method = ROWS[row]
    press = Press(method, budget=fraction, artifact=ARTIFACT if method.startswith("lkv") else None)
    logp, cache = run(m, prompt, inputs, press)
    same = True
    for l in range(m.cfg.n_layers):
        for h in range(m.cfg.n_kv_heads):
            n = int(cache.lengths[l][0, h]) - len(inputs)  # the continuation was appended after eviction
            got = cache.positions[l][0, h, :n].tolist()
            want = engine_run["kept"][(row, fraction, l, h)]
            if got == want:
                continue
            assert row == "KeyNorm", (row, fraction, l, h, sorted(set(got) ^ set(want)))
            norms = engine_run["keys"][l][h].norm(dim=1)
            diff = sorted(set(got) ^ set(want))
            vals = [float(norms[i]) for i in diff]
            assert len(got) == len(want) and max(vals) - min(vals) <= 1e-6 * max(vals), (l, h, diff, vals)
            same = False
    kl = sum(max(float((lp.exp() * (lp - lq)).sum()), 0.0) for lp, lq in zip(full, logp)) / len(inputs)
    assert math.isfinite(kl)
    if same:
        assert abs(kl - engine_run["kl"][(row, fraction)]) <= 1e-6, (row, fraction, kl, engine_run["kl"][(row, fraction)])


@pytest.mark.parametrize("method", ["snapkv", "adakv", "h2o"])
def test_press_batch_of_two_equals_each_sequence_alone(method):
    """Batch 2 through the KVCache and the press keeps, per sequence, what batch 1 keeps (AdaKV:
    ragged heads), and decoding after it gives the same logits."""
    mdir = model_dir()
    if mdir is None:
        pytest.skip("stories260K model folder not found: batched press test skipped")
    m = llama2c.load_llama2c(os.path.join(mdir, "stories260K.bin"))
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, 512, (2, 120), generator=g)
    nxt = torch.randint(1, 512, (2, 1), generator=g)

    def go(ids, nid):
        cache = llama2c.KVCache(m.cfg, batch=ids.shape[0], capacity=ids.shape[1] + 2)
        with torch.no_grad():
            with Press(method, budget=0.25)(m):
                m(ids, cache=cache)
            out = m(nid, cache=cache)[:, -1]
        return cache, out

    both, out2 = go(prompts, nxt)
    for b in range(2):
        one, out1 = go(prompts[b:b + 1], nxt[b:b + 1])
        for l in range(m.cfg.n_layers):
            assert torch.equal(both.lengths[l][b], one.lengths[l][0])
            for h in range(m.cfg.n_kv_heads):
                n = int(one.lengths[l][0, h])
                assert torch.equal(both.positions[l][b, h, :n], one.positions[l][0, h, :n])
        assert (out2[b] - out1[0]).abs().max() < 1e-4 * out1.abs().max()


def test_press_refuses_a_second_prefill():
    mdir = model_dir()
    if mdir is None:
        pytest.skip("stories260K model folder not found")
    m = llama2c.load_llama2c(os.path.join(mdir, "stories260K.bin"))
    cache = llama2c.KVCache(m.cfg, batch=1, capacity=100)
    ids = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), Press("snapkv", budget=0.5)(m):
        m(ids, cache=cache)
        with pytest.raises(ValueError, match="compresses once"):
            m(ids[:, :10], cache=cache)
    assert m.cache_hooks == []  # the context manager removed its hook, also after the error
