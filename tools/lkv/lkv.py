# SPDX-License-Identifier: Apache-2.0
"""LKV building blocks shared by the trainer, the exporter and the tests (spec: shared/spec/lkv.md,
docs/lkv.md).

- ``LkvParams``: the trainable part: head logits z (L, H) and one MLP per (layer, KV head) on
  x = [k ; v] (2 * head_dim) -> u = w2 . act(W1 x + b1) + b2.
- ``soft_budgets``: differentiable water-filling of beta = r * R * N * t (r = softmax(z / T)),
  clipped at t; the clip decision is not differentiated, the unclipped heads' shares are.
- ``water_fill`` / ``apportion``: the exact integer rule of the C++ budgeter
  (include/kvevict/policies/learned.hpp), written with Python floats and ``math.exp`` so that it
  makes the same fp64 decisions as the C++ code (same libm exp, same operation order).
- ``write_artifact`` / ``read_artifact``: the versioned binary format (docs/lkv.md).
"""

from __future__ import annotations

import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch

MAGIC = b"KVEVLKV\0"
VERSION = 1
HEADER_BYTES = 128
IDENTITY_PREFIX = 28 + 65536
ACT_CODES = {"silu": 0, "relu": 1}
FNV_OFFSET = 14695981039346656037
FNV_PRIME = 1099511628211


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    """FNV-1a 64 (same as kvevict::io::detail::fnv1a64). Pure Python; fine for < 1 MB."""
    m = (1 << 64) - 1
    for b in data:
        h ^= b
        h = (h * FNV_PRIME) & m
    return h


def checkpoint_identity(path: str) -> Tuple[Tuple[int, ...], int, int]:
    """(7 header int32, file size, FNV-1a 64 of the first IDENTITY_PREFIX bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 28:
        raise ValueError(f"{path}: shorter than the 28-byte llama2.c header")
    header = struct.unpack("<7i", data[:28])
    return header, len(data), fnv1a64(data[:IDENTITY_PREFIX])


# ---------------------------------------------------------------------------------------------
class LkvParams(torch.nn.Module):
    """z (L, H) and per-(layer, KV head) MLPs W1 (L, H, hid, 2d), b1 (L, H, hid), w2 (L, H, hid),
    b2 (L, H)."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, hidden: int,
                 activation: str = "silu", seed: int = 0):
        super().__init__()
        if activation not in ACT_CODES:
            raise ValueError(f"activation must be one of {list(ACT_CODES)}")
        g = torch.Generator().manual_seed(seed)
        L, H, d, k = n_layers, kv_heads, head_dim, hidden
        self.activation = activation
        self.z = torch.nn.Parameter(torch.zeros(L, H))
        self.W1 = torch.nn.Parameter(torch.randn(L, H, k, 2 * d, generator=g) / math.sqrt(2 * d))
        self.b1 = torch.nn.Parameter(torch.zeros(L, H, k))
        self.w2 = torch.nn.Parameter(torch.randn(L, H, k, generator=g) / math.sqrt(k))
        self.b2 = torch.nn.Parameter(torch.zeros(L, H))

    @property
    def shape(self):
        L, H, k, d2 = self.W1.shape
        return L, H, d2 // 2, k

    def act(self, a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(a) if self.activation == "silu" else torch.relu(a)

    def utility(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """u (B, H, T) for keys/values (B, H, T, d) of `layer` (dtype of the parameters)."""
        x = torch.cat([k, v], dim=-1).to(self.W1.dtype)  # (B, H, T, 2d)
        a = torch.einsum("bhti,hji->bhtj", x, self.W1[layer]) + self.b1[layer][None, :, None, :]
        return torch.einsum("bhtj,hj->bht", self.act(a), self.w2[layer]) + self.b2[layer][None, :, None]

    def mlp_flat(self) -> List[float]:
        """MLP weights in the artifact order: per (layer, head): W1 row-major, b1, w2, b2."""
        L, H, d, k = self.shape
        out: List[float] = []
        with torch.no_grad():
            for l in range(L):
                for h in range(H):
                    out += self.W1[l, h].float().reshape(-1).tolist()
                    out += self.b1[l, h].float().tolist()
                    out += self.w2[l, h].float().tolist()
                    out.append(float(self.b2[l, h].float()))
        return out


def soft_budgets(z: torch.Tensor, temperature: float, R: float, t: int,
                 lo: float = 1e-3) -> torch.Tensor:
    """Continuous budgets beta (N) = water-filled r * R * N * t, each in [lo, t]; differentiable
    in z through the unclipped heads. z: (N,)."""
    N = z.numel()
    r = torch.softmax(z.reshape(-1) / temperature, dim=0)
    rest = R * N * t
    clipped = torch.zeros(N, dtype=torch.bool)
    for _ in range(N + 1):
        ru = torch.where(clipped, torch.zeros_like(r), r)
        share = ru / ru.sum() * (rest - float(t) * float(clipped.sum()))
        over = (share > t) & ~clipped
        if not bool(over.any()):
            break
        clipped = clipped | over
    beta = torch.where(clipped, torch.full_like(r, float(t)), share)
    return beta.clamp(min=lo, max=float(t))


# ---------------------------------------------------------------------------------------------
def apportion(share: Sequence[float], cap: Optional[Sequence[int]], total: int) -> List[int]:
    """Python copy of kvevict::detail::apportion (core/apportion.hpp), same decisions."""
    n = len(share)
    out = [0] * n
    assigned = 0
    for i in range(n):
        s = share[i]
        if not (s > 0.0) or not (s < 9.0e18):
            s = 9.0e18 if s >= 9.0e18 else 0.0
        f = int(math.floor(s))
        if cap is not None and f > cap[i]:
            f = cap[i]
        out[i] = f
        assigned += f
    while assigned > total:
        best, best_frac = -1, 2.0
        for i in range(n - 1, -1, -1):
            if out[i] <= 0:
                continue
            fr = share[i] - math.floor(share[i])
            if not (fr >= 0.0):
                fr = 0.0
            if fr < best_frac:
                best_frac, best = fr, i
        if best < 0:
            break
        out[best] -= 1
        assigned -= 1
    while assigned < total:
        best, best_frac = -1, -1.0
        for i in range(n):
            if cap is not None and out[i] >= cap[i]:
                continue
            s = share[i]
            fr = s - float(out[i]) if (s > 0.0 and s < 9.0e18) else -0.5
            if fr > best_frac:
                best_frac, best = fr, i
        if best < 0:
            break
        out[best] += 1
        assigned += 1
    return out


def water_fill(logits: Sequence[float], temperature: float, total: int, cap: int,
               floor_each: int = 0) -> List[int]:
    """Python copy of kvevict::detail::lkv_water_fill (policies/learned.hpp). logits must be the
    fp32 values (as Python floats); temperature the fp32 value."""
    n = len(logits)
    if n < 1 or not temperature > 0 or floor_each > cap or total < n * floor_each or total > n * cap:
        raise ValueError("water_fill: bad arguments")
    zs = [float(x) / temperature for x in logits]
    zmax = -1e300
    for z in zs:
        if z > zmax:
            zmax = z
    r = [0.0] * n
    zsum = 0.0
    for i in range(n):
        r[i] = math.exp(float(logits[i]) / temperature - zmax)
        zsum += r[i]
    for i in range(n):
        r[i] /= zsum
    room = float(cap - floor_each)
    rest = float(total - n * floor_each)
    clipped = [False] * n
    share = [0.0] * n
    while True:
        rsum = 0.0
        n_open = 0
        for i in range(n):
            if not clipped[i]:
                rsum += r[i]
                n_open += 1
        anyc = False
        for i in range(n):
            if clipped[i]:
                continue
            # every head left has ratio 0 (softmax underflow): they share the rest equally, as the C++
            share[i] = r[i] / rsum * rest if rsum > 0.0 else rest / n_open
            if share[i] > room:
                anyc = True
        if not anyc:
            break
        for i in range(n):
            if not clipped[i] and share[i] > room:
                clipped[i] = True
                share[i] = room
                rest -= room
    out = apportion(share, [cap - floor_each] * n, total - n * floor_each)
    return [o + floor_each for o in out]


def total_budget(R: float, n_heads: int, t: int) -> int:
    """B_total = floor(R * (N * t)) in fp64, as budgeters::headwise_learned::total_budget."""
    return int(math.floor(R * float(n_heads * t)))


def topk_ascending(u32: Sequence[float], k: int) -> List[int]:
    """Indices of the k largest fp32 scores, ties to the lower index, returned ascending (the
    rule of selectors::topk with nothing protected)."""
    order = sorted(range(len(u32)), key=lambda i: (-u32[i], i))
    return sorted(order[:k])


# ---------------------------------------------------------------------------------------------
def write_artifact(path: str, params: LkvParams, model_header: Sequence[int], ckpt_bytes: int,
                   ckpt_hash: int, keep_ratio_min: float, keep_ratio_max: float,
                   temperature: float = 1.0) -> None:
    """Write format version 1 (docs/lkv.md, include/kvevict/io/lkv_artifact.hpp)."""
    L, H, d, k = params.shape
    with torch.no_grad():
        logits = params.z.float().reshape(-1).tolist()
    payload = struct.pack(f"<{len(logits)}f", *logits)
    mlp = params.mlp_flat()
    payload += struct.pack(f"<{len(mlp)}f", *mlp)
    count = len(logits) + len(mlp)
    hdr = bytearray()
    hdr += MAGIC
    hdr += struct.pack("<II", VERSION, HEADER_BYTES)
    hdr += struct.pack("<7i", *model_header)
    hdr += struct.pack("<I", 0)
    hdr += struct.pack("<QQ", ckpt_bytes, ckpt_hash)
    hdr += struct.pack("<4i", L, H, d, k)
    hdr += struct.pack("<ii", ACT_CODES[params.activation], 0)
    hdr += struct.pack("<4f", keep_ratio_min, keep_ratio_max, temperature, 0.0)
    hdr += struct.pack("<QQQ", count, fnv1a64(payload), 0)
    assert len(hdr) == HEADER_BYTES, len(hdr)
    with open(path, "wb") as f:
        f.write(bytes(hdr) + payload)


def read_artifact(path: str) -> dict:
    """Read format version 1 into a dict (raises ValueError like the C++ reader)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES:
        raise ValueError(f"truncated LKV artifact {path}")
    if data[:8] != MAGIC:
        raise ValueError(f"{path} is not an LKV artifact (bad magic)")
    version, hb = struct.unpack_from("<II", data, 8)
    if version != VERSION:
        raise ValueError(f"{path}: format version {version}, supported {VERSION}")
    header = struct.unpack_from("<7i", data, 16)
    ckpt_bytes, ckpt_hash = struct.unpack_from("<QQ", data, 48)
    L, H, d, k = struct.unpack_from("<4i", data, 64)
    act, flags = struct.unpack_from("<ii", data, 80)
    rmin, rmax, temp, _ = struct.unpack_from("<4f", data, 88)
    count, phash, _ = struct.unpack_from("<QQQ", data, 104)
    N = L * H
    block = k * 2 * d + 2 * k + 1
    if count != N + N * block or len(data) != HEADER_BYTES + 4 * count:
        raise ValueError(f"{path}: payload size mismatch")
    payload = data[HEADER_BYTES:]
    if fnv1a64(payload) != phash:
        raise ValueError(f"{path}: payload hash mismatch")
    vals = struct.unpack(f"<{count}f", payload)
    p = LkvParams(L, H, d, k, activation={v: n for n, v in ACT_CODES.items()}[act])
    with torch.no_grad():
        p.z.copy_(torch.tensor(vals[:N]).reshape(L, H))
        off = N
        for l in range(L):
            for h in range(H):
                p.W1[l, h].copy_(torch.tensor(vals[off:off + k * 2 * d]).reshape(k, 2 * d))
                off += k * 2 * d
                p.b1[l, h].copy_(torch.tensor(vals[off:off + k]))
                off += k
                p.w2[l, h].copy_(torch.tensor(vals[off:off + k]))
                off += k
                p.b2[l, h] = vals[off]
                off += 1
    return dict(params=p, model_header=header, ckpt_bytes=ckpt_bytes, ckpt_hash=ckpt_hash,
                keep_ratio_min=rmin, keep_ratio_max=rmax, temperature=temp, version=version)
