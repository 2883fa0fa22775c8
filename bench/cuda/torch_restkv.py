#!/usr/bin/env python3
"""Plain-PyTorch ReST-KV scoring on the GPU: the baseline row of scripts/device_check.sh.

Same shapes as bench/cuda/bench_cuda.cu (batch 1, q_heads 32, kv_heads 8, head_dim 128,
window 32, bf16, budget seq/4) and the same method as kvevict::presets::restkv, written the way
the reference code does it (K/V repeated to q_heads, the full (window x seq) attention
materialised, fp32 softmax): window attention with the causal mask inside the window, EMA
(alpha 0.3) over the rows, the "after" reconstruction score a/(1-a) * ||R z - R v_n|| with the
W_O factor R, the adaptive-window drift (top-(B-w) mean index of every row, front minus rear
half), mean over the GQA group, the adaptive box filter (replicate padding), top-k with the
window protected. It skips the dominant-token exact path (random data never triggers it).

Prints one JSON object per seq_len: {"seq": S, "ms": time per call, "peak_MB": peak memory
allocated by the call beyond the inputs}. Exits 2 with a message when torch has no CUDA.
"""
import json
import math
import sys


def main() -> int:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"skip": f"torch not importable: {e}"}))
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"skip": "torch has no CUDA device"}))
        return 2
    dev = torch.device("cuda")
    B, Hq, Hkv, D, W = 1, 32, 8, 128, 32
    G = Hq // Hkv
    alpha, beta, k_min = 0.3, 2000.0, 5
    seqs = [int(a) for a in sys.argv[1:]] or [4096, 32768, 131072]
    for S in seqs:
        g = torch.Generator(device=dev).manual_seed(1234)
        k = (torch.rand(B, Hkv, S, D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        v = (torch.rand(B, Hkv, S, D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        q = (torch.rand(B, Hq, W, D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        R = (torch.rand(Hq, D, D, device=dev, generator=g) * 2 - 1) * 0.088
        budget = S // 4

        def score():
            kr = k.repeat_interleave(G, dim=1).float()
            vr = v.repeat_interleave(G, dim=1).float()
            logits = torch.matmul(q.float(), kr.transpose(-1, -2)) / math.sqrt(D)  # B,Hq,W,S
            j = torch.arange(W, device=dev)[:, None]
            n = torch.arange(S, device=dev)[None, :]
            logits = logits.masked_fill(n > S - W + j, float("-inf"))
            A = torch.softmax(logits, dim=-1)
            c = torch.tensor([(1 - alpha) ** (W - 1)] + [alpha * (1 - alpha) ** (W - 1 - jj) for jj in range(1, W)],
                             device=dev)
            abar = (A * c[None, None, :, None]).sum(-2)  # B,Hq,S
            z = torch.einsum("bhs,bhsd->bhd", abar[..., : S - W], vr[..., : S - W, :])
            rz = torch.einsum("hij,bhj->bhi", R, z)
            y = torch.einsum("hij,bhsj->bhsi", R, vr)
            dist = (rz[:, :, None, :] - y).norm(dim=-1)
            s = abar / (1 - abar) * dist
            # adaptive-window drift
            K = max(1, budget - W)
            idx = torch.topk(A, K, dim=-1).indices.float().mean(-1)  # B,Hq,W
            t = (idx[..., : W // 2].mean(-1) - idx[..., W // 2:].mean(-1)).mean(1)  # per head -> B,Hq -> mean
            s = s.view(B, Hkv, G, S).mean(2)
            N = S - W
            tt = t.mean().item()
            m = math.floor(abs(tt) / beta)
            kk = max(k_min, 2 * m + 1)
            sh = math.floor(tt / beta) if tt > 0 else math.floor(tt / beta) + 1
            sh = max(-(kk // 2), min(kk // 2, sh))
            x = s[..., :N]
            pad_l, pad_r = kk // 2 - sh, kk // 2 + sh
            xp = torch.nn.functional.pad(x, (pad_l, pad_r), mode="replicate")
            sm = torch.nn.functional.avg_pool1d(xp.view(B * Hkv, 1, -1), kk, stride=1).view(B, Hkv, -1)[..., :N]
            keep = torch.topk(sm, budget - W, dim=-1).indices
            return keep

        score()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 5
        e0.record()
        for _ in range(reps):
            score()
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / reps
        peak = (torch.cuda.max_memory_allocated() - base) / 1e6
        print(json.dumps({"seq": S, "ms": ms, "peak_MB": peak}), flush=True)
        del k, v, q, R
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
