# SPDX-License-Identifier: Apache-2.0
"""Load a llama2.c legacy checkpoint into a PyTorch Llama module (the LKV teacher / student).

The forward pass follows ../shared/models/stories260K/README.md exactly:

- pre-norm blocks, RMSNorm with eps 1e-5 (x * rsqrt(mean(x^2) + eps) * w);
- RoPE with theta 10000 on interleaved pairs (x[2i], x[2i+1]) inside each head,
  frequency 10000^(-2i/head_dim), position p rotates the pair by the angle p * freq;
- grouped-query attention: query head h uses KV head h // (n_heads // n_kv_heads),
  scores q.k / sqrt(head_dim), causal mask;
- SwiGLU FFN w2(silu(w1 x) * w3 x);
- classifier tied to the token embedding when the header's vocab_size is positive
  (a separate wcls array follows the RoPE tables when it is negative).

LKV hook: ``attn_bias`` adds, per layer, a value per (batch, KV head, key position) to the
attention logits of every query head of that KV head's GQA group, on top of the causal mask.
With ``log(m_i + eps)`` this is the LKV student's soft retention mask. ``return_kv`` hands back
the per-layer post-RoPE keys and the values so a token scorer can read [k ; v].

KV cache and press hook: ``forward(tokens, cache=KVCache(...))`` appends each layer's keys and
values to the cache and attends the cached tokens, so a prompt can be prefilled once and
continued token by token; the cache may be ragged per head (after head-wise eviction). During a
forward with a cache, every callable in ``model.cache_hooks`` is called per layer, after that
layer's attention, as ``hook(layer, num_layers, queries, cache, wo)`` (queries: the new tokens'
post-RoPE queries (B, n_heads, T, head_dim); wo: the layer's output projection [out][in]): a
press (``kvevict.press``) compresses the layer's cache there. Every callable in
``model.cache_pre_hooks`` is called as ``hook(T, cache)`` before the first layer appends (the
press checks and snapshots there, so that a failed forward leaves the cache as it was).

Only torch and the standard library are needed. Runs in fp32 by default; ``model.double()``
gives an fp64 forward.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "LlamaConfig",
    "Llama",
    "load_llama2c",
    "read_llama2c_header",
    "default_model_dir",
    "HEADER_BYTES",
    "KVCache",
]

HEADER_BYTES = 28  # seven little-endian int32
_MAX_DIM = 1 << 16  # sanity bound used to reject garbage headers


def default_model_dir() -> str:
    """Folder of the stories260K model (stories260K.bin, tok512.bin).

    ``$KVEVICT_MODEL_DIR`` if set; else, when this file is inside a kvevict checkout
    (python/kvevict/models/), ``<checkout>/../shared/models/stories260K`` (the project's shared
    folder sits beside the checkout, ../shared/README.md). An installed package has no checkout
    around it: set ``KVEVICT_MODEL_DIR`` or pass the path to ``load_llama2c``.
    """
    env = os.environ.get("KVEVICT_MODEL_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    d = here
    for _ in range(6):  # the checkout (python/kvevict/models) or a build tree inside it (<build>/python/kvevict/models)
        d = os.path.dirname(d)
        cand = os.path.join(os.path.dirname(d), "shared", "models", "stories260K")
        if os.path.isfile(os.path.join(cand, "stories260K.bin")):
            return os.path.normpath(cand)
    return os.path.normpath(os.path.join(here, "..", "..", "..", "..", "shared", "models", "stories260K"))


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape, as in the llama2.c header."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.n_heads // self.n_kv_heads

    def num_floats(self) -> int:
        """Number of fp32 values that follow the header in the legacy format."""
        d, hd, L, V = self.dim, self.hidden_dim, self.n_layers, self.vocab_size
        n = V * d  # tok_emb
        n += L * d  # rms_att
        n += L * d * d  # wq
        n += 2 * L * self.kv_dim * d  # wk, wv
        n += L * d * d  # wo
        n += L * d  # rms_ffn
        n += 3 * L * hd * d  # w1, w2, w3
        n += d  # rms_final
        n += 2 * self.seq_len * (self.head_dim // 2)  # freq_cis_real, freq_cis_imag
        if not self.shared_classifier:
            n += V * d  # wcls
        return n


def read_llama2c_header(data: bytes, path: str = "<bytes>") -> LlamaConfig:
    """Parse and validate the 28-byte header. Raises ValueError with the reason."""
    if len(data) < HEADER_BYTES:
        raise ValueError(
            f"{path}: truncated file: {len(data)} bytes, a llama2.c checkpoint starts with a "
            f"{HEADER_BYTES}-byte header (seven int32)"
        )
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack(
        "<7i", data[:HEADER_BYTES]
    )
    fields = dict(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads,
                  n_kv_heads=n_kv_heads, vocab_size=vocab, seq_len=seq_len)
    desc = ", ".join(f"{k}={v}" for k, v in fields.items())
    for k, v in fields.items():
        x = abs(v) if k == "vocab_size" else v
        if x <= 0 or x > _MAX_DIM:
            raise ValueError(f"{path}: wrong header: {k}={v} out of range (1..{_MAX_DIM}); "
                             f"header reads {desc}")
    if dim % n_heads != 0:
        raise ValueError(f"{path}: wrong header: dim {dim} not divisible by n_heads {n_heads} ({desc})")
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"{path}: wrong header: n_heads {n_heads} not divisible by n_kv_heads "
                         f"{n_kv_heads} ({desc})")
    if (dim // n_heads) % 2 != 0:
        raise ValueError(f"{path}: wrong header: head_dim {dim // n_heads} is odd, RoPE needs pairs "
                         f"({desc})")
    return LlamaConfig(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, vocab_size=abs(vocab), seq_len=seq_len,
                       shared_classifier=vocab > 0)


# Debian's torch links the reference (netlib) BLAS, where x @ W.T is slow; a 1x1 convolution
# goes to oneDNN instead. Used for fp32 only (oneDNN has no fp64 convolution).
USE_ONEDNN_LINEAR = True


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T for x (..., in), w (out, in)."""
    if USE_ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu":
        sh = x.shape
        y = F.conv2d(x.reshape(-1, sh[-1], 1, 1), w[:, :, None, None])
        return y.reshape(*sh[:-1], w.shape[0])
    return x @ w.T


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables (T, head_dim/2), computed in fp64 then cast."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    freq = theta ** (-2.0 * i / head_dim)
    ang = positions.to(torch.float64)[:, None] * freq[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs. x (B, H, T, hd); cos/sin (T, hd/2)."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    return torch.stack((r0, r1), dim=-1).flatten(-2)


BiasArg = Union[None, torch.Tensor, Sequence[Optional[torch.Tensor]],
                Callable[[int, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]]


class KVCache:
    """Per-layer KV cache of ``Llama.forward(cache=...)`` (the press protocol of kvevict.press).

    keys[l], values[l]  (B, n_kv_heads, capacity, head_dim), keys after RoPE;
    lengths[l]          (B, n_kv_heads) int32: valid slots per head (heads may differ after eviction);
    positions[l]        (B, n_kv_heads, capacity) int32: the logical position of each slot (kept
                        through compaction: a kept key keeps its RoPE position);
    next_position       position of the next token (never changes on eviction).
    """

    def __init__(self, cfg: "LlamaConfig", batch: int, capacity: int, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        if batch < 1 or capacity < 1:
            raise ValueError(f"KVCache: batch = {batch} and capacity = {capacity} must be >= 1")
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        L = cfg.n_layers
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
        self.lengths = [torch.zeros(batch, cfg.n_kv_heads, dtype=torch.int32, device=device) for _ in range(L)]
        self.positions = [torch.zeros(batch, cfg.n_kv_heads, capacity, dtype=torch.int32, device=device) for _ in range(L)]
        self.next_position = 0
        self.capacity = capacity

    def append(self, l: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Appends T new tokens (k, v: (B, n_kv_heads, T, head_dim)) to layer l after each head's
        valid slots; returns the lengths before the append (B, n_kv_heads)."""
        B, Hk, T, _ = k.shape
        before = self.lengths[l].clone()
        if int(before.max()) + T > self.capacity:
            raise ValueError(f"KVCache: layer {l} holds {int(before.max())} + {T} tokens > capacity {self.capacity}")
        pos = torch.arange(self.next_position, self.next_position + T, dtype=torch.int32)
        for b in range(B):
            for h in range(Hk):
                n = int(before[b, h])
                self.keys[l][b, h, n:n + T] = k[b, h]
                self.values[l][b, h, n:n + T] = v[b, h]
                self.positions[l][b, h, n:n + T] = pos
        self.lengths[l] += T
        return before


class Llama(nn.Module):
    """Llama forward pass of a llama2.c model.

    Parameters are plain tensors named as in llama2.c (tok_emb, rms_att, wq, wk, wv, wo, rms_ffn,
    w1, w2, w3, rms_final, optional wcls), stacked over layers; matrices are [out][in], y = W x.
    The model is meant to be frozen (``requires_grad_(False)``); gradients still flow through
    ``attn_bias`` to whatever produced it.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        L, d, hd, kv, V = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.kv_dim, cfg.vocab_size
        z = lambda *s: nn.Parameter(torch.zeros(*s), requires_grad=False)
        self.tok_emb = z(V, d)
        self.rms_att = z(L, d)
        self.wq = z(L, d, d)
        self.wk = z(L, kv, d)
        self.wv = z(L, kv, d)
        self.wo = z(L, d, d)
        self.rms_ffn = z(L, d)
        self.w1 = z(L, hd, d)
        self.w2 = z(L, d, hd)
        self.w3 = z(L, hd, d)
        self.rms_final = z(d)
        self.wcls = None if cfg.shared_classifier else z(V, d)
        #: hook(layer, num_layers, queries, cache, wo) per layer of a forward with a cache (module doc)
        self.cache_hooks: List[Callable] = []
        #: hook(num_new_tokens, cache) at the start of a forward with a cache, before any layer appends
        self.cache_pre_hooks: List[Callable] = []

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        attn_bias: BiasArg = None,
        return_kv: bool = False,
        start_pos: int = 0,
        cache: Optional[KVCache] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[Tuple[torch.Tensor, torch.Tensor]]]]:
        """Run the model.

        tokens    (B, T) int64 token ids (a 1-D (T,) tensor is treated as B = 1).
        attn_bias optional additive bias on attention logits, applied per layer to every query head
                  of a GQA group, on top of the causal mask. One of
                  - a tensor (n_layers, B, n_kv_heads, T): one value per key position;
                  - a tensor (n_layers, B, n_kv_heads, T, T): per (query, key), for query-dependent
                    masks;
                  - a sequence of n_layers entries, each None or (B, n_kv_heads, T) or
                    (B, n_kv_heads, T, T);
                  - a callable f(layer, k, v) -> None or such a per-layer tensor, called after the
                    layer's K/V are computed (k post-RoPE, both (B, n_kv_heads, T, head_dim)), so a
                    token scorer can turn this layer's [k ; v] into this layer's mask.
                  Use a large finite negative (e.g. -1e9) to drop a key; -inf on every key a query
                  can see gives NaN, and a finite bias equal on all of a query's visible keys
                  changes nothing (softmax is shift invariant).
        return_kv if True, also return [(k, v)] per layer, k post-RoPE, both
                  (B, n_kv_heads, T, head_dim), in the model dtype.
        start_pos position of tokens[:, 0] (RoPE only) without a cache; with one, the cache's
                  next_position is used instead.
        cache     optional KVCache: the tokens attend the cached ones plus themselves (causal), their
                  keys and values are appended, and model.cache_hooks run per layer (attn_bias and
                  return_kv are not supported with a cache).

        Returns logits (B, T, vocab_size), or (logits, kv_list) when return_kv.
        """
        cfg = self.cfg
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, T), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T == 0:
            raise ValueError("tokens must hold at least one position")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        L, H, Hk, hd, G = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group_size
        dtype = self.tok_emb.dtype
        dev = self.tok_emb.device

        if isinstance(attn_bias, torch.Tensor):
            if attn_bias.dim() not in (4, 5) or attn_bias.shape[0] != L:
                raise ValueError(
                    f"attn_bias tensor must be (n_layers={L}, B, n_kv_heads, T) or "
                    f"(n_layers, B, n_kv_heads, T, T), got {tuple(attn_bias.shape)}")
        elif attn_bias is not None and not callable(attn_bias):
            if len(attn_bias) != L:
                raise ValueError(f"attn_bias sequence must have n_layers={L} entries, got "
                                 f"{len(attn_bias)}")

        if cache is not None:
            if attn_bias is not None or return_kv:
                raise ValueError("forward: attn_bias and return_kv are not supported with a cache")
            return self._forward_cached(tokens, cache)
        pos = torch.arange(start_pos, start_pos + T, device=dev)
        cos, sin = _rope_cos_sin(pos, hd, cfg.rope_theta, dtype)
        cos, sin = cos.to(dev), sin.to(dev)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        scale = 1.0 / math.sqrt(hd)

        x = self.tok_emb[tokens]  # (B, T, d)
        kv_out: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for l in range(L):
            h = _rmsnorm(x, self.rms_att[l], cfg.norm_eps)
            q = _linear(h, self.wq[l]).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
            k = _linear(h, self.wk[l]).view(B, T, Hk, hd).transpose(1, 2)  # (B, Hk, T, hd)
            v = _linear(h, self.wv[l]).view(B, T, Hk, hd).transpose(1, 2)  # (B, Hk, T, hd)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            if return_kv:
                kv_out.append((k, v))

            qg = q.view(B, Hk, G, T, hd)  # query head h = kvh * G + g  ->  KV head h // G
            scores = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale  # (B,Hk,G,T,T)

            bias = self._layer_bias(attn_bias, l, k, v, B, Hk, T)
            if bias is not None:
                scores = scores + bias
            scores = scores.masked_fill(~causal, float("-inf"))
            att = torch.softmax(scores, dim=-1)
            o = torch.matmul(att, v[:, :, None])  # (B, Hk, G, T, hd)
            o = o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)
            x = x + _linear(o, self.wo[l])

            h = _rmsnorm(x, self.rms_ffn[l], cfg.norm_eps)
            x = x + _linear(F.silu(_linear(h, self.w1[l])) * _linear(h, self.w3[l]), self.w2[l])

        x = _rmsnorm(x, self.rms_final, cfg.norm_eps)
        wcls = self.tok_emb if self.wcls is None else self.wcls
        logits = _linear(x, wcls)
        if return_kv:
            return logits, kv_out
        return logits

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """forward() with a KVCache: new token t attends every valid cached slot of its KV head and
        the new tokens 0..t."""
        cfg = self.cfg
        B, T = tokens.shape
        L, H, Hk, hd, G = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group_size
        dtype = self.tok_emb.dtype
        if cache.keys[0].shape[0] != B:
            raise ValueError(f"forward: tokens batch {B} != cache batch {cache.keys[0].shape[0]}")
        for l in range(L):  # nothing is appended when the forward cannot run
            if int(cache.lengths[l].max()) + T > cache.capacity:
                raise ValueError(f"KVCache: layer {l} holds {int(cache.lengths[l].max())} + {T} tokens > capacity {cache.capacity}")
        for hook in list(getattr(self, "cache_pre_hooks", None) or []):
            hook(T, cache)
        pos = torch.arange(cache.next_position, cache.next_position + T)
        cos, sin = _rope_cos_sin(pos, hd, cfg.rope_theta, dtype)
        scale = 1.0 / math.sqrt(hd)
        cap = cache.capacity
        slot = torch.arange(cap)
        x = self.tok_emb[tokens]
        for l in range(L):
            h = _rmsnorm(x, self.rms_att[l], cfg.norm_eps)
            q = _linear(h, self.wq[l]).view(B, T, H, hd).transpose(1, 2)
            k = _linear(h, self.wk[l]).view(B, T, Hk, hd).transpose(1, 2)
            v = _linear(h, self.wv[l]).view(B, T, Hk, hd).transpose(1, 2)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            before = cache.append(l, k, v)  # (B, Hk)
            # slot s is visible to new token t when s < before + t + 1
            limit = before[:, :, None].to(torch.int64) + torch.arange(T)[None, None, :] + 1  # (B, Hk, T)
            visible = slot[None, None, None, :] < limit[..., None]  # (B, Hk, T, cap)
            qg = q.view(B, Hk, G, T, hd)
            kc, vc = cache.keys[l], cache.values[l]
            scores = torch.matmul(qg, kc[:, :, None].transpose(-1, -2)) * scale  # (B, Hk, G, T, cap)
            scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
            att = torch.softmax(scores, dim=-1)
            o = torch.matmul(att, vc[:, :, None])
            o = o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)
            x = x + _linear(o, self.wo[l])
            for hook in list(self.cache_hooks):
                hook(l, L, q, cache, self.wo[l])
            h = _rmsnorm(x, self.rms_ffn[l], cfg.norm_eps)
            x = x + _linear(F.silu(_linear(h, self.w1[l])) * _linear(h, self.w3[l]), self.w2[l])
        cache.next_position += T
        x = _rmsnorm(x, self.rms_final, cfg.norm_eps)
        wcls = self.tok_emb if self.wcls is None else self.wcls
        return _linear(x, wcls)

    @staticmethod
    def _layer_bias(attn_bias: BiasArg, l: int, k, v, B: int, Hk: int, T: int):
        """Per-layer bias as a tensor broadcastable to (B, Hk, G, T_q, T_k), or None."""
        if attn_bias is None:
            return None
        if callable(attn_bias) and not isinstance(attn_bias, torch.Tensor):
            b = attn_bias(l, k, v)
        else:
            b = attn_bias[l]
        if b is None:
            return None
        if b.dim() == 3 and tuple(b.shape) == (B, Hk, T):
            return b[:, :, None, None, :].to(k.dtype)  # same bias for every query (and group head)
        if b.dim() == 4 and tuple(b.shape) == (B, Hk, T, T):
            return b[:, :, None, :, :].to(k.dtype)
        raise ValueError(
            f"attn_bias for layer {l} must be (B={B}, n_kv_heads={Hk}, T={T}) or "
            f"(B, n_kv_heads, T, T), got {tuple(b.shape)}")

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_greedy(self, prompt: Sequence[int], n_new: int) -> List[int]:
        """Greedy continuation (argmax, full recompute each step; fine for tiny models)."""
        ids = list(prompt)
        dev = self.tok_emb.device
        for _ in range(n_new):
            logits = self(torch.tensor([ids], dtype=torch.long, device=dev))
            ids.append(int(logits[0, -1].argmax()))
        return ids[len(prompt):]


def load_llama2c(path: Optional[str] = None, expect: Optional[LlamaConfig] = None) -> Llama:
    """Load a llama2.c legacy checkpoint (7 int32 header + fp32 arrays) into a frozen ``Llama``.

    path   defaults to ``default_model_dir()/stories260K.bin``.
    expect if given, the header must match it (else ValueError "wrong header").
    Raises ValueError for a truncated file, a bad header, or a size that does not match the
    header (trailing bytes or a partial float).
    """
    if path is None:
        path = os.path.join(default_model_dir(), "stories260K.bin")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no stories260K checkpoint there; set KVEVICT_MODEL_DIR to the folder of "
                                    "stories260K.bin (../shared/models/stories260K beside a kvevict checkout) or pass path=")
    with open(path, "rb") as f:
        data = f.read()
    cfg = read_llama2c_header(data, path)
    if expect is not None:
        got = (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
               cfg.vocab_size, cfg.seq_len, cfg.shared_classifier)
        want = (expect.dim, expect.hidden_dim, expect.n_layers, expect.n_heads,
                expect.n_kv_heads, expect.vocab_size, expect.seq_len, expect.shared_classifier)
        if got != want:
            raise ValueError(f"{path}: wrong header: got {cfg}, expected {expect}")
    n = cfg.num_floats()
    want_bytes = HEADER_BYTES + 4 * n
    if len(data) < want_bytes:
        raise ValueError(f"{path}: truncated file: {len(data)} bytes, the header ({cfg}) needs "
                         f"{want_bytes} ({n} floats)")
    if len(data) > want_bytes:
        raise ValueError(f"{path}: wrong size: {len(data)} bytes, the header ({cfg}) needs exactly "
                         f"{want_bytes} ({n} floats); {len(data) - want_bytes} trailing bytes")
    flat = torch.frombuffer(bytearray(data[HEADER_BYTES:]), dtype=torch.float32)
    if not torch.isfinite(flat).all():
        raise ValueError(f"{path}: weights contain NaN or Inf")

    m = Llama(cfg)
    L, d, hd, kv, V = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.kv_dim, cfg.vocab_size
    off = 0

    def take(shape):
        nonlocal off
        cnt = 1
        for s in shape:
            cnt *= s
        t = flat[off:off + cnt].reshape(shape).clone()
        off += cnt
        return t

    with torch.no_grad():
        m.tok_emb.copy_(take((V, d)))
        m.rms_att.copy_(take((L, d)))
        m.wq.copy_(take((L, d, d)))
        m.wk.copy_(take((L, kv, d)))
        m.wv.copy_(take((L, kv, d)))
        m.wo.copy_(take((L, d, d)))
        m.rms_ffn.copy_(take((L, d)))
        m.w1.copy_(take((L, hd, d)))
        m.w2.copy_(take((L, d, hd)))
        m.w3.copy_(take((L, hd, d)))
        m.rms_final.copy_(take((d,)))
        off += 2 * cfg.seq_len * (cfg.head_dim // 2)  # freq_cis_real/imag: recomputed instead
        if m.wcls is not None:
            m.wcls.copy_(take((V, d)))
    assert off == n
    m.eval()
    return m
