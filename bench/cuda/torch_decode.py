#!/usr/bin/env python3
"""Decode benefit on the GPU (issue "Benchmarks", item 4, CUDA side; run by scripts/device_check.sh).

One decoding step's attention (batch 1, q_heads 32, kv_heads 8, head_dim 128, bf16; one query
token) over the full cache of S tokens versus over caches compacted to B tokens per KV head,
through PyTorch's fused scaled_dot_product_attention (the FlashAttention-class kernel an engine
would call; GQA by enable_gqa=True when torch has it, else K/V expanded to q_heads before the
timed region). Times are CUDA-event medians of 200 calls after 20 warm-ups. Bytes read: K + V
of the cache (the step is memory bound), so GB/s = 2 * kv_heads * tokens * head_dim * 2 / time.

Prints one JSON object per cache size: {"seq": S, "tokens": T, "ms": t, "GBps": g,
"speedup": t_full / t}. Exits 2 with a JSON "skip" line when torch has no CUDA device.
Usage: torch_decode.py [S [B ...]]   (default: 32768 2048 1024 512)
"""
import json
import sys


def main() -> int:
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"skip": f"torch not importable: {e}"}))
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"skip": "torch has no CUDA device"}))
        return 2
    args = [int(a) for a in sys.argv[1:]]
    S = args[0] if args else 32768
    budgets = args[1:] or [2048, 1024, 512]
    dev = torch.device("cuda")
    Hq, Hkv, D = 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(7)
    q = (torch.rand(1, Hq, 1, D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
    k_full = (torch.rand(1, Hkv, S, D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
    v_full = (torch.rand(1, Hkv, S, D, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, k_full, v_full, enable_gqa=True)
        gqa = True
    except TypeError:
        gqa = False

    def attend(k, v):
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v)

    def time_ms(k, v):
        if not gqa:  # expanded once, outside the timed region
            k = k.repeat_interleave(Hq // Hkv, dim=1)
            v = v.repeat_interleave(Hq // Hkv, dim=1)
        for _ in range(20):
            attend(k, v)
        ts = []
        for _ in range(200):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            attend(k, v)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        return ts[len(ts) // 2]

    full = time_ms(k_full, v_full)
    rows = [(S, full)]
    for B in budgets:
        idx = torch.sort(torch.randperm(S, device=dev, generator=g)[:B]).values  # a compacted cache
        rows.append((B, time_ms(k_full[:, :, idx].contiguous(), v_full[:, :, idx].contiguous())))
    heads_read = Hkv if gqa else Hq  # without enable_gqa the expanded K/V are read
    for T, ms in rows:
        gbps = 2 * heads_read * T * D * 2 / (ms / 1e3) / 1e9
        print(json.dumps({"seq": S, "tokens": T, "ms": ms, "GBps": gbps, "speedup": full / ms, "gqa_native": gqa}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
