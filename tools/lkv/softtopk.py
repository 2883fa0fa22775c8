# SPDX-License-Identifier: Apache-2.0
"""Soft top-k with a fractional budget and implicit-function gradients (../shared/spec/lkv.md).

For scores u (..., n) and budgets beta (...), 0 < beta <= n:

    m_i = sigmoid((u_i + theta) / tau),   theta chosen so that sum_i m_i = beta.

sum_i m_i is strictly increasing in theta, so theta is found by bisection, vectorised over all
leading dimensions (every (layer, KV head, batch) row at once). The bisection runs in fp64
whatever the input dtype; m is returned in the input dtype.

Backward uses the implicit derivative of theta (s_i = m_i (1 - m_i), S = sum_i s_i):

    d theta / d u_j  = -s_j / S,        d theta / d beta = tau / S,
    d m_i / d u_j    = s_i / tau * (delta_ij - s_j / S),
    d m_i / d beta   = s_i / S,

so for an upstream gradient g:  grad_u = s / tau * (g - <g, s> / S),  grad_beta = <g, s> / S.
No gradient flows to tau (a schedule, not a parameter). When S underflows to 0 (every m_i
saturated, e.g. beta = n) the gradients are 0.

As tau -> 0 with integer beta = k and distinct u, m tends to the hard top-k indicator.
"""

from __future__ import annotations

import math
from typing import Tuple, Union

import torch

__all__ = ["soft_topk", "soft_topk_with_theta", "SoftTopK", "solve_theta"]

_S_FLOOR = 1e-300


def _as_tau(tau, ref: torch.Tensor) -> torch.Tensor:
    """tau as an fp64 tensor broadcastable to ref[..., :1] (scalar or shape (...))."""
    t = torch.as_tensor(tau, dtype=torch.float64, device=ref.device)
    if t.dim() > 0:
        t = t[..., None]
    if bool((t <= 0).any()):
        raise ValueError("soft_topk: tau must be > 0")
    return t


@torch.no_grad()
def solve_theta(u: torch.Tensor, beta: torch.Tensor, tau, iters: int = 0) -> torch.Tensor:
    """theta (...) in fp64 with sum_i sigmoid((u_i + theta) / tau) = beta, by bisection.

    Bracket: with c = 40 + log(n), theta in [-max u - c tau, -min u + c tau]; at the ends the
    sum is within n * sigmoid(-c) < 1e-17 of 0 and of n. ``iters`` 0 means enough halvings
    to reach fp64 resolution of the bracket (stops early once no interval shrinks).
    """
    u64 = u.detach().to(torch.float64)
    b64 = beta.detach().to(torch.float64)
    t = _as_tau(tau, u64)  # (..., 1) or ()
    n = u64.shape[-1]
    c = 40.0 + math.log(n)
    tq = t.squeeze(-1) if t.dim() > 0 else t
    lo = -u64.amax(-1) - c * tq
    hi = -u64.amin(-1) + c * tq
    lo, hi = torch.broadcast_tensors(lo, hi)
    lo, hi = lo.clone(), hi.clone()
    max_iter = iters if iters > 0 else 200
    for _ in range(max_iter):
        mid = 0.5 * (lo + hi)
        s = torch.sigmoid((u64 + mid[..., None]) / t).sum(-1)
        above = s > b64
        new_hi = torch.where(above, mid, hi)
        new_lo = torch.where(above, lo, mid)
        if iters == 0 and torch.equal(new_hi, hi) and torch.equal(new_lo, lo):
            break
        lo, hi = new_lo, new_hi
    return 0.5 * (lo + hi)


class SoftTopK(torch.autograd.Function):
    """autograd Function: (u (..., n), beta (...), tau) -> (m (..., n), theta (...) fp64)."""

    @staticmethod
    def forward(ctx, u, beta, tau, iters):
        theta = solve_theta(u, beta, tau, iters)
        t = _as_tau(tau, u.detach().to(torch.float64))
        m64 = torch.sigmoid((u.detach().to(torch.float64) + theta[..., None]) / t)
        ctx.save_for_backward(m64, t)
        ctx.u_dtype = u.dtype
        ctx.beta_dtype = beta.dtype
        ctx.mark_non_differentiable(theta)
        return m64.to(u.dtype), theta

    @staticmethod
    def backward(ctx, g_m, g_theta):
        m64, t = ctx.saved_tensors
        s = m64 * (1.0 - m64)
        S = s.sum(-1, keepdim=True)
        g = g_m.to(torch.float64)
        gs = (g * s).sum(-1, keepdim=True)
        Sc = S.clamp_min(_S_FLOOR)
        ok = S > 0
        grad_u = grad_beta = None
        if ctx.needs_input_grad[0]:
            grad_u = torch.where(ok, s / t * (g - gs / Sc), torch.zeros_like(s)).to(ctx.u_dtype)
        if ctx.needs_input_grad[1]:
            grad_beta = torch.where(ok, gs / Sc, torch.zeros_like(gs)).squeeze(-1)
            grad_beta = grad_beta.to(ctx.beta_dtype)
        return grad_u, grad_beta, None, None


def soft_topk_with_theta(u: torch.Tensor, beta: Union[torch.Tensor, float], tau=1.0,
                         iters: int = 0, check: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Like ``soft_topk`` but also returns theta (...) (fp64, no gradient)."""
    if u.dim() < 1 or u.shape[-1] < 1:
        raise ValueError("soft_topk: u must be (..., n) with n >= 1")
    if not isinstance(beta, torch.Tensor):
        beta = torch.tensor(float(beta), dtype=u.dtype, device=u.device)
    lead = u.shape[:-1]
    if beta.shape != lead:
        try:
            beta = beta.expand(lead)
        except RuntimeError:
            raise ValueError(f"soft_topk: beta shape {tuple(beta.shape)} does not match u's "
                             f"leading shape {tuple(lead)}") from None
    if check:
        n = u.shape[-1]
        bd = beta.detach()
        if not bool(((bd > 0) & (bd <= n)).all()):
            raise ValueError(f"soft_topk: beta must satisfy 0 < beta <= n = {n}; got range "
                             f"[{float(bd.min())}, {float(bd.max())}]")
        if not bool(torch.isfinite(u.detach()).all()):
            raise ValueError("soft_topk: u must be finite")
    return SoftTopK.apply(u, beta, tau, iters)


def soft_topk(u: torch.Tensor, beta: Union[torch.Tensor, float], tau=1.0, iters: int = 0,
              check: bool = True) -> torch.Tensor:
    """Soft top-k mask m (..., n) with sum(m, -1) = beta.

    u     (..., n) scores (any float dtype; differentiable).
    beta  (...) or scalar budgets, 0 < beta <= n, may be fractional (differentiable).
    tau   temperature > 0: a float, or a tensor (...) for per-row temperatures (no gradient).
    iters bisection steps; 0 = until fp64 resolution.
    check validate beta range and finiteness of u (ValueError).
    """
    return soft_topk_with_theta(u, beta, tau, iters, check)[0]
