"""kvevict for PyTorch: KV-cache eviction on torch tensors, without copies.

Every kvevict method (``methods()``) selects, for one attention layer, which cached tokens each
KV head keeps under a budget; ``compact`` then moves the kept tokens to the front of the cache.
The tensors are read in place through DLPack (strides honoured, NHD or HND, float32, float16 or
bfloat16); arithmetic is float32, as in the C++ library.

Shapes (``layout="HND"`` is the Hugging Face order; ``layout=`` may be left out only where the
shapes of queries / lengths / positions tell the two layouts apart, else ``kvevict.Error`` asks
for it):

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
``float`` in (0, 1] (keep fraction of each head's length); or, instead, ``compression_ratio``
(kvpress's: the fraction removed). Head-wise methods (PyramidKV, AdaKV, CriticalAdaKV, LKV) move
budget between heads and keep the layer's total. ``DecodeSchedule`` evicts while generating.

Example::

    import torch, kvevict
    k = torch.randn(1, 8, 4096, 128, dtype=torch.float16)       # [batch, kv_heads, seq, dim]
    v = torch.randn_like(k)
    q = torch.randn(1, 32, 32, 128, dtype=torch.float16)         # the last 32 queries, 32 heads
    sel = kvevict.select("snapkv", queries=q, keys=k, values=v, budget=1024)
    kept = sel.padded()                                          # [1, 8, 1024] int64 slots
    lengths = kvevict.compact(k, sel); kvevict.compact(v, sel)   # in place; new lengths [1, 8]

Bad input raises ``kvevict.Error`` (a ValueError) with the library's message, which names the
argument and its value; nothing is written then. A call Python cannot bind (a missing or unknown
keyword) raises ``kvevict.ArgumentError``, a subclass of both ``kvevict.Error`` and TypeError.
Papers and parameters: docs/python.md.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, Union

import numpy as np
import torch
import torch.utils.dlpack

from . import _C

__all__ = ["ArgumentError", "DecodeAction", "DecodeSchedule", "Error", "Evictor", "Selection", "build_info", "compact", "defaults", "methods",
           "select", "wo_factors", "__version__"]

__version__: str = _C.version

#: The exception of every kvevict error (a ValueError): the library's message, naming the argument.
Error = _C.Error


class ArgumentError(Error, TypeError):
    """A call kvevict cannot bind: a required argument missing, an unknown keyword, too many
    positional arguments. A ``kvevict.Error`` (so one ``except kvevict.Error`` catches every
    kvevict failure) and a ``TypeError`` (what Python raises for the same mistake elsewhere)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _api(fn: _F) -> _F:
    """Binds a public function's arguments first: a call Python would refuse with TypeError raises
    ``ArgumentError`` naming the argument (and the function) instead."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Binding is checked only when the call raises TypeError (Signature.bind costs about as much
        # as a small select() call): a call that cannot bind raises before the body runs, so
        # nothing of fn ran then; a TypeError from inside the body is passed on as it is.
        try:
            return fn(*args, **kwargs)
        except TypeError:
            try:
                sig.bind(*args, **kwargs)
            except TypeError as e:
                raise ArgumentError(f"kvevict: {fn.__qualname__.replace('.__init__', '')}: {e}") from None
            raise

    return wrapper  # type: ignore[return-value]


def _as_int(v: Any) -> Optional[int]:
    """v as a Python int when it is an integer scalar (int, numpy integer, 0-d integer tensor), else None.
    bool is not an integer here."""
    if type(v) is int:  # the common case, without the ABC checks below
        return v
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return int(v)
    return None


def _as_float(v: Any) -> Optional[float]:
    """v as a Python float when it is a real, non-integer scalar (float, numpy floating, 0-d float tensor)."""
    if type(v) is float:
        return v
    if isinstance(v, numbers.Real) and not isinstance(v, (numbers.Integral, np.bool_)):
        return float(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
        return float(v)
    return None

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STAGES = ("scorer", "temporal", "spatial", "budgeter", "selector")


def build_info() -> Dict[str, Any]:
    """How the compiled core was built: ``cpu_gemm`` ("blis": the CPU scorers' products on BLIS,
    KVEVICT_BLAS; "eigen": Eigen's GEMM), ``cpu_isa`` (the widest vector ISA the CPU code was
    compiled for: "avx512", "avx2+fma", "avx2", "avx", "sse2"; KVEVICT_NATIVE), ``cuda`` (the CUDA backend is
    compiled in). docs/python.md, "Install"."""
    return {"cpu_gemm": _C.cpu_gemm, "cpu_isa": _C.cpu_isa, "cuda": bool(_C.cuda), "version": _C.version}


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
        if not isinstance(v, (bool, str)):  # numpy / torch scalars as Python numbers
            i = _as_int(v)
            f = _as_float(v) if i is None else None
            v = i if i is not None else (f if f is not None else v)
            if isinstance(v, np.bool_):
                v = bool(v)
        out[name] = v
    return out


def _int_arg(name: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is int and lo <= v <= hi:  # the common case, without _as_int's checks
        return v
    i = _as_int(v)
    if i is None:
        raise Error(f"kvevict: {name} must be an int, got {v!r}")
    v = i
    if not lo <= v <= hi:
        raise Error(f"kvevict: {name} = {v} must be in [{lo}, {hi}]")
    return v


def _method_arg(method: Any) -> str:
    if not isinstance(method, str):
        raise Error(f"kvevict: method must be a str (one of kvevict.methods()), got {method!r}")
    return method


@_api
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
        """The kept slots as [batch, heads, k] **int64** (what ``torch.gather`` and indexing take),
        k the largest count; rows with fewer are padded with ``fill``. A new tensor, on the
        selection's device."""
        fill = _int_arg("fill", fill, -(2**63), 2**63 - 1)
        c = self.counts().flatten()
        k = int(c.max()) if c.numel() else 0
        if not c.numel() or bool((c == k).all()):  # uniform: no padding
            return self.indices.to(torch.int64).view(self.batch, self.heads, k)
        out = torch.full((self.batch * self.heads, k), fill, dtype=torch.int64, device=self.indices.device)
        col = torch.arange(k, dtype=torch.int64, device=self.indices.device).unsqueeze(0)
        mask = col < c.to(torch.int64).unsqueeze(1)
        out[mask] = self.indices.to(torch.int64)
        return out.view(self.batch, self.heads, k)


def _check_tensor(name: str, t: Any, dtypes: Tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise Error(f"kvevict: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:  # (is_cpu and is_cuda are flags; t.device builds an object)
        if not t.is_cuda:
            raise Error(f"kvevict: {name} is on device '{t.device}'; kvevict reads CPU or CUDA tensors")
        if not _C.cuda:
            raise Error(f"kvevict: {name} is on device '{t.device}', but this kvevict module was built without the CUDA "
                        "backend (pass CPU tensors)")
    if t.layout is not _STRIDED:
        raise Error(f"kvevict: {name} has layout {t.layout}; kvevict reads strided (dense) tensors")
    if t.dtype not in dtypes:
        raise Error(f"kvevict: {name}.dtype = {t.dtype}; kvevict needs one of {', '.join(str(d) for d in dtypes)}")
    if t.dim() != ndim:
        raise Error(f"kvevict: {name} has {t.dim()} dimensions {tuple(t.shape)}; kvevict needs {ndim}")
    if t.is_neg() or t.is_conj():
        raise Error(f"kvevict: {name} is a lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first")
    return t.detach() if t.requires_grad else t  # (DLPack refuses tensors that require grad)


_STRIDED = torch.strided


def _layout_view(name: str, t: torch.Tensor, layout: str) -> torch.Tensor:
    """[batch, heads, seq, dim] view of an NHD or HND tensor (no copy)."""
    return t.permute(0, 2, 1, 3) if layout == "NHD" else t


_to_dlpack = torch.utils.dlpack.to_dlpack


def _dl(t: Optional[torch.Tensor]):
    return None if t is None else _to_dlpack(t)


def _check_layout(layout: Optional[str]) -> Optional[str]:
    if layout is not None and layout not in ("NHD", "HND"):
        raise Error(f"kvevict: layout = {layout!r} is not 'NHD' or 'HND'")
    return layout


def _infer_layout(keys: torch.Tensor, queries: Optional[torch.Tensor], lengths: Optional[torch.Tensor],
                  positions: Optional[torch.Tensor]) -> str:
    """The layout of 4-D keys when ``layout=`` is not given: the one layout under which the other
    arguments' shapes fit (queries' heads a multiple of the keys' heads with the same batch and
    head_dim, lengths [batch, kv_heads], positions [batch, kv_heads, seq]). Ambiguous (both fit, or
    nothing to tell them apart): an Error asking for ``layout=``."""
    if queries is None and lengths is None and positions is None:
        raise Error(f"kvevict: layout is not given and keys {tuple(keys.shape)} alone do not tell [batch, kv_heads, seq, head_dim] "
                    "(layout='HND') from [batch, seq, kv_heads, head_dim] (layout='NHD'): pass layout=")
    fits = []
    for lay, h_ax, s_ax in (("HND", 1, 2), ("NHD", 2, 1)):
        hk, seq = keys.shape[h_ax], keys.shape[s_ax]
        ok = True
        if queries is not None:
            qh = queries.shape[h_ax] if queries.dim() == 4 else -1
            ok = ok and queries.dim() == 4 and queries.shape[0] == keys.shape[0] and queries.shape[3] == keys.shape[3] \
                and hk > 0 and qh > 0 and qh % hk == 0
        if lengths is not None:
            ok = ok and lengths.dim() == 2 and tuple(lengths.shape) == (keys.shape[0], hk)
        if positions is not None:
            ok = ok and positions.dim() == 3 and tuple(positions.shape) == (keys.shape[0], hk, seq)
        if ok:
            fits.append(lay)
    if len(fits) == 1:
        return fits[0]
    if not fits:  # wrong under either layout: the library's own check names what is wrong
        return "HND"
    q = "" if queries is None else f", queries {tuple(queries.shape)}"
    why = "fit both layouts"
    raise Error(f"kvevict: layout is not given and keys {tuple(keys.shape)}{q} {why}: pass layout='HND' "
                "([batch, heads, seq, head_dim]) or layout='NHD' ([batch, seq, heads, head_dim])")


def _budget(budget: Any, compression_ratio: Any = None, name: str = "budget") -> Tuple[int, float]:
    """(keep_tokens, keep_fraction) of exactly one of ``budget`` (int tokens per head or float keep
    fraction in (0, 1]) and ``compression_ratio`` (kvpress's: the fraction removed, in [0, 1))."""
    if compression_ratio is not None:
        if budget is not None:
            raise Error(f"kvevict: pass one of {name} and compression_ratio, not both ({name} = {budget!r}, "
                        f"compression_ratio = {compression_ratio!r})")
        cr = _as_float(compression_ratio)
        if cr is None and _as_int(compression_ratio) == 0:
            cr = 0.0
        if cr is None or not (0.0 <= cr < 1.0):
            raise Error(f"kvevict: compression_ratio = {compression_ratio!r} must be a float in [0, 1) (the fraction of each "
                        "head's tokens removed, as in kvpress)")
        return 0, 1.0 - cr
    if type(budget) is int and 1 <= budget <= 2**31 - 1:  # the common case, without the checks below
        return budget, 0.0
    if budget is None:
        raise ArgumentError(f"kvevict: {name} is required (an int: tokens per head; a float in (0, 1]: keep fraction), "
                            "or compression_ratio= (the fraction removed)")
    i = _as_int(budget)
    if i is not None:
        if i < 1 or i > 2**31 - 1:
            raise Error(f"kvevict: {name} = {i} tokens must be in [1, 2^31 - 1]")
        return i, 0.0
    f = _as_float(budget)
    if f is None:
        raise Error(f"kvevict: {name} must be an int (tokens per head) or a float in (0, 1] (keep fraction), got {budget!r}")
    if not (0.0 < f <= 1.0):
        raise Error(f"kvevict: {name} = {budget!r} as a keep fraction must be in (0, 1] (pass an int for tokens)")
    return 0, f


class Evictor:
    """One method with fixed parameters, reusable across calls.

    The plan (shapes, budget, lengths) and the workspace are cached: a call with the shapes,
    strides, budget and lengths of the previous call reuses both and allocates nothing but the
    returned selection (``stats()`` counts plans and workspace allocations). Threads: calls on one
    Evictor from several threads are serialised (a lock per object; the GIL is released during the
    C++ call), so sharing one is safe but not parallel: for parallel calls use one Evictor per
    thread. Inside a call the CPU backend uses ``num_threads`` threads over heads.

    ``method``: one of ``methods()``; ``artifact``: an LKV artifact path (LKV methods only);
    ``params``: overrides of ``defaults(method)``, e.g. ``temporal_alpha=0.3, spatial_kernel=7,
    selector_num_sink=4, gqa="max"``. An unknown name or a bad value raises ``Error``.
    """

    @_api
    def __init__(self, method: str, artifact: Optional[str] = None, **params: Any) -> None:
        if artifact is not None and not isinstance(artifact, (str, os.PathLike)):
            raise Error(f"kvevict: artifact must be a path, got {artifact!r}")
        self._artifact = None if artifact is None else os.fspath(artifact)
        self._impl = _C.Evictor(_method_arg(method), _params(params), "" if artifact is None else os.fspath(artifact))

    @property
    def artifact(self) -> Optional[str]:
        """The LKV artifact path the evictor was made with (None for the other methods)."""
        return self._artifact

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

    @_api
    def select(self, *, keys: torch.Tensor, budget: Union[int, float, None] = None, queries: Optional[torch.Tensor] = None,
               values: Optional[torch.Tensor] = None, layout: Optional[str] = None, lengths: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, wo: Optional[torch.Tensor] = None,
               wo_factor: Optional[torch.Tensor] = None, layer_idx: int = 0, num_layers: int = 1,
               return_scores: bool = False, num_threads: int = 0, compression_ratio: Optional[float] = None) -> Selection:
        """Select one layer's kept tokens (see the module docstring for shapes).

        Budget: exactly one of ``budget`` (int: tokens per head; float in (0, 1]: keep fraction)
        and ``compression_ratio`` (kvpress's: the fraction of each head's tokens removed, in
        [0, 1); keeps floor(length * (1 - compression_ratio)) tokens, raised to the protected
        ones). ``layout``: "HND" or "NHD"; when not given it is inferred only where the shapes of
        queries / lengths / positions leave no doubt, else an Error asks for it.
        ``layer_idx``/``num_layers`` feed per-layer methods (PyramidKV's schedule, LKV's tables).
        ``num_threads`` = 0 uses OpenMP's default. Integer and float arguments may be Python,
        numpy or 0-d torch scalars. Returns a ``Selection``.
        """
        _check_layout(layout)
        keep_tokens, keep_fraction = _budget(budget, compression_ratio)
        layer_idx = _int_arg("layer_idx", layer_idx, 0, 2**31 - 1)
        num_layers = _int_arg("num_layers", num_layers, 1, 65536)
        num_threads = _int_arg("num_threads", num_threads, 0, 256)
        if not isinstance(return_scores, bool):
            raise Error(f"kvevict: return_scores must be a bool, got {return_scores!r}")
        k = _check_tensor("keys", keys, _FLOAT_DTYPES, 4)
        q = None if queries is None else _check_tensor("queries", queries, _FLOAT_DTYPES, 4)
        ln = None if lengths is None else _check_tensor("lengths", lengths, (torch.int32,), 2)
        pos = None if positions is None else _check_tensor("positions", positions, (torch.int32,), 3)
        if layout is None:
            layout = _infer_layout(k, q, ln, pos)
        k = _layout_view("keys", k, layout)
        q = None if q is None else _layout_view("queries", q, layout)
        v = None if values is None else _layout_view("values", _check_tensor("values", values, _FLOAT_DTYPES, 4), layout)
        w = None if wo is None else _check_tensor("wo", wo, _FLOAT_DTYPES, 2)
        wf = None if wo_factor is None else _check_tensor("wo_factor", wo_factor, (torch.float32,), 3)
        on_cuda = k.is_cuda
        stream = torch.cuda.current_stream(k.device).cuda_stream if on_cuda else 0
        try:
            dl = _to_dlpack
            indptr, indices, pos_out, scores, batch, heads = self._impl.select(
                None if q is None else dl(q), dl(k), None if v is None else dl(v), None if ln is None else dl(ln),
                None if pos is None else dl(pos), None if w is None else dl(w), None if wf is None else dl(wf),
                keep_tokens, keep_fraction, layer_idx, num_layers, return_scores, num_threads, stream)
        except Error as e:
            raise Error(_with_hint(str(e), self.method)) from None
        indptr, indices, pos_out = torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(pos_out)
        scores = None if scores is None else torch.from_numpy(scores)
        if on_cuda:
            dev = k.device
            indptr, indices, pos_out = indptr.to(dev), indices.to(dev), pos_out.to(dev)
            scores = None if scores is None else scores.to(dev)
        return Selection(indptr=indptr, indices=indices, positions=pos_out, batch=batch, heads=heads, scores=scores)


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


@_api
def select(method: str, *, keys: torch.Tensor, budget: Union[int, float, None] = None, queries: Optional[torch.Tensor] = None,
           values: Optional[torch.Tensor] = None, layout: Optional[str] = None, lengths: Optional[torch.Tensor] = None,
           positions: Optional[torch.Tensor] = None, wo: Optional[torch.Tensor] = None,
           wo_factor: Optional[torch.Tensor] = None, layer_idx: int = 0, num_layers: int = 1,
           return_scores: bool = False, artifact: Optional[str] = None, num_threads: int = 0,
           compression_ratio: Optional[float] = None, **params: Any) -> Selection:
    """Select the tokens one layer keeps with ``method`` (``methods()``) and the papers' defaults
    overridden by ``params`` (``defaults(method)``; ``temporal_alpha=0.3`` sets "temporal.alpha").

    The evictor of (method, artifact, params) is cached, with its plan and workspace, so a loop
    over layers or steps plans once per shape. See ``Evictor.select`` for the arguments.
    """
    ev = _cached_evictor(method, artifact, params)
    return ev.select(keys=keys, budget=budget, queries=queries, values=values, layout=layout, lengths=lengths,
                     positions=positions, wo=wo, wo_factor=wo_factor, layer_idx=layer_idx, num_layers=num_layers,
                     return_scores=return_scores, num_threads=num_threads, compression_ratio=compression_ratio)


@_api
def compact(cache: torch.Tensor, selection: Selection, layout: Optional[str] = None) -> torch.Tensor:
    """Compact a K or V cache in place: slot i of row r takes the row's i-th kept slot.

    ``cache`` is [batch, heads, seq, dim] (HND) or [batch, seq, heads, dim] (NHD), float32,
    float16 or bfloat16, the tensor the selection was made for (``layout`` may be left out only
    where the selection's heads fit one axis and not the other), or a positions tensor
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
        c = _check_tensor("cache", cache, _FLOAT_DTYPES, 4)
        if layout is None:
            fits = [lay for lay, ax in (("HND", 1), ("NHD", 2)) if c.shape[0] == selection.batch and c.shape[ax] == selection.heads]
            if len(fits) != 1:
                raise Error(f"kvevict: layout is not given and cache {tuple(c.shape)} has {selection.heads} heads on "
                            f"{'both axes 1 and 2' if fits else 'neither axis 1 nor 2'}: pass layout='HND' or 'NHD'")
            layout = fits[0]
        c = _layout_view("cache", c, layout)
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


@_api
def wo_factors(wo: torch.Tensor, q_heads: int) -> torch.Tensor:
    """ReST-KV's W_O factors of one layer: [q_heads, head_dim, head_dim] float32 R_h with
    ||x W_O^h|| = ||R_h x|| (Householder QR of W_O^h^T in float64), for ``wo_factor=``.

    ``wo``: the layer's output projection as nn.Linear stores it, [hidden, q_heads * head_dim]
    (``o_proj.weight``). Compute once per model load.
    """
    w = _check_tensor("wo", wo, _FLOAT_DTYPES, 2)
    q_heads = q_heads if _as_int(q_heads) is None else _as_int(q_heads)
    if not isinstance(q_heads, int) or isinstance(q_heads, bool) or q_heads < 1 or w.shape[1] % q_heads != 0:
        raise Error(f"kvevict: q_heads = {q_heads!r} must be a positive divisor of wo.shape[1] = {w.shape[1]}")
    d = w.shape[1] // q_heads
    out = torch.empty((q_heads, d, d), dtype=torch.float32)
    _C.wo_factors(_dl(w.cpu()), q_heads, d, _dl(out))  # fp64 QR on the host, once per model
    return out.to(w.device)


# --- decode-time eviction ---------------------------------------------------------------------
DecodeAction = _C.DecodeAction
DecodeAction.__doc__ = """What a ``DecodeSchedule`` asks after a prefill or a decode step (kvevict::decode_action).

``evict`` (run an eviction of every layer now, then call ``schedule.evicted(action)``),
``periods`` (decode intervals served by it), ``tokens_seen`` (t: prompt + generated tokens so
far), ``generated``, ``keep_tokens`` (the per-head budget resolved at t), ``request``. Pass it back
unchanged to ``DecodeSchedule.apply`` and ``evicted``."""


class DecodeSchedule:
    """Decode-time eviction: a cap on the KV cache while a model generates, re-evicted every
    ``interval`` generated tokens (the "beta" of decode-time compression; kvpress's DecodingPress
    ``compression_interval``). The C++ ``kvevict::decode_schedule`` (kvevict/schedule/decode.hpp),
    one per request: it decides when an eviction is due and with which budget; the engine runs any
    method with that budget (``apply``) and compacts its cache.

    ``budget``: an int is the cap, tokens per KV head (every eviction brings each head to it;
    head-wise methods share heads x cap); a float in (0, 1] a fraction of the tokens seen at each
    eviction (``compression_ratio``, kvpress's fraction removed, is 1 - that fraction); exactly one
    of the two. ``protect_prefix``: the first tokens of the request never evicted (a system prompt);
    ``protect_recent``: the most recent tokens never evicted. ``evict_after_prefill``: evict right
    after each prompt too (else the prompt stays whole until the first due decode-time eviction).

    Use::

        sched = kvevict.DecodeSchedule(interval=16, budget=128)
        a = sched.after_prefill(prompt_len)               # after the prompt is in the cache
        if a.evict:
            ev, budget = sched.apply(a, evictor, window)  # for every layer: select with ev, budget; compact
            sched.evicted(a)
        a = sched.after_decode(1)                         # after each generated token is appended; the same

    ``kvevict.press.Press(..., interval=...)`` drives one for a model. Errors (``kvevict.Error``,
    naming the field): interval < 1, a budget outside its range, protected tokens above the cap,
    actions of another request or out of order; the schedule is unchanged on error.
    """

    @_api
    def __init__(self, *, interval: int = 1, budget: Union[int, float, None] = None, compression_ratio: Optional[float] = None,
                 protect_prefix: int = 0, protect_recent: int = 0, evict_after_prefill: bool = True) -> None:
        keep_tokens, keep_fraction = _budget(budget, compression_ratio)
        if not isinstance(evict_after_prefill, bool):
            raise Error(f"kvevict: evict_after_prefill must be a bool, got {evict_after_prefill!r}")
        self._s = _C.DecodeSchedule(_int_arg("interval", interval, -(2**31), 2**31 - 1), keep_tokens, keep_fraction,
                                    _int_arg("protect_prefix", protect_prefix, -(2**31), 2**31 - 1),
                                    _int_arg("protect_recent", protect_recent, -(2**31), 2**31 - 1), evict_after_prefill)

    def after_prefill(self, tokens: int) -> "DecodeAction":
        """The engine appended ``tokens`` prompt tokens (a prompt, a chunk, the next turn)."""
        return self._s.after_prefill(_int_arg("tokens", tokens, -(2**63), 2**63 - 1))

    def after_decode(self, tokens: int = 1) -> "DecodeAction":
        """The engine appended ``tokens`` generated tokens (1 per decode step)."""
        return self._s.after_decode(_int_arg("tokens", tokens, -(2**63), 2**63 - 1))

    def apply(self, action: "DecodeAction", evictor: Evictor, window: int) -> Tuple[Evictor, Union[int, float]]:
        """The evictor and budget of eviction ``action`` for ``evictor``'s method: the schedule's
        protection applied to its parameters (sinks = the protected prefix, recent tokens), the cap
        as the budget (int tokens; LKV-H a float fraction of the tokens seen whose total is exactly
        layers x heads x cap), PyramidKV's and LKV-H's reference length set to the tokens seen.
        ``window``: the query rows passed to ``select`` (0 for query-free methods). Returns
        ``(evictor, budget)`` for ``evictor.select(..., budget=budget)``; evictors are cached per
        parameter set. ``evictor`` itself is unchanged."""
        if not isinstance(evictor, Evictor):
            raise Error(f"kvevict: evictor must be a kvevict.Evictor, got {type(evictor).__name__}")
        if not isinstance(action, _C.DecodeAction):
            raise Error(f"kvevict: action must be a kvevict.DecodeAction (from after_prefill / after_decode), got {type(action).__name__}")
        params, keep_tokens, keep_fraction = evictor._impl.schedule_params(self._s, action, _int_arg("window", window, -(2**63), 2**63 - 1))
        if params == evictor.params:
            ev = evictor
        else:
            ev = _cached_evictor(evictor.method, evictor.artifact, params)
        return ev, (keep_tokens if keep_tokens > 0 else keep_fraction)

    def evicted(self, action: "DecodeAction") -> None:
        """The engine ran eviction ``action`` (every layer)."""
        if not isinstance(action, _C.DecodeAction):
            raise Error(f"kvevict: action must be a kvevict.DecodeAction, got {type(action).__name__}")
        self._s.evicted(action)

    def reset(self) -> None:
        """Back to the start of a request (the options stay)."""
        self._s.reset()

    def copy(self) -> "DecodeSchedule":
        """An independent copy (same options and state)."""
        c = DecodeSchedule.__new__(DecodeSchedule)
        c._s = self._s.copy()
        return c

    def budget_at(self, tokens_seen: int) -> int:
        """The per-head budget at ``tokens_seen`` tokens: the cap, or max(1, floor(fraction * t))."""
        return self._s.budget_at(_int_arg("tokens_seen", tokens_seen, 0, 2**63 - 1))

    tokens_seen = property(lambda self: self._s.tokens_seen, doc="t: prompt + generated tokens so far")
    pending_tokens = property(lambda self: self._s.pending_tokens, doc="generated tokens since the last eviction")
    protected_prefix = property(lambda self: self._s.protected_prefix, doc="this request's protected prefix")
    evictions = property(lambda self: self._s.evictions, doc="evictions reported since the start")
    interval = property(lambda self: self._s.interval)
    keep_tokens = property(lambda self: self._s.keep_tokens, doc="the cap (0 with a fraction budget)")
    keep_fraction = property(lambda self: self._s.keep_fraction, doc="the fraction (0 with a cap)")
    protect_prefix = property(lambda self: self._s.protect_prefix)
    protect_recent = property(lambda self: self._s.protect_recent)
