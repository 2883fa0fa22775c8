"""Independent float64 references for the Python binding's tests, written from the papers and
docs/semantics.md with plain torch loops: window attention with the causal mask inside the
window, SnapKV (sum over the window, GQA mean, centred average pool with zero padding counted),
key norm, StreamingLLM, and top-k with protected sinks and recent tokens (ties to the lower index).
They share no code with kvevict."""
import math

import torch


def window_attention(q, k):
    """q [w, d], k [L, d] (float64) -> A [w, L]: row j is the query of slot L - w + j and sees
    keys 0 .. L - w + j."""
    w, d = q.shape
    L = k.shape[0]
    logits = (q @ k.T) / math.sqrt(d)
    for j in range(w):
        logits[j, L - w + j + 1:] = float("-inf")
    return torch.softmax(logits, dim=1)


def avg_pool(x, kernel):
    n = x.shape[0]
    y = torch.zeros_like(x)
    for i in range(n):
        lo, hi = max(0, i - kernel // 2), min(n, i + kernel // 2 + 1)
        y[i] = x[lo:hi].sum() / kernel
    return y


def snapkv_scores(qg, k, kernel=5, recent=None):
    """qg [G, w, d] the group's window queries, k [L, d] -> score row [L]: the window attention
    summed over the rows, averaged over the group, pooled over the candidates [0, L - recent)
    only (SnapKV scores the prefix; recent defaults to the window); 0 for the recent slots."""
    w = qg.shape[1]
    recent = w if recent is None else recent
    L = k.shape[0]
    a = torch.stack([window_attention(qg[g], k).sum(dim=0) for g in range(qg.shape[0])]).mean(dim=0)
    out = torch.zeros_like(a)
    out[:L - recent] = avg_pool(a[:L - recent], kernel)
    return out


def key_norm_scores(k):
    return -k.norm(dim=1)


def budget_tokens(L, keep_tokens=0, keep_fraction=0.0, protected=0):
    """docs/semantics.md: B tokens, or floor(f L) raised to the protected count and to 1."""
    if keep_tokens:
        return keep_tokens
    return max(int(math.floor(keep_fraction * L)), protected, 1)


def topk_select(scores, L, budget, sinks, recent):
    """Sinks [0, sinks) and recent [L - recent, L) by rule, the best budget - sinks - recent of the
    rest by score (desc, ties to the lower index); ascending. L <= budget keeps everything."""
    if budget >= L:
        return list(range(L))
    c0, c1 = sinks, L - recent
    k = max(0, min(budget - sinks - recent, c1 - c0))
    cand = sorted(range(c0, c1), key=lambda i: (-float(scores[i]), i))[:k]
    return sorted(list(range(c0)) + cand + list(range(c1, L)))


def boundary_ok(lib, ref, scores, rtol=1e-4):
    """lib and ref selections may differ only by candidates whose reference scores tie the
    boundary within rtol (float32 arithmetic against float64)."""
    a, b = set(lib), set(ref)
    if a == b:
        return True
    if len(a) != len(b):
        return False
    diff = sorted(a ^ b)
    vals = [float(scores[i]) for i in diff]
    scale = max(abs(v) for v in vals) or 1.0
    return max(vals) - min(vals) <= rtol * scale
