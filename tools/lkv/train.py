# SPDX-License-Identifier: Apache-2.0
"""LKV calibration: train the learned head budgets (LKV-H) and token scorer (LKV-T) of a
llama2.c model by self-distillation, and write the artifact the C++ library reads.

    /usr/bin/python3 tools/lkv/train.py                      # full run (< 20 min on 2 cores)
    /usr/bin/python3 tools/lkv/train.py --smoke --out /tmp/x.lkv --parity /tmp/parity.bin

Method (spec shared/spec/lkv.md, design notes docs/lkv.md):
- Teacher: the frozen model with the full cache. Student: the same frozen model whose attention
  gets, for the continuation queries only, the bias log(m + eps) on every CONTEXT key (the
  5-D per-query bias form of llama2c.Llama): the context itself is prefilled with the full
  cache, exactly like eviction after prefill ("mode A"); continuation keys are never masked.
- m = soft top-k (softtopk.py) of the learned utilities u = MLP([k ; v]) of each (layer, KV
  head), with sum m = beta_n; beta = water-filled r * R * N * t, r = softmax(z / T), t = context
  length, R sampled per step in [--r-min, --r-max]. Gradients reach u and z through the
  implicit derivative of the soft top-k threshold.
- Loss: KL(teacher || student) of the next-token distributions over the continuation positions.
  tau is annealed geometrically from --tau0 to --tau1 so the soft mask approaches the hard
  top-k used at inference.
- Data: excerpts of sherlock.txt (contexts) followed either by the true text or by text the
  model generates from that context (sampled, temperature 0.8). Excerpts that overlap the
  fidelity report's prompts (examples/fidelity: n = 1..8 evenly spread excerpts) are excluded
  from training; the n = 6 report prompts are the held-out evaluation set.
- Evaluation (held-out, hard top-k exactly as the C++ library): KL and top-1 agreement for
  learned budgets vs uniform budgets with the learned scorer, at keep 10% and 20%.

--parity FILE additionally writes the K/V of one held-out prompt and the selections this code
makes (budgets by the Python copy of the C++ water-filling, top-k of fp32 utilities) so the C++
test tests/lkv can check that the library selects the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import llama2c  # noqa: E402
import lkv  # noqa: E402
from llama2c import _linear, _rmsnorm, _rope_cos_sin, apply_rope  # noqa: E402
from llama2c import default_model_dir, load_llama2c  # noqa: E402
from softtopk import soft_topk  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TEXT = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "text", "sherlock.txt"))
DEFAULT_OUT = os.path.join(REPO, "artifacts", "lkv", "stories260K.lkv")


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Data
def fidelity_windows(text_len: int, tokens: int = 448, ns=range(1, 9)):
    """Character windows [a, b) of the fidelity report's excerpts (examples/fidelity
    make_prompts: start = (len - chars) * (2i + 1) / (2n), chars = 3 * tokens + 64), widened
    by one window on each side (the report moves the start to the next paragraph)."""
    chars = tokens * 3 + 64
    out = []
    for n in ns:
        for i in range(n):
            s = (text_len - chars) * (2 * i + 1) // (2 * n)
            out.append((max(0, s - chars), s + 2 * chars))
    return out


def report_prompts(tok: Tokenizer, text: str, n: int, tokens: int):
    """The fidelity report's excerpts as they were when LKV was trained (make_prompts' rule, n evenly
    spread excerpts; since 2026-12-07 the report takes 32 excerpts with these contexts left out,
    examples/engine/report_util.hpp make_excerpts)."""
    chars = tokens * 3 + 64
    out = []
    for i in range(n):
        start = (len(text) - chars) * (2 * i + 1) // (2 * n)
        para = text.find("\n\n", start)
        if para >= 0 and para + chars < len(text):
            start = para
        while start < len(text) and text[start] in "\n ":
            start += 1
        piece = text[start:start + chars].replace("\n", " ")
        ids = tok.encode(piece)
        if len(ids) >= tokens:
            out.append(ids[:tokens])
    return out


def train_excerpt_windows(tok: Tokenizer, text: str, n: int, tokens: int, rng: random.Random):
    """n excerpts of `tokens` tokens (BOS first) from paragraph starts outside the report windows, as
    (start, end, ids): the character window [start, end) each was read from (tools/lkv/train_windows.py
    writes them for the report to leave out)."""
    bad = fidelity_windows(len(text))
    chars = int(tokens * 2.4) + 64
    starts = [m.end() for m in re.finditer(r"\n\n+", text)]
    ok = [s for s in starts if s + chars < len(text) and not any(a < s + chars and s < b for a, b in bad)]
    rng.shuffle(ok)
    out = []
    for s in ok:
        piece = text[s:s + chars].replace("\n", " ")
        ids = tok.encode(piece)
        if len(ids) >= tokens:
            out.append((s, s + chars, ids[:tokens]))
        if len(out) == n:
            break
    return out


def train_excerpts(tok: Tokenizer, text: str, n: int, tokens: int, rng: random.Random):
    """n excerpts of `tokens` tokens (BOS first) from paragraph starts outside the report windows."""
    return [ids for _, _, ids in train_excerpt_windows(tok, text, n, tokens, rng)]


def cont_forward(model, ctx_kv, cont: torch.Tensor, start: int, ctx_bias=None):
    """Logits (B, S, vocab) of continuation tokens `cont` (B, S) at positions start.. given the
    context's cached post-RoPE keys/values ctx_kv = [(k, v)] per layer, each (B, H, C, hd),
    with ctx_bias (L, B, H, C) (or None) added to the context keys' logits of every
    continuation query. The same computation as llama2c.Llama.forward for those positions
    (tested against it in test_lkv.py); only the S continuation rows are computed."""
    cfg = model.cfg
    B, S = cont.shape
    L, Hq, Hk, hd, G = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group_size
    dtype = model.tok_emb.dtype
    cos, sin = _rope_cos_sin(torch.arange(start, start + S), hd, cfg.rope_theta, dtype)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scale = 1.0 / math.sqrt(hd)
    x = model.tok_emb[cont]
    for l in range(L):
        h = _rmsnorm(x, model.rms_att[l], cfg.norm_eps)
        q = apply_rope(_linear(h, model.wq[l]).view(B, S, Hq, hd).transpose(1, 2), cos, sin)
        k = apply_rope(_linear(h, model.wk[l]).view(B, S, Hk, hd).transpose(1, 2), cos, sin)
        v = _linear(h, model.wv[l]).view(B, S, Hk, hd).transpose(1, 2)
        kc, vc = ctx_kv[l]
        C = kc.shape[2]
        qg = q.view(B, Hk, G, S, hd)
        sc = torch.matmul(qg, kc[:, :, None].transpose(-1, -2)) * scale  # (B, Hk, G, S, C)
        if ctx_bias is not None:
            sc = sc + ctx_bias[l][:, :, None, None, :].to(sc.dtype)
        ss = (torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
        att = torch.softmax(torch.cat([sc, ss], -1), -1)
        o = torch.matmul(att[..., :C], vc[:, :, None]) + torch.matmul(att[..., C:], v[:, :, None])
        o = o.reshape(B, Hq, S, hd).transpose(1, 2).reshape(B, S, Hq * hd)
        x = x + _linear(o, model.wo[l])
        h = _rmsnorm(x, model.rms_ffn[l], cfg.norm_eps)
        x = x + _linear(F.silu(_linear(h, model.w1[l])) * _linear(h, model.w3[l]), model.w2[l])
    x = _rmsnorm(x, model.rms_final, cfg.norm_eps)
    return _linear(x, model.tok_emb if model.wcls is None else model.wcls)


def decode_steps(c: int, n_queries: int, interval: int):
    """Mode-B eviction points t_j for a context of c tokens and n_queries continuation queries at
    positions c .. c + n_queries - 1: the prefill eviction at t = c, then one after every `interval`
    generated tokens (t = c + j * interval). A step at t affects the queries at positions >= t (the
    engine evicts after appending token t - 1 and computing its logits)."""
    return [c + j * interval for j in range(0, (n_queries - 1) // interval + 1) if c + j * interval <= c + n_queries - 1]


def decode_cont_forward(model, params, ctx_kv, cont: torch.Tensor, start: int, R: float, temperature: float, tau: float,
                        eps: float, interval: int, protect_recent: int = 0):
    """Student logits (B, S, vocab) under a soft simulation of LKV decoding mode B (spec lkv.md,
    "Decoding"; engine lkv_session): the cache grows with the continuation and, at every step t_j of
    decode_steps(start, S, interval), every (layer, KV head) keeps a soft top-beta_n(t_j) of ALL tokens
    before t_j (context and continuation) by the learned utility u = MLP([k ; v]) of the token's own
    student-side k and v, beta = the soft LKV-H budgets for t_j (water-filled r * R * N * t_j). A
    query at position p sees each key k < p through the product of the masks of the steps t_j <= p
    that k was present at (bias sum_j log(m_j + eps)): a token evicted at one step stays (softly)
    evicted. The `protect_recent` most recent tokens before each step are kept (mask 1) and the budget
    of the rest is beta - protect_recent. interval = 1 is mode B after every token."""
    cfg = model.cfg
    B, S = cont.shape
    L, Hq, Hk, hd, G = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group_size
    dtype = model.tok_emb.dtype
    cos, sin = _rope_cos_sin(torch.arange(start, start + S), hd, cfg.rope_theta, dtype)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scale = 1.0 / math.sqrt(hd)
    C = start
    T = C + S
    steps = decode_steps(C, S, interval)
    budgets = {t: soft_budgets_lh(params, temperature, R, t) for t in steps}
    # query s (position C + s) is affected by the steps t <= C + s: index of the last one
    last = torch.tensor([max(j for j, t in enumerate(steps) if t <= C + s) for s in range(S)])
    x = model.tok_emb[cont]
    for l in range(L):
        h = _rmsnorm(x, model.rms_att[l], cfg.norm_eps)
        q = apply_rope(_linear(h, model.wq[l]).view(B, S, Hq, hd).transpose(1, 2), cos, sin)
        k = apply_rope(_linear(h, model.wk[l]).view(B, S, Hk, hd).transpose(1, 2), cos, sin)
        v = _linear(h, model.wv[l]).view(B, S, Hk, hd).transpose(1, 2)
        kc, vc = ctx_kv[l]
        k_all, v_all = torch.cat([kc, k], 2), torch.cat([vc, v], 2)  # (B, Hk, T, hd)
        u = params.utility(l, k_all, v_all)  # (B, Hk, T)
        logm = []
        for t in steps:
            keep = u.new_zeros(B, Hk, T)
            n_cand = t - protect_recent if t - protect_recent > 0 else 0
            if n_cand > 0:
                beta = (budgets[t][l].to(u.dtype) - protect_recent).clamp(min=1e-3, max=float(n_cand))
                m = soft_topk(u[..., :n_cand], beta.reshape(1, Hk).expand(B, Hk), tau)
                keep = keep + F.pad(torch.log(m + eps), (0, T - n_cand))
            logm.append(keep)
        cum = torch.cumsum(torch.stack(logm), 0)  # (steps, B, Hk, T)
        bias = cum[last].permute(1, 2, 0, 3)  # (B, Hk, S, T): query s gets the sum over its steps
        qg = q.view(B, Hk, G, S, hd)
        sc = torch.matmul(qg, kc[:, :, None].transpose(-1, -2)) * scale + bias[:, :, None, :, :C].to(dtype)
        ss = (torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale + bias[:, :, None, :, C:].to(dtype)).masked_fill(~causal, float("-inf"))
        att = torch.softmax(torch.cat([sc, ss], -1), -1)
        o = torch.matmul(att[..., :C], vc[:, :, None]) + torch.matmul(att[..., C:], v[:, :, None])
        o = o.reshape(B, Hq, S, hd).transpose(1, 2).reshape(B, S, Hq * hd)
        x = x + _linear(o, model.wo[l])
        h = _rmsnorm(x, model.rms_ffn[l], cfg.norm_eps)
        x = x + _linear(F.silu(_linear(h, model.w1[l])) * _linear(h, model.w3[l]), model.w2[l])
    x = _rmsnorm(x, model.rms_final, cfg.norm_eps)
    return _linear(x, model.tok_emb if model.wcls is None else model.wcls)


def soft_budgets_lh(params, temperature: float, R: float, t: int) -> torch.Tensor:
    """Soft LKV-H budgets (L, H) for t tokens seen."""
    L, H = params.z.shape
    return lkv.soft_budgets(params.z, temperature, R, t).reshape(L, H)


@torch.no_grad()
def context_kv(model, ctx: torch.Tensor, chunk: int = 8):
    """Post-RoPE K/V of the context rows (B, C), per layer (B, H, C, hd), in chunks of rows."""
    parts = []
    for i in range(0, ctx.shape[0], chunk):
        _, kv = model(ctx[i:i + chunk], return_kv=True)
        parts.append(kv)
    return [(torch.cat([p[l][0] for p in parts]), torch.cat([p[l][1] for p in parts]))
            for l in range(len(parts[0]))]


@torch.no_grad()
def continue_tokens(model, ctx: torch.Tensor, kv, n_new: int, temperature: float, gen: torch.Generator):
    """n_new tokens after each context row: sampled at `temperature`, or greedy when it is 0.
    Needs the logits of the context's last position for the first token: recomputed here."""
    C = ctx.shape[1]
    # The first new token comes from the last context position: run that position as a
    # continuation of the context minus its last token.
    kv_m1 = [(k[:, :, :C - 1], v[:, :, :C - 1]) for k, v in kv]
    seq = ctx[:, -1:]
    out = []
    for _ in range(n_new):
        logits = cont_forward(model, kv_m1, seq, C - 1)[:, -1].double()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        seq = torch.cat([seq, nxt], 1)
    return torch.cat(out, 1)


# ---------------------------------------------------------------------------------------------
# Student
def kl_rows(lt: torch.Tensor, s_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows and positions of KL(teacher || student); lt = teacher log-probs (fp64)."""
    ls = F.log_softmax(s_logits.double(), -1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


def utilities(params: lkv.LkvParams, kv) -> torch.Tensor:
    """u (L, B, H, C) of the context tokens."""
    return torch.stack([params.utility(l, k, v) for l, (k, v) in enumerate(kv)])


# ---------------------------------------------------------------------------------------------
# Hard (inference) selections
def hard_budgets(kind: str, params: lkv.LkvParams, R: float, t: int, temperature: float):
    """Per-(layer, head) integer budgets (L, H) with nothing protected (num_recent = 0)."""
    L, H = params.z.shape
    if kind == "uniform":
        b = max(1, int(math.floor(R * t)))  # plan_head: floor(f * L) raised to 1
        return [[b] * H for _ in range(L)]
    z32 = [float(x) for x in params.z.detach().float().reshape(-1)]
    t32 = float(torch.tensor(temperature, dtype=torch.float32))
    flat = lkv.water_fill(z32, t32, lkv.total_budget(R, L * H, t), t, 0)
    return [flat[l * H:(l + 1) * H] for l in range(L)]


def hard_keep_mask(u: torch.Tensor, budgets) -> torch.Tensor:
    """Boolean (L, B, H, C): top-budget tokens by fp32 u, ties to the lower index."""
    L, B, H, C = u.shape
    u32 = u.detach().float()
    keep = torch.zeros(L, B, H, C, dtype=torch.bool)
    for l in range(L):
        for b in range(B):
            for h in range(H):
                k = min(int(budgets[l][h]), C)
                keep[l, b, h, lkv.topk_ascending(u32[l, b, h].tolist(), k)] = True
    return keep


@torch.no_grad()
def evaluate(model, params, ev, temperature: float, fractions=(0.1, 0.2)):
    """Held-out hard-selection fidelity: {(kind, R): (kl, top1)} (learned scorer)."""
    kv, cont, lt, C = ev["kv"], ev["cont"], ev["lt"], ev["C"]
    u = utilities(params, kv)
    res = {}
    for R in fractions:
        for kind in ("learned", "uniform"):
            keep = hard_keep_mask(u, hard_budgets(kind, params, R, C, temperature))
            s_logits = cont_forward(model, kv, cont, C, torch.where(keep, 0.0, -1e9))
            top1 = float((lt.argmax(-1) == s_logits.argmax(-1)).double().mean())
            res[(kind, R)] = (float(kl_rows(lt, s_logits)), top1)
    return res


# ---------------------------------------------------------------------------------------------
def write_parity(path: str, model, params, prompt, temperature: float, fractions=(0.1, 0.2)):
    """Binary parity file for tests/lkv (little-endian):
    magic "LKVPAR01", i32 L, H, T, d, n_fractions; f32 K (L, H, T, d); f32 V (L, H, T, d);
    f32 u (L, H, T) (utilities in fp64 math, stored as fp32); then per fraction: f64 R,
    i32 budgets (L*H), i32 indptr (L*H + 1), i32 indices (indptr[-1]) (layer-major, then head,
    each head's kept slots ascending)."""
    tokens = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        _, kv = model(tokens, return_kv=True)
    L, H = params.z.shape
    T = tokens.shape[1]
    d = kv[0][0].shape[-1]
    p64 = lkv.LkvParams(*params.shape, activation=params.activation).double()
    p64.load_state_dict({k: v.double() for k, v in params.state_dict().items()})
    with torch.no_grad():
        u = torch.stack([p64.utility(l, kv[l][0].double(), kv[l][1].double())[0] for l in range(L)]).float()
    out = bytearray(b"LKVPAR01")
    out += struct.pack("<5i", L, H, T, d, len(fractions))
    K = torch.stack([kv[l][0][0] for l in range(L)]).float().contiguous()
    V = torch.stack([kv[l][1][0] for l in range(L)]).float().contiguous()
    out += K.numpy().astype("<f4").tobytes()
    out += V.numpy().astype("<f4").tobytes()
    out += u.numpy().astype("<f4").tobytes()
    summary = {}
    for R in fractions:
        bud = hard_budgets("learned", params, R, T, temperature)
        flat = [b for row in bud for b in row]
        indptr, indices = [0], []
        for l in range(L):
            for h in range(H):
                indices += lkv.topk_ascending(u[l, h].tolist(), min(bud[l][h], T))
                indptr.append(len(indices))
        out += struct.pack("<d", R)
        out += struct.pack(f"<{L * H}i", *flat)
        out += struct.pack(f"<{L * H + 1}i", *indptr)
        out += struct.pack(f"<{len(indices)}i", *indices)
        summary[R] = flat
    with open(path, "wb") as f:
        f.write(bytes(out))
    return summary


# ---------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="~1 minute run (CI)")
    ap.add_argument("--model", default=os.path.join(default_model_dir(), "stories260K.bin"))
    ap.add_argument("--tokenizer", default=os.path.join(default_model_dir(), "tok512.bin"))
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--out", default=DEFAULT_OUT, help="artifact path")
    ap.add_argument("--parity", default="", help="also write a C++/PyTorch parity file here")
    ap.add_argument("--report", default="", help="write the eval numbers (JSON) here")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--ctx", default="", help="context lengths t (BOS included), comma-separated; each step "
                    "samples one (default 160,320,448; smoke 48,64)")
    ap.add_argument("--cont", type=int, default=0, help="continuation tokens")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--rows", type=int, default=0, help="training contexts")
    ap.add_argument("--hidden", type=int, default=32, help="MLP hidden width")
    ap.add_argument("--activation", default="silu", choices=sorted(lkv.ACT_CODES))
    ap.add_argument("--r-min", type=float, default=0.08)
    ap.add_argument("--r-max", type=float, default=0.25)
    ap.add_argument("--temperature", type=float, default=1.0, help="r = softmax(z / temperature)")
    ap.add_argument("--tau0", type=float, default=1.0)
    ap.add_argument("--tau1", type=float, default=0.03)
    ap.add_argument("--eps", type=float, default=1e-6, help="bias = log(m + eps)")
    ap.add_argument("--lr-z", type=float, default=0.05)
    ap.add_argument("--lr-mlp", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 is fastest for these tiny shapes on a shared 2-core box)")
    ap.add_argument("--time-limit", type=float, default=0, help="stop training after this many seconds")
    ap.add_argument("--decode-interval", type=int, default=0,
                    help="> 0: train for decoding mode B: the student evicts the growing cache every this many "
                    "continuation tokens (decode_cont_forward); 0: mode A (evict after prefill only), the default")
    ap.add_argument("--protect-recent", type=int, default=0,
                    help="with --decode-interval: the most recent tokens kept at every step (as lkv_session's protect_recent)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    # The shapes here are tiny (rows of <= 16 * 32 tokens): the reference BLAS beats oneDNN's
    # per-shape kernel creation.
    llama2c.USE_ONEDNN_LINEAR = False
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    t_start = time.time()

    smoke = a.smoke
    steps = a.steps or (25 if smoke else 800)
    lengths = sorted(int(x) for x in (a.ctx or ("48,64" if smoke else "160,320,448")).split(","))
    C = lengths[-1]
    S = a.cont or (16 if smoke else 32)
    B = a.batch or (4 if smoke else 16)
    n_rows = a.rows or (8 if smoke else 80)
    n_eval = 2 if smoke else 6
    time_limit = a.time_limit or (45 if smoke else 1000)

    if not os.path.exists(a.model) or not os.path.exists(a.text):
        log(f"skipping: model {a.model} or text {a.text} missing (nothing written)")
        return 0
    model = load_llama2c(a.model)
    cfg = model.cfg
    tok = Tokenizer(a.tokenizer, cfg.vocab_size)
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    log(f"lkv-train: {'smoke' if smoke else 'full'} run, steps={steps} ctx={lengths} cont={S} batch={B} "
        f"rows={n_rows} hidden={a.hidden} R in [{a.r_min}, {a.r_max}] tau {a.tau0}->{a.tau1} seed={a.seed}"
        + (f" decoding mode B: interval {a.decode_interval}, protect_recent {a.protect_recent}" if a.decode_interval > 0 else ""))

    # data: contexts from sherlock (outside the report's prompts), continuations = the true
    # text for half of the rows and the model's own sampled text for the other half
    ex = train_excerpts(tok, text, n_rows, C + S, rng)
    if len(ex) < n_rows:
        raise SystemExit(f"only {len(ex)} training excerpts of {C + S} tokens")
    data = torch.tensor(ex, dtype=torch.long)
    ctx = data[:, :C]
    kv_all = context_kv(model, ctx)
    cont = data[:, C:].clone()
    half = n_rows // 2
    kv_half = [(k[half:], v[half:]) for k, v in kv_all]
    cont[half:] = continue_tokens(model, ctx[half:], kv_half, S, 0.8, gen)
    # Teacher: log-probs at the continuation queries (positions C .. C+S-2, inputs cont[:, :-1])
    # with the full context cache. The prediction at position C-1 comes from the prefill, which
    # eviction never changes, so it is not part of the loss.
    # Shorter contexts are prefixes of the same rows (a causal model: their K/V are slices),
    # continued by the true text.
    per_len = {}
    for c in lengths:
        cc = cont if c == C else data[:, c:c + S]
        kvc = [(k[:, :, :c], v[:, :, :c]) for k, v in kv_all]
        with torch.no_grad():
            per_len[c] = (kvc, cc[:, :-1], F.log_softmax(cont_forward(model, kvc, cc[:, :-1], c).double(), -1))

    held = report_prompts(tok, text, 6, max(448, C))[:n_eval]
    evs = []
    for c in lengths:
        ectx = torch.tensor([p[:c] for p in held], dtype=torch.long)
        ekv = context_kv(model, ectx)
        econt = continue_tokens(model, ectx, ekv, S, 0.0, gen)  # greedy, as the report decodes
        with torch.no_grad():
            elt = F.log_softmax(cont_forward(model, ekv, econt[:, :-1], c).double(), -1)
        evs.append({"kv": ekv, "cont": econt[:, :-1], "lt": elt, "C": c})
    log(f"data: {n_rows} training contexts ({n_rows - half} with model-sampled continuations), "
        f"{len(held)} held-out report prompts (first {lengths} tokens + greedy continuation); "
        f"{time.time() - t_start:.1f}s")

    # training --------------------------------------------------------------------------------
    L, H, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    params = lkv.LkvParams(L, H, d, a.hidden, a.activation, seed=a.seed)
    opt = torch.optim.Adam([
        {"params": [params.z], "lr": a.lr_z},
        {"params": [params.W1, params.b1, params.w2, params.b2], "lr": a.lr_mlp},
    ])
    t_train = time.time()
    step = 0
    ema = None
    for step in range(steps):
        # anneal by steps or by the time budget, whichever runs out first
        frac = min(1.0, max(step / max(1, steps - 1), (time.time() - t_train) / max(1.0, time_limit - (t_train - t_start))))
        tau = a.tau0 * (a.tau1 / a.tau0) ** frac
        R = rng.uniform(a.r_min, a.r_max)
        c = lengths[rng.randrange(len(lengths))]
        kvc, cin, ltc = per_len[c]
        idx = torch.randint(0, n_rows, (B,), generator=gen)
        kv = [(k[idx], v[idx]) for k, v in kvc]
        if a.decode_interval > 0:
            s_logits = decode_cont_forward(model, params, kv, cin[idx], c, R, a.temperature, tau, a.eps, a.decode_interval,
                                           a.protect_recent)
        else:
            u = utilities(params, kv)  # (L, B, H, c)
            beta = lkv.soft_budgets(params.z, a.temperature, R, c).reshape(L, 1, H).expand(L, B, H)
            m = soft_topk(u, beta.to(u.dtype), tau)
            s_logits = cont_forward(model, kv, cin[idx], c, torch.log(m + a.eps))
        loss = kl_rows(ltc[idx], s_logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema = float(loss) if ema is None else 0.95 * ema + 0.05 * float(loss)
        if step % (5 if smoke else 50) == 0 or step == steps - 1:
            r = torch.softmax(params.z.detach().reshape(-1) / a.temperature, 0)
            log(f"step {step:4d} t {c} tau {tau:.3f} R {R:.3f} loss {float(loss):.4f} (ema {ema:.4f}) "
                f"r*N min/max {float(r.min()) * L * H:.2f}/{float(r.max()) * L * H:.2f} "
                f"[{time.time() - t_train:.0f}s]")
        if frac >= 1.0:
            log(f"schedule done (steps or time limit {time_limit:.0f}s) at step {step}")
            break

    # artifact --------------------------------------------------------------------------------
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    header, size, hsh = lkv.checkpoint_identity(a.model)
    lkv.write_artifact(a.out, params, header, size, hsh, a.r_min, a.r_max, a.temperature)
    back = lkv.read_artifact(a.out)
    if not torch.equal(back["params"].z, params.z.detach().float()):
        raise SystemExit("artifact round trip failed")
    log(f"wrote {a.out} ({os.path.getsize(a.out)} bytes)")
    rr = torch.softmax(params.z.detach().reshape(-1) / a.temperature, 0).reshape(L, H) * (L * H)
    log("learned ratios r * N (1 = uniform), rows = layers:\n" +
        "\n".join("  " + " ".join(f"{float(x):5.2f}" for x in row) for row in rr))

    # evaluation ------------------------------------------------------------------------------
    report = {"steps_done": step + 1, "seconds": time.time() - t_start, "ctx": lengths, "cont": S,
              "ratios_times_N": [[float(x) for x in row] for row in rr], "eval": {}}
    for ev in evs:
        res = evaluate(model, params, ev, a.temperature)
        for (kind, R), (kl, top1) in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            log(f"held-out t={ev['C']} R={R:.2f} budgets={kind:8s} (learned scorer): KL {kl:.4f}  top-1 {top1:.3f}")
            report["eval"][f"t{ev['C']}:{kind}@{R}"] = {"kl": kl, "top1": top1}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)
    if a.parity:
        summ = write_parity(a.parity, model, params, held[0][:C], a.temperature)
        log(f"wrote parity file {a.parity} (t = {C}; budgets at 10%: {summ[0.1]})")
    log(f"done in {time.time() - t_start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
