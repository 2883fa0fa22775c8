"""A press in the kvpress style: compress every attention layer's KV cache after prefill, and
optionally while the model generates.

``Press(method, budget)`` wraps one kvevict method (``kvevict.methods()``) with a budget. Used as
a context manager on a model, it compresses each layer's cache once, right after that layer's
attention has run on the prompt (one-shot eviction at the end of prefill, the papers' setting):
prefill still attends the full prompt, every later token attends the compressed cache::

    from kvevict.press import Press
    from kvevict.models.llama2c import KVCache
    cache = KVCache(model.cfg, batch=1, capacity=prompt_len + new_tokens)
    with Press("snapkv", budget=0.2)(model):
        logits = model(prompt_ids, cache=cache)      # prefill: each layer compressed in turn
    logits = model(next_ids, cache=cache)            # decoding reads the compressed cache

``Press(method, budget=B, interval=beta)`` is decode-time eviction (``kvevict.DecodeSchedule``):
the cache is evicted after the prompt and after every ``beta`` generated tokens to the cap B per
KV head (or a fraction of the tokens seen), with an optional protected prefix and recent window;
decoding must then run inside the ``with`` block.

The model protocol (``kvevict.models.llama2c``'s ``Llama`` and ``KVCache`` implement it; any
PyTorch model can):

- ``model.cache_hooks``: a list of callables; during a forward with a cache, after layer l's
  attention, the model calls ``hook(l, num_layers, queries, cache, wo)`` with ``queries`` the new
  tokens' post-RoPE queries [batch, q_heads, T, head_dim] and ``wo`` the layer's output projection
  [hidden, q_heads * head_dim] ([out][in], nn.Linear's weight);
- ``model.cache_pre_hooks`` (optional): a list of callables the model calls as ``hook(T, cache)``
  at the start of a forward with a cache, before any layer appends its T new tokens. With it, the
  press checks the forward before anything is written and a failed forward leaves every layer's
  cache bit-identical; without it, a failure restores the lengths (the rejected tokens' K/V stay in
  the slots past them);
- the cache exposes, per layer l, ``keys[l]``/``values[l]`` [batch, kv_heads, capacity, head_dim]
  (HND, keys after RoPE), ``lengths[l]`` [batch, kv_heads] int32 (valid slots per head; heads may
  differ after head-wise eviction) and ``positions[l]`` [batch, kv_heads, capacity] int32.

Errors: the budget, window and parameters are checked at construction (a token budget below the
tokens the method always keeps raises there, not mid-forward). A forward that cannot be evicted
(a second multi-token forward into a one-shot press, NaN in the data, ...) raises ``kvevict.Error``
with every layer's cache as it was before the call: the layers are selected as the forward runs
and compacted only after the last layer's selection succeeded.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import (DecodeSchedule, Error, Evictor, Selection, _api, _as_int, _budget, _int_arg, compact, wo_factors)

__all__ = ["Press", "DEFAULT_WINDOWS"]

#: Observation window (queries read) per method, as in the papers and kvevict's fidelity report:
#: 32 prompt queries; H2O all of them (None); StreamingLLM and the query-free LKV rows none (0).
DEFAULT_WINDOWS: Dict[str, Optional[int]] = {
    "h2o": None, "streaming_llm": 0, "key_norm": 0, "lkv": 0, "lkv_uniform_budgets": 0,
}


class Press:
    """One kvevict method with a budget, applied to every layer of a model.

    ``method``: a name from ``kvevict.methods()``. Budget, exactly one of: ``budget`` (an int:
    tokens per KV head; a float keep fraction in (0, 1] of each head's length) or
    ``compression_ratio`` (kvpress's: the fraction removed, in [0, 1)). ``window``: queries the
    method reads (default ``DEFAULT_WINDOWS`` or 32; None: all of them); ``artifact``: an LKV
    artifact path (LKV methods); ``params``: overrides of ``kvevict.defaults(method)``
    (``temporal_alpha=0.5``).

    Decode-time eviction: ``interval`` (beta >= 1; None, the default: one-shot eviction after the
    prefill only) evicts after each prompt and every ``interval`` generated tokens with a
    ``kvevict.DecodeSchedule``: an int budget is then the cap per KV head, a float the fraction of
    the tokens seen; ``protect_prefix`` / ``protect_recent`` tokens are never evicted. The
    observation window is the method's last ``window`` queries across forwards (so that an
    eviction after every token still sees a full window), as the C++ decoding report does.
    Chunked prefill and multi-turn prompts are prefills the schedule is told of.

    ``selections[l]`` keeps the last Selection of layer l; ``schedule`` the DecodeSchedule
    (decode-time eviction) and ``evictions`` the count of evictions of the whole model.
    """

    @_api
    def __init__(self, method: str, budget: Union[int, float, None] = None, window: Optional[int] = -1,
                 artifact: Optional[str] = None, *, compression_ratio: Optional[float] = None,
                 interval: Optional[int] = None, protect_prefix: int = 0, protect_recent: int = 0, **params: Any) -> None:
        self.method = method
        keep_tokens, keep_fraction = _budget(budget, compression_ratio)
        self.budget: Union[int, float] = keep_tokens if keep_tokens > 0 else keep_fraction
        if window is not None and window != -1:
            w = _as_int(window)
            if w is None or w < 0:
                raise Error(f"kvevict.press: window = {window!r} must be an int >= 0 or None (all queries)")
            window = w
        self.window = DEFAULT_WINDOWS.get(method, 32) if window == -1 else window
        self.evictor = Evictor(method, artifact=artifact, **params)
        self._use_wo = bool(self.evictor.params.get("scorer.use_wo", False))  # ReST-KV's W_O factors
        self.schedule: Optional[DecodeSchedule] = None
        if interval is not None:
            self.schedule = DecodeSchedule(interval=interval, budget=self.budget, protect_prefix=protect_prefix,
                                           protect_recent=protect_recent)
        elif protect_prefix or protect_recent:
            raise Error("kvevict.press: protect_prefix and protect_recent need decode-time eviction (interval=); for one-shot "
                        "eviction pass selector_num_sink= / selector_num_recent= instead")
        self.selections: Dict[int, Selection] = {}
        self.evictions = 0
        self._factors: Dict[int, torch.Tensor] = {}
        self._qlog: Dict[int, torch.Tensor] = {}  # decode-time: the last `window` queries of each layer
        self._fwd: Optional[Dict[str, Any]] = None  # the forward in progress (see _begin)
        self._check_budget()

    # ------------------------------------------------------------------------------------------
    def _check_budget(self) -> None:
        """Runs the method once on a small dummy layer with this budget, so that a budget the
        method refuses (below its window and sinks, ...) raises at construction. LKV methods read
        the model's shape from their artifact and are checked at the first forward instead."""
        if self.method.startswith("lkv"):
            return
        w = 32 if self.window is None else self.window
        b = self.budget if isinstance(self.budget, int) else 1
        protect = 0 if self.schedule is None else self.schedule.protect_prefix + self.schedule.protect_recent
        if b > w + protect + 4096:  # far above what a method keeps always: checked at the first forward, not with a
            return                  # dummy layer of that size
        n = b + w + protect + 64
        d = 8
        g = torch.Generator().manual_seed(0)
        k = torch.randn(1, 1, n, d, generator=g)
        q = torch.randn(1, 1, w, d, generator=g) if w > 0 else None
        ev, budget = self.evictor, self.budget
        try:
            if self.schedule is not None:
                s = self.schedule.copy()
                a = s.after_prefill(n)
                if a.evict:
                    ev, budget = s.apply(a, ev, 0 if q is None else w)
            ev.select(queries=q, keys=k, values=torch.randn(1, 1, n, d, generator=g), budget=budget, layout="HND",
                      wo=torch.eye(d), wo_factor=torch.eye(d).unsqueeze(0))
        except Error as e:
            raise Error(f"kvevict.press: {self.method} with budget = {self.budget!r} (window {self.window}): {e}") from None

    def __call__(self, model: torch.nn.Module) -> "_Applied":
        if not isinstance(getattr(model, "cache_hooks", None), list):
            raise Error(f"kvevict.press: {type(model).__name__} has no cache_hooks list (the press protocol: kvevict.press's docstring)")
        return _Applied(self, model)

    def _wo_args(self, layer: int, wo: torch.Tensor, q_heads: int) -> Dict[str, torch.Tensor]:
        if self._use_wo:  # ReST-KV: the d x d factors of W_O, once per layer
            if layer not in self._factors:
                self._factors[layer] = wo_factors(wo.detach(), q_heads)
            return {"wo_factor": self._factors[layer]}
        if self.method in ("criticalkv", "critical_adakv", "defensivekv"):
            return {"wo": wo.detach()}  # in the cache's dtype (compress_layer converts)
        return {}

    # --- one forward: begin (before any layer appends), a selection per layer, then compaction --
    def _begin(self, T: int, cache: Any, lengths: List[torch.Tensor], snapshot: bool) -> None:
        """Decides what this T-token forward does. ``lengths``: every layer's lengths before the
        forward (kept, so that a failure restores them). With ``snapshot`` (the pre-hook, before any
        layer appends) it also saves the slots an evicting forward will overwrite, [min length,
        max length + T) of each layer, so that a failure restores the cache bit for bit. Raises
        before anything is decided."""
        self._fwd = None
        L = len(lengths)
        held = [int(lengths[l].max()) for l in range(L)]
        sched = None if self.schedule is None else self.schedule.copy()
        qlog = dict(self._qlog)
        if sched is not None and max(held) == 0:  # an empty cache: a new request
            sched.reset()
            qlog = {}
        action = None
        if self.schedule is None:
            if T > 1 and max(held) > 0:
                raise Error(f"kvevict.press: the cache holds {max(held)} tokens before this {T}-token forward; a one-shot press "
                            "compresses once, after a one-shot prefill of an empty cache (chunked prefill and multi-turn "
                            "prompts: Press(..., interval=N), decode-time eviction)")
            evict = T > 1
        else:
            first = sched.tokens_seen == 0
            action = sched.after_prefill(T) if (T > 1 or first) else sched.after_decode(T)
            evict = action.evict
        slots = []  # (lo, K, V, positions) per layer; a forward that does not evict writes only past the lengths
        if snapshot and evict:
            for l in range(L):
                lo = int(lengths[l].min())
                hi = min(held[l] + T, cache.keys[l].shape[2])
                slots.append((lo, cache.keys[l][:, :, lo:hi].clone(), cache.values[l][:, :, lo:hi].clone(),
                              cache.positions[l][:, :, lo:hi].clone()))
        self._fwd = {"T": T, "evict": evict, "action": action, "sched": sched, "lengths": [t.clone() for t in lengths],
                     "slots": slots, "sel": {}, "qlog": qlog, "cache": cache, "fresh": snapshot}

    def _restore(self) -> None:
        """Puts the cache back as it was before the forward (see _begin) and forgets the forward."""
        f, self._fwd = self._fwd, None
        if f is None:
            return
        cache = f["cache"]
        for l, (lo, k, v, p) in enumerate(f["slots"]):  # none without the pre-hook: only the lengths come back
            hi = lo + k.shape[2]
            cache.keys[l][:, :, lo:hi] = k
            cache.values[l][:, :, lo:hi] = v
            cache.positions[l][:, :, lo:hi] = p
        for l, ln in enumerate(f["lengths"]):
            cache.lengths[l].copy_(ln)

    def _queries(self, layer: int, queries: torch.Tensor) -> Optional[torch.Tensor]:
        """The query rows the method reads at this layer: this forward's last ``window`` (one-shot),
        or the last ``window`` across forwards (decode-time eviction)."""
        if self.window == 0:
            return None
        if self.schedule is None:
            return queries if self.window is None else queries[:, :, -self.window:]
        prev = self._fwd["qlog"].get(layer)
        q = queries if prev is None else torch.cat([prev, queries], dim=2)
        if self.window is not None:
            q = q[:, :, -self.window:]
        self._fwd["qlog"][layer] = q
        return q

    def compress_layer(self, layer: int, num_layers: int, queries: torch.Tensor, cache: Any,
                       wo: torch.Tensor) -> Optional[Selection]:
        """The hook's work for layer ``layer``: select its kept tokens (when this forward evicts),
        and after the last layer compact every layer in place. Returns the layer's Selection, or
        None when this forward does not evict (one-shot: a decoding step)."""
        f = self._fwd
        if layer == 0 and f is not None and f.get("fresh") and f["cache"] is cache:
            f["fresh"] = False  # begun by the pre-hook of this forward
        elif layer == 0 or f is None or f["cache"] is not cache:  # no pre-hook in this model: begin at layer 0
            if layer != 0:
                raise Error(f"kvevict.press: layer {layer} reached the press before layer 0 of this forward")
            T = queries.shape[2]  # layer 0 has appended its T tokens; the other layers not yet
            before = [cache.lengths[l] - T if l == 0 else cache.lengths[l] for l in range(len(cache.lengths))]
            try:
                self._begin(T, cache, before, snapshot=False)
            except BaseException:
                cache.lengths[0].copy_(before[0])  # drop layer 0's new tokens
                raise
            f = self._fwd
        try:
            q = self._queries(layer, queries)
            if not f["evict"]:
                sel = None
            else:
                k, v = cache.keys[layer], cache.values[layer]
                lengths, positions = cache.lengths[layer], cache.positions[layer]
                ev, budget = self.evictor, self.budget
                if f["action"] is not None:
                    ev, budget = f["sched"].apply(f["action"], ev, 0 if q is None else q.shape[2])
                qk = None if q is None else q.to(k.dtype)
                extra = {key: t.to(k.dtype) if key == "wo" else t for key, t in self._wo_args(layer, wo, queries.shape[1]).items()}
                try:
                    sel = ev.select(queries=qk, keys=k, values=v, budget=budget, layout="HND", lengths=lengths,
                                    positions=positions, layer_idx=layer, num_layers=num_layers, **extra)
                except Error as e:
                    raise Error(f"kvevict.press: layer {layer} of {num_layers} ({self.method}): {e}; the cache is as it was "
                                "before this forward") from None
                f["sel"][layer] = sel
            if layer == num_layers - 1:
                self._finish()
            return sel
        except BaseException:
            self._restore()
            raise

    def _finish(self) -> None:
        """After the last layer: compact every selected layer, commit the schedule and query log."""
        f = self._fwd
        cache = f["cache"]
        for layer, sel in sorted(f["sel"].items()):
            compact(cache.keys[layer], sel, layout="HND")
            compact(cache.values[layer], sel, layout="HND")
            compact(cache.positions[layer], sel)
            cache.lengths[layer].copy_(sel.counts())
            self.selections[layer] = sel
        if f["sched"] is not None:
            if f["evict"]:
                f["sched"].evicted(f["action"])
            self.schedule = f["sched"]
        if f["evict"]:
            self.evictions += 1
        self._qlog = f["qlog"]
        self._fwd = None


class _Applied:
    """The context manager of ``Press(...)(model)``: installs the press's hooks on entry, removes
    them on exit (also when the forward raised)."""

    def __init__(self, press: Press, model: torch.nn.Module) -> None:
        self.press, self.model = press, model
        self._hook = self._pre = None

    def __enter__(self) -> Press:
        press = self.press

        def hook(layer: int, num_layers: int, queries: torch.Tensor, cache: Any, wo: torch.Tensor) -> None:
            press.compress_layer(layer, num_layers, queries, cache, wo)

        def pre(T: int, cache: Any) -> None:
            press._begin(T, cache, list(cache.lengths), snapshot=True)

        self._hook = hook
        self.model.cache_hooks.append(hook)
        pre_hooks = getattr(self.model, "cache_pre_hooks", None)
        if isinstance(pre_hooks, list):
            self._pre = pre
            pre_hooks.append(pre)
        return press

    def __exit__(self, *exc: Any) -> None:
        hooks: List = self.model.cache_hooks
        if self._hook in hooks:
            hooks.remove(self._hook)
        pre_hooks = getattr(self.model, "cache_pre_hooks", None)
        if isinstance(pre_hooks, list) and self._pre in pre_hooks:
            pre_hooks.remove(self._pre)
        self.press._fwd = None
