"""kvevict in Hugging Face transformers (kvevict.models.hf, kvevict.hf): the converted stories260K
reproduces the model README's golden values and kvevict.models.llama2c's logits; the transformers
press keeps exactly the positions kvevict's own press keeps on the llama2c model for every
uniform-budget method; bad input is refused before the model is touched, and a failing layer leaves
no layer compressed; as_kvpress runs through kvpress's own hooks.

Needs transformers (and, for as_kvpress, kvpress) with a torch they support: skipped with a message
under Debian's python3-torch 1.13. docs/kvpress.md says how the venv is made."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (docs/kvpress.md: a venv with PyPI's "
                                                          "torch, transformers and kvpress runs these tests)")
from transformers import DynamicCache  # noqa: E402

import kvevict  # noqa: E402
from conftest import REPO  # noqa: E402
from kvevict.hf import HEADWISE_METHODS, Press, as_kvpress  # noqa: E402
from kvevict.models import hf as hfm  # noqa: E402
from kvevict.models import llama2c  # noqa: E402
from kvevict.press import Press as CorePress  # noqa: E402

MDIR = os.environ.get("KVEVICT_MODEL_DIR") or os.path.join(REPO, "..", "shared", "models", "stories260K")
UNIFORM = [m for m in kvevict.methods() if m not in HEADWISE_METHODS and m != "lkv_uniform_budgets"] + ["lkv_uniform_budgets"]
ARTIFACT = os.path.join(REPO, "artifacts", "lkv", "stories260K.lkv")


@pytest.fixture(scope="module")
def models():
    if not os.path.isfile(os.path.join(MDIR, "stories260K.bin")):
        pytest.skip("stories260K model folder not found (../shared/models/stories260K or KVEVICT_MODEL_DIR)")
    m = llama2c.load_llama2c(os.path.join(MDIR, "stories260K.bin"))
    return m, hfm.to_transformers(m)


def ids(n, seed=0):
    return torch.randint(1, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def test_converted_model_reproduces_the_golden_values(models):
    _, hf = models
    with torch.no_grad():
        logits = hf(torch.tensor([[1]])).logits[0, -1]
    top = logits.topk(5)
    assert top.indices.tolist() == [403, 385, 410, 317, 407]
    assert (top.values - torch.tensor([17.0235, 15.4062, 13.1083, 12.7692, 12.4181])).abs().max() < 1e-3
    seq = [1]
    with torch.no_grad():
        for _ in range(32):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert seq[1:] == [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
                       410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385]


def test_converted_model_equals_llama2c(models):
    m, hf = models
    x = ids(300)
    with torch.no_grad():
        a, b = m(x), hf(x).logits
    assert (a - b).abs().max() < 1e-4 * a.abs().max()


@pytest.mark.parametrize("method", UNIFORM)
def test_transformers_press_keeps_what_kvevicts_press_keeps(models, method):
    m, hf = models
    kw = {"artifact": ARTIFACT} if method.startswith("lkv") else {}
    x, nxt = ids(300), torch.tensor([[7]])
    p = Press(method, budget=0.2, **kw)
    cache = DynamicCache()
    with torch.no_grad():
        with p(hf):
            hf(x, past_key_values=cache)
        out = hf(nxt, past_key_values=cache, position_ids=torch.tensor([[300]])).logits[0, -1]
    core = CorePress(method, budget=0.2, **kw)
    c2 = llama2c.KVCache(m.cfg, 1, 320)
    with torch.no_grad():
        with core(m):
            m(x, cache=c2)
        out2 = m(nxt, cache=c2)[0, -1]
    for l in range(m.cfg.n_layers):
        kept = p.selections[l].positions
        assert cache.layers[l].keys.shape[2] == int(p.selections[l].counts()[0, 0]) + 1  # the kept tokens and nxt
        if method == "key_norm" and not torch.equal(kept, core.selections[l].positions):
            continue  # equal key norms of a repeated token: fp32 RoPE rounding breaks the tie differently (test_press.py)
        assert torch.equal(kept, core.selections[l].positions), (method, l)
    if method != "key_norm":
        assert (out - out2).abs().max() < 1e-4 * out2.abs().max()


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="adakv", budget=0.2), "DynamicCache cannot hold"),
    (dict(method="snapkv", budget=16), "budget.keep_tokens = 16"),
    (dict(method="snapkv"), "budget is required"),
    (dict(method="snapkv", compression_ratio=1.0), "compression_ratio"),
])
def test_refused_at_construction(kwargs, match):
    with pytest.raises(kvevict.Error, match=match):
        Press(**kwargs)


def test_failing_layer_leaves_no_layer_compressed(models):
    _, hf = models
    p = Press("snapkv", budget=40, check_finite=True)
    w = hf.model.layers[3].self_attn.k_proj.weight
    saved = w.clone()
    cache = DynamicCache()
    try:
        with torch.no_grad():
            w[0, 0] = float("nan")
            with p(hf), pytest.raises(kvevict.Error, match="layer 3 of 5"):
                hf(ids(100), past_key_values=cache)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert [cache.layers[l].keys.shape[2] for l in range(3)] == [100] * 3  # the prompt, uncompressed


def test_as_kvpress_runs_through_kvpress(models):
    kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed")
    _, hf = models
    kp = as_kvpress(Press("snapkv", compression_ratio=0.8))
    assert isinstance(kp, kvpress.BasePress)
    cache = DynamicCache()
    with torch.no_grad(), kp(hf):
        hf(ids(300), past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == int(300 * (1 - 0.8))  # kvpress's n_kept


def test_tokenizer_encodes_and_decodes_as_llama2c():
    if not os.path.isfile(os.path.join(MDIR, "tok512.bin")):
        pytest.skip("stories260K model folder not found")
    from kvevict.models.tokenizer import Tokenizer
    tok, raw = hfm.to_transformers_tokenizer(os.path.join(MDIR, "tok512.bin")), Tokenizer(os.path.join(MDIR, "tok512.bin"))
    for text in ["Once upon a time, there was a little girl named Lily.", "Ünïcode ∑ and\ttabs, 42 apples!", "a", ""]:
        assert tok.encode(text) == raw.encode(text)  # BOS + the llama2.c merges, byte pieces for the rest
        assert tok.encode(tok.bos_token + text, add_special_tokens=False) == raw.encode(text)  # kvpress's no-template path
        ids = raw.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == raw.decode(ids[1:], prev=1)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, len(tok)) == (1, 2, 0, 512)


def test_kvpress_pipeline_runs_a_kvevict_method(models):
    """kvpress's own "kv-press-text-generation" pipeline with a kvevict method through as_kvpress: the
    context is compressed by kvevict (the cache it leaves holds floor(L / 2) tokens per head), and the
    answer is exactly the greedy decode that kvevict.hf.Press gives by hand on the same tokens."""
    pytest.importorskip("kvpress", reason="kvpress is not installed")
    from transformers import pipeline
    _, hf = models
    tok = hfm.to_transformers_tokenizer(os.path.join(MDIR, "tok512.bin"))
    context = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog. "
               "One day, she saw a big red ball under a tree. ") * 4
    question = "What did Lily see?"
    pipe = pipeline("kv-press-text-generation", model=hf, tokenizer=tok, device="cpu")
    cache = DynamicCache()
    answer = pipe(context, question=question, press=as_kvpress(Press("snapkv", compression_ratio=0.5)), cache=cache,
                  max_new_tokens=12)["answer"]
    ctx = tok.encode(tok.bos_token + context, return_tensors="pt", add_special_tokens=False)
    n = ctx.shape[1]
    assert [cache.layers[l].keys.shape[2] for l in range(len(cache))] == [n // 2] * len(cache)
    # the same by hand: kvevict's press on the prefill, then the pipeline's greedy loop
    by_hand = DynamicCache()
    with torch.no_grad():
        with Press("snapkv", compression_ratio=0.5)(hf):
            hf.model(input_ids=ctx, past_key_values=by_hand)
        q = tok.encode(question + "\n", return_tensors="pt", add_special_tokens=False)
        pos = torch.arange(n, n + q.shape[1]).unsqueeze(0)
        gen = [hf(input_ids=q, past_key_values=by_hand, position_ids=pos).logits[0, -1].argmax()]
        for i in range(11):
            gen.append(hf(input_ids=gen[-1].view(1, 1), past_key_values=by_hand, position_ids=pos[:, -1:] + 1 + i).logits[0, -1].argmax())
            if gen[-1].item() == tok.eos_token_id:
                break
    assert answer == tok.decode(torch.stack(gen), skip_special_tokens=True) and answer.strip()


@pytest.mark.parametrize("method", ["snapkv", "streaming_llm", "pyramidkv", "restkv", "tova", "criticalkv"])
def test_decode_time_press_equals_kvevicts_press(models, method):
    """Press(..., interval=4): the cap and schedule of kvevict.press on a DynamicCache. After a 120-token
    prompt and 30 decode steps (8 evictions), every layer keeps the positions kvevict's own press keeps
    on the llama2c model, and every step's logits agree."""
    m, hf = models
    p = Press(method, budget=40, interval=4, protect_recent=4)
    c = CorePress(method, budget=40, interval=4, protect_recent=4)
    cache, kc = DynamicCache(), llama2c.KVCache(m.cfg, 1, 200)
    x = ids(120)
    with torch.no_grad(), p(hf), c(m):
        hf(x, past_key_values=cache)
        b = m(x, cache=kc)[0, -1]
        for i in range(30):
            t = torch.tensor([[int(b.argmax())]])
            a = hf(t, past_key_values=cache, position_ids=torch.tensor([[120 + i]])).logits[0, -1]
            b = m(t, cache=kc)[0, -1]
            assert (a - b).abs().max() < 1e-4 * b.abs().max(), (method, i)
    assert p.evictions == c.evictions == 8 and p.schedule.tokens_seen == 150
    for l in range(m.cfg.n_layers):
        n = int(kc.lengths[l][0, 0])
        assert cache.layers[l].keys.shape[2] == n and torch.equal(p._pos[l][0], kc.positions[l][0, :, :n]), (method, l)


def test_decode_time_press_refuses_all_query_window():
    with pytest.raises(kvevict.Error, match="window=N"):
        Press("h2o", budget=40, interval=4)
