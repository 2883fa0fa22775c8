"""kvevict in Hugging Face transformers: a press for transformers causal LMs, in kvpress's shape.

``Press(method, budget=...)`` (or ``compression_ratio=``, kvpress's fraction removed) is a context
manager over a model, as kvpress's presses are::

    from transformers import DynamicCache
    from kvevict.hf import Press
    cache = DynamicCache()
    with Press("snapkv", compression_ratio=0.8)(model):
        model(input_ids, past_key_values=cache)        # prefill: each layer's cache compressed
    model(next_ids, past_key_values=cache)             # decoding reads the compressed cache

It hooks every decoder layer's attention module (``model.model.layers[i].self_attn``, Llama-like:
``q_proj``, ``o_proj``, ``layer_idx``; transformers >= 4.56 with ``cache.layers``), and after the
layer's attention has run on the prompt it selects with the kvevict method (the C++ library, the
same call as ``kvevict.select``) and replaces the layer's ``DynamicCache`` keys and values with the
kept tokens, in position order. Queries are the prompt's last ``window`` queries, recomputed from
the layer's input (``q_proj`` and the layer's RoPE), as kvpress does. One-shot (the default),
compression runs only in the prefill (a forward whose cache was empty), like kvpress's ``BasePress``.
With ``interval=beta`` it is decode-time eviction, as ``kvevict.press.Press(..., interval=)``: a
``kvevict.DecodeSchedule`` evicts after each prompt and every ``beta`` generated tokens to the cap
(``budget`` tokens per KV head, or a fraction of the tokens seen), with ``protect_prefix`` /
``protect_recent``; each layer's last ``window`` queries and its slots' positions are kept across
forwards (methods that read every query, H2O, need ``window=N`` there). Decoding then runs inside the
``with`` block, and the forwards pass ``position_ids``.

**What a transformers cache can hold**: ``DynamicCache`` keeps one length per layer (a dense
[batch, kv_heads, seq, head_dim] tensor), so each layer keeps the same number of tokens in every
head and every sequence. Uniform-budget methods (ReST-KV, SnapKV, PyramidKV - its budgets differ
between layers, not heads -, CriticalKV, H2O, TOVA, StreamingLLM, key norm, LKV with uniform
budgets) fit exactly. Head-wise methods (AdaKV, AdaKV as published, CriticalAdaKV, LKV-H) give
heads different lengths, which this cache cannot hold: they are refused at construction with that
reason (kvevict's own press, ``kvevict.press`` over ``kvevict.models.llama2c``, holds ragged heads;
kvpress fakes them by masking keys, which frees no memory).

``as_kvpress(press)`` wraps a ``Press`` as a kvpress ``BasePress`` (kvpress installed), so that
kvpress's own machinery (its hooks, its pipeline) runs a kvevict method.

Bad input is refused at construction like ``kvevict.press.Press`` (budget against the window,
parameters, head-wise methods). Compression is all or nothing: every layer's cache is replaced
only after the last layer's selection succeeded, so a layer whose selection fails raises
``kvevict.Error`` naming the layer and leaves no layer compressed (the cache holds the prompt as the
forward without the press would). After compression pass ``position_ids`` to the next forwards
(the cache is shorter than the positions seen), as kvpress's pipeline does. This module imports
transformers only inside the calls that need it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from . import Error, Selection, _api
from .press import Press as _CorePress

__all__ = ["Press", "as_kvpress", "HEADWISE_METHODS"]

#: Methods whose heads keep different numbers of tokens (not representable in a DynamicCache).
HEADWISE_METHODS = ("adakv", "adakv_published", "critical_adakv", "defensivekv", "lkv", "lkv_budgets_restkv", "lkv_budgets_attention")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Press:
    """A kvevict method applied to a transformers causal LM's KV cache at the end of prefill.

    Arguments as ``kvevict.press.Press``: ``method`` (``kvevict.methods()`` but the head-wise ones,
    ``HEADWISE_METHODS``), exactly one of ``budget`` (int tokens per KV head, float keep fraction) and
    ``compression_ratio`` (the fraction removed, kvpress's), ``window`` (prompt queries read; default
    the method's, 32), ``artifact`` (LKV), ``params`` (``kvevict.defaults(method)`` overrides).
    ``selections[l]`` keeps layer l's last Selection (slots = prompt positions).
    """

    @_api
    def __init__(self, method: str, budget: Union[int, float, None] = None, window: Optional[int] = -1,
                 artifact: Optional[str] = None, *, compression_ratio: Optional[float] = None, interval: Optional[int] = None,
                 protect_prefix: int = 0, protect_recent: int = 0, **params: Any) -> None:
        if method in HEADWISE_METHODS:
            raise Error(f"kvevict.hf: method '{method}' gives KV heads different lengths, which a transformers DynamicCache "
                        "cannot hold (one length per layer); use a uniform-budget method, or kvevict.press over a cache "
                        "with per-head lengths")
        # the budget, window and parameters are checked as kvevict's own press checks them
        self._core = _CorePress(method, budget, window, artifact, compression_ratio=compression_ratio, interval=interval,
                                protect_prefix=protect_prefix, protect_recent=protect_recent, **params)
        if interval is not None and self._core.window is None:
            raise Error(f"kvevict.hf: {method} reads every query (window=None); across decode-time evictions that is more "
                        "queries than a DynamicCache holds keys: pass window=N (the last N queries) with interval=")
        self.method = method
        self.evictions = 0
        self._qlog: Dict[int, torch.Tensor] = {}  # decode-time: each layer's last `window` queries
        self._pos: Dict[int, torch.Tensor] = {}   # decode-time: each layer's slot positions [batch, kv_heads, len]
        self._fwd: Optional[Dict[str, Any]] = None
        self.selections: Dict[int, Selection] = {}
        self.seconds = 0.0  # time spent in compress (queries, select, gather), summed over layers and calls
        self._pending: Dict[int, Any] = {}

    @property
    def budget(self) -> Union[int, float]:
        return self._core.budget

    @property
    def window(self) -> Optional[int]:
        return self._core.window

    @property
    def schedule(self) -> Any:
        """The ``kvevict.DecodeSchedule`` of decode-time eviction (None: one-shot)."""
        return self._core.schedule

    # kvpress's BasePress interface --------------------------------------------------------------
    def post_init_from_model(self, model: Any) -> None:
        pass

    def _queries(self, module: Any, hidden_states: torch.Tensor, kwargs: Dict[str, Any], n: int) -> torch.Tensor:
        """The post-RoPE queries of the last ``n`` tokens of this forward, [batch, q_heads, n, head_dim]."""
        B, D, H = hidden_states.shape[0], int(module.head_dim), int(module.config.num_attention_heads)
        q = module.q_proj(hidden_states[:, -n:]).view(B, n, H, D).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        cos, sin = cos[:, -n:].unsqueeze(1), sin[:, -n:].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin

    def _select(self, module: Any, keys: torch.Tensor, values: torch.Tensor, q: Optional[torch.Tensor], evictor: Any,
                budget: Union[int, float], positions: Optional[torch.Tensor] = None) -> Selection:
        """One layer's selection (a uniform count per head, else an Error naming the layer)."""
        layer = int(module.layer_idx)
        num_layers = int(module.config.num_hidden_layers)
        D = keys.shape[3]
        H = int(module.config.num_attention_heads)
        extra = {k: (t.to(keys.dtype) if k == "wo" else t) for k, t in self._core._wo_args(layer, module.o_proj.weight, H).items()}
        skeys = keys
        if self.method.startswith("lkv") and getattr(module.config, "kvevict_llama2c_rope", False):
            # a model converted by kvevict.models.hf: its keys hold each RoPE pair i at (i, i + D/2); LKV's
            # scorer was trained on llama2.c's interleaved order (2i, 2i + 1)
            order = torch.tensor([j // 2 if j % 2 == 0 else D // 2 + j // 2 for j in range(D)], device=keys.device)
            skeys = keys.index_select(3, order)
        try:
            sel = evictor.select(queries=None if q is None else q.to(keys.dtype), keys=skeys, values=values, budget=budget,
                                 layout="HND", positions=positions, layer_idx=layer, num_layers=num_layers, **extra)
        except Error as e:
            raise Error(f"kvevict.hf: layer {layer} of {num_layers} ({self.method}): {e}; no layer's cache was changed") from None
        ip = sel.indptr.tolist()  # a few rows: plain Python is cheaper than tensor ops here
        c = [b - a for a, b in zip(ip, ip[1:])]
        if c and any(x != c[0] for x in c):  # a method the constructor did not know as head-wise (custom parameters)
            raise Error(f"kvevict.hf: layer {layer}: {self.method} kept {c} tokens per head; "
                        "a transformers DynamicCache holds one length per layer")
        return sel

    @staticmethod
    def _gather(t: torch.Tensor, sel: Selection, idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The kept rows of t [batch, heads, seq(, dim)]; `idx`: the selection's indices as int64
        [batch, heads, kept] on t's device when the caller has them already."""
        if idx is None:
            idx = sel.indices.to(device=t.device, dtype=torch.int64).view(t.shape[0], t.shape[1], -1)
        if t.dim() == 4:
            return t.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, t.shape[3]))
        return t.gather(2, idx)

    # kvpress's BasePress interface --------------------------------------------------------------
    def post_init_from_model(self, model: Any) -> None:
        pass

    def compress(self, module: Any, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: Any, kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """kvpress's ``compress`` (one-shot, after a prefill): the kept keys and values of one layer,
        [batch, kv_heads, kept, head_dim] in position order. ``hidden_states`` [batch, seq, hidden] is the
        layer's attention input, ``kwargs["position_embeddings"]`` the (cos, sin) of its RoPE."""
        t0 = time.perf_counter()
        w = self._core.window
        q = None if w == 0 else self._queries(module, hidden_states, kwargs, hidden_states.shape[1] if w is None else
                                              min(w, hidden_states.shape[1]))
        sel = self._select(module, keys, values, q, self._core.evictor, self._core.budget)
        self.selections[int(module.layer_idx)] = sel
        idx = sel.indices.to(device=keys.device, dtype=torch.int64).view(keys.shape[0], keys.shape[1], -1)
        out = self._gather(keys, sel, idx), self._gather(values, sel, idx)
        self.seconds += time.perf_counter() - t0
        return out

    def forward_hook(self, module: Any, args: Any, kwargs: Dict[str, Any], output: Any) -> Any:
        """The hook on one attention module: compress its layer's cache after the prefill's attention
        (one-shot), or when the decode-time schedule says (``interval=``)."""
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # the name differs between transformers releases
        if cache is None or hidden is None:
            return output
        idx = int(module.layer_idx)
        last = idx == int(module.config.num_hidden_layers) - 1
        layer = cache.layers[idx]
        T = hidden.shape[1]
        if self._core.schedule is not None:
            self._decode_hook(module, layer, hidden, kwargs, idx, last, T)
            return output
        if layer.keys is None or layer.keys.numel() == 0 or layer.keys.shape[2] != T:
            return output  # not a prefill of an empty cache: decoding, or a second prompt
        if idx == 0:
            self._pending = {}
        keys, values = self.compress(module, hidden, layer.keys, layer.values, output[1] if len(output) > 1 else None, kwargs)
        # All or nothing: every layer's cache is replaced only after the last layer's selection succeeded (a
        # layer's cache is read by that layer only, so deferring the replacement changes no result).
        self._pending[idx] = (layer, keys, values)
        if last:
            pending, self._pending = self._pending, {}
            for lay, k, v in pending.values():
                lay.keys, lay.values = k, v
            self.evictions += 1
        return output

    def _decode_hook(self, module: Any, layer: Any, hidden: torch.Tensor, kwargs: Dict[str, Any], idx: int, last: bool,
                     T: int) -> None:
        """Decode-time eviction (``interval=``): the schedule decides at layer 0 of each forward; every
        layer logs its last ``window`` queries and the positions of its slots; an eviction selects every
        layer with the schedule's budget and protection and replaces the caches after the last layer."""
        t0 = time.perf_counter()
        held = layer.keys.shape[2] - T  # tokens of this layer before the forward appended T
        if idx == 0:
            sched = self._core.schedule.copy()
            qlog, pos = dict(self._qlog), dict(self._pos)
            if held == 0:  # an empty cache: a new request
                sched.reset()
                qlog, pos = {}, {}
            t_before = sched.tokens_seen
            action = sched.after_prefill(T) if (T > 1 or t_before == 0) else sched.after_decode(T)
            self._fwd = {"sched": sched, "action": action, "qlog": qlog, "pos": pos, "t": t_before, "pending": {}}
        f = self._fwd
        if f is None:
            raise Error(f"kvevict.hf: layer {idx} reached the press before layer 0 of this forward")
        B, Hk = layer.keys.shape[0], layer.keys.shape[1]
        new_pos = torch.arange(f["t"], f["t"] + T, dtype=torch.int32).view(1, 1, T).expand(B, Hk, T)
        prev = f["pos"].get(idx)
        pos = new_pos.contiguous() if prev is None else torch.cat([prev, new_pos], dim=2)
        f["pos"][idx] = pos
        w = self._core.window
        q = None
        if w != 0:
            qn = self._queries(module, hidden, kwargs, T if w is None else min(w, T))
            qp = f["qlog"].get(idx)
            q = qn if qp is None else torch.cat([qp, qn], dim=2)
            if w is not None:
                q = q[:, :, -w:]
            f["qlog"][idx] = q
        if f["action"].evict:
            ev, budget = f["sched"].apply(f["action"], self._core.evictor, 0 if q is None else q.shape[2])
            sel = self._select(module, layer.keys, layer.values, q, ev, budget, positions=pos)
            f["pending"][idx] = (layer, sel)
        self.seconds += time.perf_counter() - t0
        if last:
            self._fwd = None
            for i, (lay, sel) in f["pending"].items():
                lay.keys, lay.values = self._gather(lay.keys, sel), self._gather(lay.values, sel)
                f["pos"][i] = self._gather(f["pos"][i], sel)
                self.selections[i] = sel
            if f["action"].evict:
                f["sched"].evicted(f["action"])
                self.evictions += 1
            self._core.schedule, self._qlog, self._pos = f["sched"], f["qlog"], f["pos"]

    @contextlib.contextmanager
    def __call__(self, model: Any) -> Iterator["Press"]:
        layers = _decoder_layers(model)
        hooks: List[Any] = []
        try:
            for layer in layers:
                hooks.append(layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True))
            yield self
        finally:
            for h in hooks:
                h.remove()


def _decoder_layers(model: Any) -> List[Any]:
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or not all(hasattr(l, "self_attn") for l in layers):
        raise Error(f"kvevict.hf: {type(model).__name__} has no decoder layers with self_attn (model.model.layers): "
                    "not a Llama-like transformers causal LM")
    for l in layers:
        a = l.self_attn
        if not (hasattr(a, "q_proj") and hasattr(a, "o_proj") and hasattr(a, "layer_idx")):
            raise Error(f"kvevict.hf: {type(a).__name__} lacks q_proj / o_proj / layer_idx (Llama-like attention needed)")
    return list(layers)


def as_kvpress(press: Press) -> Any:
    """``press`` as a kvpress ``BasePress`` (kvpress must be installed): kvpress's own hooks and
    pipeline call its ``compress``, so a kvpress user swaps one line for a kvevict method."""
    if not isinstance(press, Press):
        raise Error(f"kvevict.hf.as_kvpress: press must be a kvevict.hf.Press, got {type(press).__name__}")
    from kvpress import BasePress

    class KvevictKVPress(BasePress):  # kvpress's dataclass base, no fields of its own
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):  # noqa: D102
            return press.compress(module, hidden_states, keys, values, attentions, kwargs)

        @property
        def compression_ratio(self) -> float:  # what kvpress's pipeline may read
            b = press.budget
            return 1.0 - b if isinstance(b, float) else 0.0

    KvevictKVPress.__name__ = f"KvevictKVPress[{press.method}]"
    return KvevictKVPress()
