"""kvevict.press end to end on the real stories260K model (kvevict.models.llama2c, PyTorch) against
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
from conftest import REPO, model_dir
from kvevict.press import Press

from kvevict.models import llama2c

# fidelity row -> kvevict method (the presets and the LKV rows; Random, the oracles and the custom
# AdaKV+LKV-T composition are not methods of the binding)
ROWS = {
    "ReST-KV": "restkv", "SnapKV": "snapkv", "PyramidKV": "pyramidkv", "AdaKV": "adakv", "H2O": "h2o", "TOVA": "tova",
    "StreamingLLM": "streaming_llm", "KeyNorm": "key_norm", "CriticalKV": "criticalkv", "CriticalAdaKV": "critical_adakv", "DefensiveKV": "defensivekv",
    "LKV": "lkv",
    "Uniform+LKV-T": "lkv_uniform_budgets", "LKV-H+ReST-KV": "lkv_budgets_restkv", "LKV-H+SnapKV": "lkv_budgets_attention",
}
ARTIFACT = os.environ.get("KVEVICT_LKV_ARTIFACT") or os.path.join(REPO, "artifacts", "lkv", "stories260K.lkv")


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
    assert m.cache_hooks == [] and m.cache_pre_hooks == []  # the context manager removed its hooks, also after the error


# --- decode-time eviction against the C++ decoding program -----------------------------------
DECODE_ROWS = {"SnapKV": "snapkv", "AdaKV": "adakv"}
DECODE_KEEP, DECODE_BETA = 0.1, 16


@pytest.fixture(scope="module")
def decoding_run(tmp_path_factory):
    """kvevict_decoding on 6 Sherlock excerpts (the report's rule at 6; 96-token prompts, greedy continuation of
    the full cache to 512 positions, teacher-forced), cap 10% of 512 = 51 tokens per head, beta 16,
    rows SnapKV and AdaKV, with --dump (prompts, fed tokens, per-excerpt KL at %.17g)."""
    mdir = model_dir()
    if mdir is None:
        pytest.skip("stories260K model folder not found (../shared/models/stories260K or KVEVICT_MODEL_DIR): decode-time press test skipped")
    exe = os.environ.get("KVEVICT_DECODING_BIN")
    if not exe or not os.path.isfile(exe):
        pytest.skip("KVEVICT_DECODING_BIN is not set to the kvevict_decoding program (ctest sets it)")
    out = tmp_path_factory.mktemp("decoding")
    dump = out / "dump.txt"
    r = subprocess.run([exe, "--model", mdir, "--out", str(out), "--dump", str(dump), "--prompts", "6", "--keeps", str(DECODE_KEEP),
                        "--intervals", str(DECODE_BETA), "--methods", ",".join(DECODE_ROWS)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    prompts, fed, kl, cap = {}, {}, {}, None
    for line in dump.read_text().splitlines():
        f = line.split("\t")
        if f[0] == "prompt":
            prompts[int(f[1])] = [int(x) for x in f[2].split()]
        elif f[0] == "fed":
            fed[int(f[1])] = [int(x) for x in f[2].split()]
        elif f[0] == "kl":
            cap = int(f[3])
            assert int(f[4]) == DECODE_BETA
            kl[(f[1], int(f[5]))] = float(f[6])
    assert len(prompts) == 6 and len(fed) == 6 and len(kl) == 6 * len(DECODE_ROWS) and cap == 51
    return {"prompts": prompts, "fed": fed, "kl": kl, "cap": cap,
            "model": llama2c.load_llama2c(os.path.join(mdir, "stories260K.bin"))}


def decode_logp(model, prompt, fed, press=None):
    """log-softmax (float64) after each fed token; the cache evicted by `press` when given."""
    cache = llama2c.KVCache(model.cfg, batch=1, capacity=len(prompt) + len(fed) + 1)
    out = []
    with torch.no_grad():
        ctx = press(model) if press is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            model(torch.tensor([prompt]), cache=cache)
            for t in fed:
                out.append(torch.log_softmax(model(torch.tensor([[t]]), cache=cache)[0, -1].double(), dim=-1))
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
    return out


def test_decode_press_equals_the_cpp_decoding_table(decoding_run):
    """Press(method, budget=51, interval=16) reproduces kvevict_decoding's per-excerpt KL within 1e-6
    for SnapKV and AdaKV (the decoding table's rows at cap 10%, beta 16: their mean is the row)."""
    m, cap = decoding_run["model"], decoding_run["cap"]
    worst = 0.0
    for p, prompt in decoding_run["prompts"].items():
        fed = decoding_run["fed"][p]
        full = decode_logp(m, prompt, fed)
        # the C++ reference run is greedy on the full cache: the fed tokens are its argmaxes
        assert [int(lp.argmax()) for lp in full[:-1]] == fed[1:]
        for row, method in DECODE_ROWS.items():
            press = Press(method, budget=cap, interval=DECODE_BETA)
            ev = decode_logp(m, prompt, fed, press)
            kl = sum(max(float((a.exp() * (a - b)).sum()), 0.0) for a, b in zip(full, ev)) / len(fed)
            want = decoding_run["kl"][(row, p)]
            worst = max(worst, abs(kl - want))
            assert abs(kl - want) <= 1e-6, (row, p, kl, want)
            assert press.evictions == 1 + len(fed) // DECODE_BETA
    print(f"decode-time press vs kvevict_decoding: largest per-excerpt KL difference {worst:.2e}")


# --- every failure leaves every layer's cache bit-identical ----------------------------------
def snapshot(cache):
    return [t.clone() for l in range(len(cache.keys)) for t in (cache.keys[l], cache.values[l], cache.lengths[l], cache.positions[l])]


def unchanged(before, cache):
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(cache)))


@pytest.fixture
def model():
    mdir = model_dir()
    if mdir is None:
        pytest.skip("stories260K model folder not found (../shared/models/stories260K or KVEVICT_MODEL_DIR)")
    return llama2c.load_llama2c(os.path.join(mdir, "stories260K.bin"))


def prompt_ids(n, seed=3):
    return torch.randint(1, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="snapkv", budget=16), "budget.keep_tokens = 16"),               # below the 32-query window
    (dict(method="restkv", budget=20), "keep_tokens = 20"),
    (dict(method="snapkv", budget=40, interval=4, protect_prefix=30, protect_recent=20), "protect"),  # cap below protection
    (dict(method="snapkv", budget=0), "budget = 0"),
    (dict(method="snapkv", budget=0.2, compression_ratio=0.5), "not both"),
    (dict(method="snapkv"), "budget is required"),
    (dict(method="snapkv", budget=0.2, interval=0), "interval = 0"),
    (dict(method="snapkv", budget=0.2, protect_recent=4), "need decode-time eviction"),
    (dict(method="snapkv", budget=0.2, window=-3), "window = -3"),
    (dict(method="snapkv", budget=0.2, spatial_kernal=3), "spatial.kernal is not a parameter"),
])
def test_press_refuses_at_construction(kwargs, match):
    with pytest.raises(kvevict.Error, match=match):
        Press(**kwargs)


def test_failed_second_prefill_leaves_every_layer(model):
    cache = llama2c.KVCache(model.cfg, batch=1, capacity=300)
    with torch.no_grad(), Press("snapkv", budget=0.2)(model):
        model(prompt_ids(200), cache=cache)
        before, pos = snapshot(cache), cache.next_position
        with pytest.raises(kvevict.Error, match="compresses once"):
            model(prompt_ids(10), cache=cache)
    assert unchanged(before, cache) and cache.next_position == pos


@pytest.mark.parametrize("interval", [None, 4])
def test_non_finite_layer_leaves_every_layer(model, interval):
    """NaN in layer 3's keys (check_finite): layers 0-2 were selected already; nothing is compacted,
    every layer's K, V, lengths and positions (also the slots past the lengths) are as before."""
    cache = llama2c.KVCache(model.cfg, batch=1, capacity=300)
    press = Press("snapkv", budget=40, interval=interval, check_finite=True)
    with torch.no_grad(), press(model):
        if interval is not None:  # a decode-time press after some steps: the failure hits a due eviction
            logits = model(prompt_ids(100), cache=cache)
            for _ in range(3):
                logits = model(logits[:, -1:].argmax(-1), cache=cache)
        before, pos = snapshot(cache), cache.next_position
        seen, ev = None if press.schedule is None else press.schedule.tokens_seen, press.evictions
        saved = model.wk[3].clone()
        model.wk[3][0, 0] = float("nan")
        try:
            with pytest.raises(kvevict.Error, match="layer 3 of 5"):
                model(prompt_ids(100) if interval is None else torch.tensor([[7]]), cache=cache)
        finally:
            model.wk[3].copy_(saved)
    assert unchanged(before, cache) and cache.next_position == pos and press.evictions == ev
    if interval is not None:
        assert press.schedule.tokens_seen == seen  # the schedule did not count the failed step


def test_press_without_pre_hooks_restores_lengths(model):
    """A model without cache_pre_hooks (the optional part of the protocol): a failed forward restores
    every layer's lengths (the valid cache is as before)."""
    cache = llama2c.KVCache(model.cfg, batch=1, capacity=300)
    model.cache_pre_hooks = None  # as a model that does not offer them
    try:
        with torch.no_grad(), Press("snapkv", budget=0.2)(model):
            model(prompt_ids(100), cache=cache)
            lengths = [t.clone() for t in cache.lengths]
            with pytest.raises(kvevict.Error, match="compresses once"):
                model(prompt_ids(10), cache=cache)
    finally:
        model.cache_pre_hooks = []
    assert all(torch.equal(a, b) for a, b in zip(lengths, cache.lengths))


def test_decode_press_new_cache_is_a_new_request(model):
    """The same decode-time press over two requests: the second (an empty cache) starts its schedule and
    query window afresh, so it evicts exactly as a new press would."""
    press = Press("snapkv", budget=40, interval=4)
    runs = []
    for _ in range(2):
        cache = llama2c.KVCache(model.cfg, batch=1, capacity=200)
        with torch.no_grad(), press(model):
            logits = model(prompt_ids(100), cache=cache)
            for _ in range(6):
                logits = model(logits[:, -1:].argmax(-1), cache=cache)
        runs.append((press.schedule.tokens_seen, [t.clone() for t in cache.positions], [t.clone() for t in cache.lengths]))
    assert runs[0][0] == runs[1][0] == 106
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1] + runs[0][2], runs[1][1] + runs[1][2]))


def test_model_exception_between_hooks_does_not_leak_into_the_next_forward(model):
    """Without pre-hooks: a forward that the model aborts after layer 0's hook leaves no state in the
    press; the next forward starts afresh (a decoding step passes through a one-shot press)."""
    cache = llama2c.KVCache(model.cfg, batch=1, capacity=300)
    model.cache_pre_hooks = None

    def boom(layer, num_layers, queries, c, wo):
        if layer == 0 and queries.shape[2] > 1:
            raise KeyboardInterrupt

    try:
        press = Press("snapkv", budget=0.5)
        with torch.no_grad(), press(model):
            model.cache_hooks.append(boom)
            with pytest.raises(KeyboardInterrupt):
                model(prompt_ids(100), cache=cache)
            model.cache_hooks.remove(boom)
            assert [int(t.max()) for t in cache.lengths] == [100, 0, 0, 0, 0]  # the model's own partial append
            for t in cache.lengths:
                t.zero_()
            model(prompt_ids(100), cache=cache)  # a fresh prefill: evicted in every layer
            model(torch.tensor([[5]]), cache=cache)  # decoding: passes through
    finally:
        model.cache_pre_hooks = []
    assert [int(t.max()) for t in cache.lengths] == [51] * 5 and press.evictions == 1
