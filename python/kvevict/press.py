"""A press in the kvpress style: compress every attention layer's KV cache after prefill.

``Press(method, budget)`` wraps one kvevict method (``kvevict.methods()``) with a budget. Used as
a context manager on a model, it compresses each layer's cache once, right after that layer's
attention has run on the prompt (one-shot eviction at the end of prefill, the papers' setting):
prefill still attends the full prompt, every later token attends the compressed cache::

    from kvevict.press import Press
    cache = KVCache(model.cfg, batch=1, capacity=prompt_len + new_tokens)
    with Press("snapkv", budget=0.2)(model):
        logits = model(prompt_ids, cache=cache)      # prefill: each layer compressed in turn
    logits = model(next_ids, cache=cache)            # decoding reads the compressed cache

The model protocol (tools/lkv/llama2c.py's ``Llama`` and ``KVCache`` implement it; any PyTorch
model can):

- ``model.cache_hooks``: a list of callables; during a forward with a cache, after layer l's
  attention, the model calls ``hook(l, num_layers, queries, cache, wo)`` with ``queries`` the new
  tokens' post-RoPE queries [batch, q_heads, T, head_dim] and ``wo`` the layer's output projection
  [hidden, q_heads * head_dim] ([out][in], nn.Linear's weight);
- the cache exposes, per layer l, ``keys[l]``/``values[l]`` [batch, kv_heads, capacity, head_dim]
  (HND, keys after RoPE), ``lengths[l]`` [batch, kv_heads] int32 (valid slots per head; heads may
  differ after head-wise eviction) and ``positions[l]`` [batch, kv_heads, capacity] int32.

The press compresses a layer only when the forward carries more than one new token (prefill);
single-token decoding steps pass through. It compresses once, after a one-shot prefill into an
empty cache: a forward of several tokens into a cache that already holds some (chunked prefill,
a second turn) raises ValueError instead of compounding the budget. Compaction is in place: the kept tokens move to the
front of each head, ``lengths`` drops to the kept counts, ``positions`` moves with the tokens.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch

from . import Error, Evictor, Selection, _budget, compact, wo_factors

__all__ = ["Press", "DEFAULT_WINDOWS"]

#: Observation window (queries read) per method, as in the papers and kvevict's fidelity report:
#: 32 prompt queries; H2O all of them (None); StreamingLLM and the query-free LKV rows none (0).
DEFAULT_WINDOWS: Dict[str, Optional[int]] = {
    "h2o": None, "streaming_llm": 0, "key_norm": 0, "lkv": 0, "lkv_uniform_budgets": 0,
}


class Press:
    """One kvevict method with a budget, applied to every layer of a model after prefill.

    ``method``: a name from ``kvevict.methods()``; ``budget``: an int (tokens per KV head) or a
    float keep fraction in (0, 1] of each head's length; ``window``: prompt queries the method
    reads (default ``DEFAULT_WINDOWS`` or 32; None: all of them); ``artifact``: an LKV artifact
    path (LKV methods); ``params``: overrides of ``kvevict.defaults(method)``
    (``temporal_alpha=0.5``). ``selections[l]`` keeps the last Selection of layer l.
    """

    def __init__(self, method: str, budget: Union[int, float], window: Optional[int] = -1,
                 artifact: Optional[str] = None, **params: Any) -> None:
        self.method = method
        _budget(budget)  # checked now, not at the first forward
        self.budget = budget
        self.window = DEFAULT_WINDOWS.get(method, 32) if window == -1 else window
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0):
            raise Error(f"kvevict.press: window = {window!r} must be an int >= 0 or None (all queries)")
        self.evictor = Evictor(method, artifact=artifact, **params)
        self.selections: Dict[int, Selection] = {}
        self._factors: Dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------
    def __call__(self, model: torch.nn.Module) -> "_Applied":
        if not hasattr(model, "cache_hooks"):
            raise TypeError(f"kvevict.press: {type(model).__name__} has no cache_hooks list (see the press protocol)")
        return _Applied(self, model)

    def _wo_args(self, layer: int, wo: torch.Tensor, q_heads: int) -> Dict[str, torch.Tensor]:
        p = self.evictor.params
        if p.get("scorer.use_wo", False):  # ReST-KV: the d x d factors of W_O, once per layer
            if layer not in self._factors:
                self._factors[layer] = wo_factors(wo.detach(), q_heads)
            return {"wo_factor": self._factors[layer]}
        if self.method in ("criticalkv", "critical_adakv"):
            return {"wo": wo.detach()}  # in the cache's dtype (compress_layer converts)
        return {}

    def compress_layer(self, layer: int, num_layers: int, queries: torch.Tensor, cache: Any,
                       wo: torch.Tensor) -> Optional[Selection]:
        """Select and compact layer ``layer`` of ``cache`` in place (the hook's work). Returns the
        Selection, or None when the forward carried a single token (decoding)."""
        if queries.shape[2] <= 1:
            return None
        k, v = cache.keys[layer], cache.values[layer]
        lengths, positions = cache.lengths[layer], cache.positions[layer]
        T = queries.shape[2]
        if int(lengths.max()) > T:
            # One-shot eviction at the end of a one-shot prefill: a cache that held tokens before this
            # forward (chunked prefill, a second turn) would be compressed again, compounding the budget.
            raise Error(f"kvevict.press: layer {layer}'s cache held {int(lengths.max()) - T} tokens before this "
                             f"{T}-token forward; the press compresses once, after a one-shot prefill of an empty cache "
                             "(chunked prefill and multi-turn eviction: the C++ engine's eviction_session)")
        q = None
        if self.window is None:
            q = queries
        elif self.window > 0:
            q = queries[:, :, -self.window:]
        q = None if q is None else q.to(k.dtype)
        extra = {key: t.to(k.dtype) if key == "wo" else t for key, t in self._wo_args(layer, wo, queries.shape[1]).items()}
        # positions go through select too, so that every shape is checked before the first compact
        sel = self.evictor.select(queries=q, keys=k, values=v, budget=self.budget, lengths=lengths, positions=positions,
                                  layer_idx=layer, num_layers=num_layers, **extra)
        compact(k, sel)
        compact(v, sel)
        compact(positions, sel)
        lengths.copy_(sel.counts())
        self.selections[layer] = sel
        return sel


class _Applied:
    """The context manager of ``Press(...)(model)``: installs the press's hook on entry, removes it
    on exit (also when the forward raised)."""

    def __init__(self, press: Press, model: torch.nn.Module) -> None:
        self.press, self.model = press, model
        self._hook = None

    def __enter__(self) -> Press:
        def hook(layer: int, num_layers: int, queries: torch.Tensor, cache: Any, wo: torch.Tensor) -> None:
            self.press.compress_layer(layer, num_layers, queries, cache, wo)

        self._hook = hook
        self.model.cache_hooks.append(hook)
        return self.press

    def __exit__(self, *exc: Any) -> None:
        hooks: List = self.model.cache_hooks
        if self._hook in hooks:
            hooks.remove(self._hook)
