"""kvevict for PyTorch: KV-cache eviction on torch tensors, without copies.

Every kvevict method (``methods()``) selects, for one attention layer, which cached tokens each
KV head keeps under a budget; ``compact`` then moves the kept tokens to the front of the cache.
The tensors are read in place through DLPack (strides honoured, NHD or HND, float32, float16 or
bfloat16); arithmetic is float32, as in the C++ library.

Shapes (``layout="HND"``, the Hugging Face order, is the default):

============  ==================================  ==================================
argument      layout="HND"                        layout="NHD"
============  ==================================  ==================================
queries       [batch, q_heads, window, head_dim]  [batch, window, q_heads, head_dim]
keys, values  [batch, kv_heads, seq, head_dim]    [batch, seq, kv_heads, head_dim]
============  ==================================  ==================================

``queries`` are the observation window's last queries with RoPE applied (H2O: every prompt
query); q_heads = G * kv_heads (GQA). ``lengths`` [batch, kv_heads] int32 gives each head's
valid tokens (padded batches, ragged heads), ``positions`` [batch, kv_heads, seq] int32 the
logical position of each slot. ``wo`` is the layer's output projection as nn.Linear stores it,
[hidden, q_heads * head_dim] (CriticalKV), and ``wo_factor`` the ReST-KV factors from
``wo_factors(wo, q_heads)``, [q_heads, head_dim, head_dim] float32.

A budget is an ``int`` (tokens per head, protected tokens included, the papers' "B") or a
``float`` in (0, 1] (keep fraction of each head's length). Head-wise methods (PyramidKV, AdaKV,
CriticalAdaKV, LKV) move budget between heads and keep the layer's total.

Example::

    import torch, kvevict
    k = torch.randn(1, 8, 4096, 128, dtype=torch.float16)       # [batch, kv_heads, seq, dim]
    v = torch.randn_like(k)
    q = torch.randn(1, 32, 32, 128, dtype=torch.float16)         # the last 32 queries, 32 heads
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=1024)
    kept = sel.padded()                                          # [1, 8, 1024] int32 slots
    lengths = kvevict.compact(k, sel); kvevict.compact(v, sel)   # in place; new lengths [1, 8]

Bad input raises ``kvevict.Error`` (a ValueError) with the library's message, which names the
argument and its value; nothing is written then. Papers and parameters: docs/python.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.utils.dlpack

from . import _C

__all__ = ["Error", "Evictor", "Selection", "compact", "defaults", "methods", "select", "wo_factors", "__version__"]

__version__: str = _C.version

#: The exception of every kvevict error (a ValueError): the library's message, naming the argument.
Error = _C.Error

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STAGES = ("scorer", "temporal", "spatial", "budgeter", "selector")


def methods() -> List[str]:
    """The method names ``select`` accepts: the C++ ``presets::`` names (restkv, snapkv, ...)."""
    return list(_C.methods())


def _param_name(key: str) -> str:
    """``temporal_alpha`` -> ``temporal.alpha`` (the library's dotted names); others unchanged."""
    if "." in key:
        return key
    for stage in _STAGES:
        if key.startswith(stage + "_"):
            return stage + "." + key[len(stage) + 1:]
    return key


def _params(params: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in params.items():
        name = _param_name(k)
        if name in out:
            raise Error(f"kvevict: parameter {name} is given twice (as {k} and as another spelling)")
        out[name] = v
    return out


def _int_arg(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise Error(f"kvevict: {name} must be an int, got {v!r}")
    if not lo <= v <= hi:
        raise Error(f"kvevict: {name} = {v} must be in [{lo}, {hi}]")
    return v


def _method_arg(method: Any) -> str:
    if not isinstance(method, str):
        raise Error(f"kvevict: method must be a str (one of kvevict.methods()), got {method!r}")
    return method


def defaults(method: str, artifact: Optional[str] = None) -> Dict[str, Any]:
    """The method's parameters as the papers publish them, by dotted name.

    Keys are ``"<stage>.<member>"`` (``"temporal.alpha"``, ``"spatial.kernel"``,
    ``"selector.num_sink"``) plus ``"gqa"`` and ``"check_finite"``; pass any of them to
    ``select``/``Evictor`` as keyword arguments with ``_`` for the dot (``temporal_alpha=0.3``).
    LKV methods need ``artifact`` (their tables are not listed).
    """
    return dict(_C.Evictor(_method_arg(method), {}, artifact or "").params())


@dataclass
class Selection:
    """The kept tokens of one layer, CSR over rows ``r = b * heads + h``.

    Row r keeps the slots ``indices[indptr[r]:indptr[r + 1]]`` (strictly ascending, int32);
    ``positions`` holds their logical positions. ``heads`` is kv_heads, or q_heads with
    ``gqa="per_query_head"``. ``scores`` (only when asked) is [batch, heads, seq] float32: the
    final reduced and smoothed scores, 0 for protected slots and pass-through heads.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    positions: torch.Tensor
    batch: int
    heads: int
    scores: Optional[torch.Tensor] = None

    def counts(self) -> torch.Tensor:
        """Kept tokens per row as [batch, heads] int32: the heads' lengths after ``compact``."""
        return (self.indptr[1:] - self.indptr[:-1]).view(self.batch, self.heads)

    @property
    def uniform(self) -> bool:
        """True when every row keeps the same number of tokens (uniform budgets)."""
        c = self.counts()
        return bool((c == c.flatten()[0]).all()) if c.numel() else True

    def padded(self, fill: int = -1) -> torch.Tensor:
        """The kept slots as [batch, heads, k], k the largest count; rows with fewer are padded
        with ``fill``. For uniform budgets this is a view of ``indices`` (no padding)."""
        c = self.counts().flatten()
        k = int(c.max()) if c.numel() else 0
        if self.uniform:
            return self.indices.view(self.batch, self.heads, k)
        out = torch.full((self.batch * self.heads, k), fill, dtype=torch.int32)
        col = torch.arange(k, dtype=torch.int64).unsqueeze(0)
        mask = col < c.to(torch.int64).unsqueeze(1)
        out[mask] = self.indices
        return out.view(self.batch, self.heads, k)


def _check_tensor(name: str, t: Any, dtypes: Tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise Error(f"kvevict: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda" and not _C.cuda:
        raise Error(f"kvevict: {name} is on device '{t.device}', but this kvevict module was built without the CUDA "
                    "backend (pass CPU tensors)")
    if t.device.type not in ("cpu", "cuda"):
        raise Error(f"kvevict: {name} is on device '{t.device}'; kvevict reads CPU or CUDA tensors")
    if t.layout != torch.strided:
        raise Error(f"kvevict: {name} has layout {t.layout}; kvevict reads strided (dense) tensors")
    if t.dtype not in dtypes:
        raise Error(f"kvevict: {name}.dtype = {t.dtype}; kvevict needs one of {', '.join(str(d) for d in dtypes)}")
    if t.dim() != ndim:
        raise Error(f"kvevict: {name} has {t.dim()} dimensions {tuple(t.shape)}; kvevict needs {ndim}")
    if t.is_conj() or t.is_neg():
        raise Error(f"kvevict: {name} is a lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first")
    return t.detach()


def _layout_view(name: str, t: torch.Tensor, layout: str) -> torch.Tensor:
    """[batch, heads, seq, dim] view of an NHD or HND tensor (no copy)."""
    return t.permute(0, 2, 1, 3) if layout == "NHD" else t


def _dl(t: Optional[torch.Tensor]):
    return None if t is None else torch.utils.dlpack.to_dlpack(t)


def _check_layout(layout: str) -> str:
    if layout not in ("NHD", "HND"):
        raise Error(f"kvevict: layout = {layout!r} is not 'NHD' or 'HND'")
    return layout


def _budget(budget: Union[int, float]) -> Tuple[int, float]:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise Error(f"kvevict: budget must be an int (tokens per head) or a float in (0, 1] (keep fraction), got {budget!r}")
    if isinstance(budget, int):
        if budget < 1 or budget > 2**31 - 1:
            raise Error(f"kvevict: budget = {budget} tokens must be in [1, 2^31 - 1]")
        return budget, 0.0
    if not (0.0 < budget <= 1.0):
        raise Error(f"kvevict: budget = {budget!r} as a keep fraction must be in (0, 1] (pass an int for tokens)")
    return 0, float(budget)


class Evictor:
    """One method with fixed parameters, reusable across calls.

    The plan (shapes, budget, lengths) and the workspace are cached: a call with the shapes,
    strides, budget and lengths of the previous call reuses both and allocates nothing but the
    returned selection (``stats()`` counts plans and workspace allocations). Not thread-safe:
    use one Evictor per thread (the CPU backend parallelises over heads inside a call).

    ``method``: one of ``methods()``; ``artifact``: an LKV artifact path (LKV methods only);
    ``params``: overrides of ``defaults(method)``, e.g. ``temporal_alpha=0.3, spatial_kernel=7,
    selector_num_sink=4, gqa="max"``. An unknown name or a bad value raises ``Error``.
    """

    def __init__(self, method: str, artifact: Optional[str] = None, **params: Any) -> None:
        if artifact is not None and not isinstance(artifact, (str, os.PathLike)):
            raise Error(f"kvevict: artifact must be a path, got {artifact!r}")
        self._impl = _C.Evictor(_method_arg(method), _params(params), "" if artifact is None else os.fspath(artifact))

    @property
    def method(self) -> str:
        return self._impl.method

    @property
    def params(self) -> Dict[str, Any]:
        """The parameters in force, by dotted name."""
        return dict(self._impl.params())

    def stats(self) -> Dict[str, Union[int, float]]:
        """Plan-cache counters: plans made, runs, workspace bytes held and allocations; and
        ``cpp_seconds``, the wall time spent inside the C++ call (the rest of a call's time is the
        binding's overhead: argument checks, DLPack export, result tensors)."""
        return dict(self._impl.stats())

    def select(self, *, keys: torch.Tensor, budget: Union[int, float], queries: Optional[torch.Tensor] = None,
               values: Optional[torch.Tensor] = None, layout: str = "HND", lengths: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, wo: Optional[torch.Tensor] = None,
               wo_factor: Optional[torch.Tensor] = None, layer_idx: int = 0, num_layers: int = 1,
               return_scores: bool = False, num_threads: int = 0) -> Selection:
        """Select one layer's kept tokens (see the module docstring for shapes).

        ``layer_idx``/``num_layers`` feed per-layer methods (PyramidKV's schedule, LKV's tables).
        ``num_threads`` = 0 uses OpenMP's default. Returns a ``Selection``.
        """
        _check_layout(layout)
        keep_tokens, keep_fraction = _budget(budget)
        layer_idx = _int_arg("layer_idx", layer_idx, 0, 2**31 - 1)
        num_layers = _int_arg("num_layers", num_layers, 1, 65536)
        num_threads = _int_arg("num_threads", num_threads, 0, 256)
        if not isinstance(return_scores, bool):
            raise Error(f"kvevict: return_scores must be a bool, got {return_scores!r}")
        k = _layout_view("keys", _check_tensor("keys", keys, _FLOAT_DTYPES, 4), layout)
        q = None if queries is None else _layout_view("queries", _check_tensor("queries", queries, _FLOAT_DTYPES, 4), layout)
        v = None if values is None else _layout_view("values", _check_tensor("values", values, _FLOAT_DTYPES, 4), layout)
        ln = None if lengths is None else _check_tensor("lengths", lengths, (torch.int32,), 2)
        pos = None if positions is None else _check_tensor("positions", positions, (torch.int32,), 3)
        w = None if wo is None else _check_tensor("wo", wo, _FLOAT_DTYPES, 2)
        wf = None if wo_factor is None else _check_tensor("wo_factor", wo_factor, (torch.float32,), 3)
        stream = torch.cuda.current_stream(k.device).cuda_stream if k.device.type == "cuda" else 0
        try:
            indptr, indices, pos_out, scores, batch, heads = self._impl.select(
                _dl(q), _dl(k), _dl(v), _dl(ln), _dl(pos), _dl(w), _dl(wf), keep_tokens, keep_fraction,
                int(layer_idx), int(num_layers), bool(return_scores), int(num_threads), stream)
        except Error as e:
            raise Error(_with_hint(str(e), self.method)) from None
        dev = k.device
        move = (lambda t: t.to(dev)) if dev.type != "cpu" else (lambda t: t)
        return Selection(indptr=move(torch.from_numpy(indptr)), indices=move(torch.from_numpy(indices)),
                         positions=move(torch.from_numpy(pos_out)), batch=int(batch), heads=int(heads),
                         scores=None if scores is None else move(torch.from_numpy(scores)))


# What to pass, in Python terms, when the library says an input is missing.
_HINTS = {
    "queries.data is null": "pass queries=, the last observation-window queries [batch, q_heads, window, head_dim] (HND)",
    "values.data is null": "pass values=, the cached values",
    "wo_factor.data is null": "pass wo_factor=kvevict.wo_factors(o_proj.weight, q_heads), or scorer_use_wo=False",
    "wo.data is null": "pass wo=, the layer's output projection o_proj.weight [hidden, q_heads * head_dim]",
}


def _with_hint(msg: str, method: str) -> str:
    for key, hint in _HINTS.items():
        if key in msg:
            return f"{msg}; {method}: {hint}"
    return msg


_cache: Dict[Tuple, Evictor] = {}


def _cached_evictor(method: str, artifact: Optional[str], params: Dict[str, Any]) -> Evictor:
    key = (method, artifact, tuple(sorted((k, repr(v)) for k, v in params.items())))
    ev = _cache.get(key)
    if ev is None:
        ev = Evictor(method, artifact=artifact, **params)
        if len(_cache) >= 64:
            _cache.pop(next(iter(_cache)))
        _cache[key] = ev
    return ev


def select(method: str, *, keys: torch.Tensor, budget: Union[int, float], queries: Optional[torch.Tensor] = None,
           values: Optional[torch.Tensor] = None, layout: str = "HND", lengths: Optional[torch.Tensor] = None,
           positions: Optional[torch.Tensor] = None, wo: Optional[torch.Tensor] = None,
           wo_factor: Optional[torch.Tensor] = None, layer_idx: int = 0, num_layers: int = 1,
           return_scores: bool = False, artifact: Optional[str] = None, num_threads: int = 0,
           **params: Any) -> Selection:
    """Select the tokens one layer keeps with ``method`` (``methods()``) and the papers' defaults
    overridden by ``params`` (``defaults(method)``; ``temporal_alpha=0.3`` sets "temporal.alpha").

    The evictor of (method, artifact, params) is cached, with its plan and workspace, so a loop
    over layers or steps plans once per shape. See ``Evictor.select`` for the arguments.
    """
    ev = _cached_evictor(method, artifact, params)
    return ev.select(keys=keys, budget=budget, queries=queries, values=values, layout=layout, lengths=lengths,
                     positions=positions, wo=wo, wo_factor=wo_factor, layer_idx=layer_idx, num_layers=num_layers,
                     return_scores=return_scores, num_threads=num_threads)


def compact(cache: torch.Tensor, selection: Selection, layout: str = "HND") -> torch.Tensor:
    """Compact a K or V cache in place: slot i of row r takes the row's i-th kept slot.

    ``cache`` is [batch, heads, seq, dim] (HND) or [batch, seq, heads, dim] (NHD), float32,
    float16 or bfloat16, the tensor the selection was made for, or a positions tensor
    [batch, heads, seq] int32 that moves with it (heads = the selection's heads:
    a per-query-head selection cannot be compacted into a kv_heads cache). Slots past a row's
    count keep their old contents. Returns the new lengths, [batch, heads] int32. On error the
    cache is untouched.
    """
    _check_layout(layout)
    if not isinstance(selection, Selection):
        raise Error(f"kvevict: selection must be a kvevict.Selection, got {type(selection).__name__}")
    for f in ("indptr", "indices"):
        if not isinstance(getattr(selection, f), torch.Tensor) or getattr(selection, f).dim() != 1:
            raise Error(f"kvevict: selection.{f} must be a 1-D torch.Tensor (int32)")
    if isinstance(cache, torch.Tensor) and cache.requires_grad:
        raise Error("kvevict: cache requires grad; compact() writes in place (pass cache.detach() or use torch.no_grad data)")
    if isinstance(cache, torch.Tensor) and cache.dtype == torch.int32 and cache.dim() == 3:
        c = _check_tensor("cache", cache, (torch.int32,), 3).unsqueeze(-1)  # positions [batch, heads, seq]
    else:
        c = _layout_view("cache", _check_tensor("cache", cache, _FLOAT_DTYPES, 4), layout)
    if c.shape[0] != selection.batch or c.shape[1] != selection.heads:
        raise Error(f"kvevict: cache has (batch, heads) = ({c.shape[0]}, {c.shape[1]}), the selection "
                    f"({selection.batch}, {selection.heads})")
    indptr = selection.indptr.contiguous()
    indices = selection.indices.contiguous()
    if indptr.dtype != torch.int32 or indices.dtype != torch.int32:
        raise Error("kvevict: selection.indptr and selection.indices must be int32")
    if c.device.type == "cuda":
        _compact_torch(c, indptr.cpu(), indices.cpu())
    else:
        _C.compact(_dl(c), _dl(indptr.cpu()), _dl(indices.cpu()))
    return selection.counts().clone()


def _compact_torch(c: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor) -> None:
    """compact() for CUDA caches, with torch gathers on the cache's device (the CUDA backend's
    compaction does not work in place). The selection is checked first: nothing is written on
    error."""
    B, H, S = c.shape[0], c.shape[1], c.shape[2]
    if indptr.numel() != B * H + 1 or int(indptr[0]) != 0 or int(indptr[-1]) > indices.numel():
        raise Error(f"kvevict: selection.indptr does not describe {B * H} rows over {indices.numel()} indices")
    ip = indptr.tolist()
    rows = []
    for r in range(B * H):
        if ip[r + 1] < ip[r]:
            raise Error(f"kvevict: selection.indptr decreases at row {r}")
        idx = indices[ip[r]:ip[r + 1]]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= S or bool((idx[1:] <= idx[:-1]).any())):
            raise Error(f"kvevict: compact: selection row {r} is outside [0, {S}) or not ascending")
        rows.append(idx.to(device=c.device, dtype=torch.int64))
    for r, idx in enumerate(rows):
        b, h = divmod(r, H)
        c[b, h, :idx.numel()] = c[b, h].index_select(0, idx)


def wo_factors(wo: torch.Tensor, q_heads: int) -> torch.Tensor:
    """ReST-KV's W_O factors of one layer: [q_heads, head_dim, head_dim] float32 R_h with
    ||x W_O^h|| = ||R_h x|| (Householder QR of W_O^h^T in float64), for ``wo_factor=``.

    ``wo``: the layer's output projection as nn.Linear stores it, [hidden, q_heads * head_dim]
    (``o_proj.weight``). Compute once per model load.
    """
    w = _check_tensor("wo", wo, _FLOAT_DTYPES, 2)
    if not isinstance(q_heads, int) or isinstance(q_heads, bool) or q_heads < 1 or w.shape[1] % q_heads != 0:
        raise Error(f"kvevict: q_heads = {q_heads!r} must be a positive divisor of wo.shape[1] = {w.shape[1]}")
    d = w.shape[1] // q_heads
    out = torch.empty((q_heads, d, d), dtype=torch.float32)
    _C.wo_factors(_dl(w.cpu()), q_heads, d, _dl(out))  # fp64 QR on the host, once per model
    return out.to(w.device)
