"""Rotary embedding of q and k from the fused QKV output, and the KV-cache write, in one launch.

qkv [T, (heads + 2 kv_heads) * D] holds per token [q heads ; k heads ; v heads]. Each token's q and k heads are
rotated with HF Llama's rotate_half convention at positions[t] (x1 = x[:D/2], x2 = x[D/2:],
out = [x1 cos - x2 sin, x2 cos + x1 sin], computed in fp32 from fp32 tables (`rotate`: one fma over the rounded
partner product) and rounded once to the dtype);
rotated k and plain v go to k_cache/v_cache[kv_head, slots[t]], rotated q is returned as [T, heads, D].

Elementwise per token, so trivially batch-invariant. An out-of-range position or slot cannot be reported from
the device without a host sync: such a token writes nothing to the cache and its q row is NaN (the reference
raises instead).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import ACT_DTYPES, LaunchParams, check_int, check_launchable, check_out, check_tensor


@dataclasses.dataclass(frozen=True)
class RopeKVParams(LaunchParams):
    """One program per (token, head): every field is T-neutral."""

    num_warps: int = 1
    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("num_warps",)
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"num_warps": (1, 2, 4)}


def rope_tables(max_positions: int, head_dim: int, theta: float, device: torch.device | str | None = None):
    """(cos, sin) [max_positions, head_dim / 2] fp32, as transformers' default LlamaRotaryEmbedding computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


def check_rope_rows(positions: torch.Tensor, slots: torch.Tensor | None, rows: int, consecutive: bool,
                    device: torch.device) -> None:
    """The positions and cache slots of `rows` rotated rows: int64 [rows] each, or (consecutive: row t at
    positions[0] + t, in that slot) positions [1] with slots None."""
    if consecutive:
        check_tensor("positions", positions, (1,), torch.int64, device)
        if slots is not None:
            raise ValueError("consecutive rows go to the slots of their positions: give slots=None")
    else:
        check_tensor("positions", positions, (rows,), torch.int64, device)
        check_tensor("slots", slots, (rows,), torch.int64, device)


def check_qk_norms(q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> None:
    """Per-head q and k RMS-norm weights: both [head_dim] of the activations' dtype, or neither."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"give both q and k norm weights, or neither (both q_norm and k_norm, [{head_dim}] each)")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            check_tensor(name, w, (head_dim,), dtype, device)


@triton.jit
def rotate(x, c, signed_partner_sin):
    """One rotate_half output in fp32: x cos -+ partner sin, as one explicit fma over the rounded partner product.
    Written out as a fma so no compiler decides it: left as x * c - p * s, a kernel contracts it where its
    surrounding code lets it, and two kernels with the same statements round differently (an H200 gave the QKV
    epilogue's q and k 1-ulp differences from this kernel's, which parted W12 greedy text from bf16's)."""
    return tl.fma(x, c, signed_partner_sin)


@triton.jit(do_not_specialize=["T"])
def _rope_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, T, S, max_pos,
                    H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    hh = tl.program_id(1)  # 0..H-1: q heads, H..H+KVH-1: kv heads
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    ok = (pos >= 0) & (pos < max_pos) & (slot >= 0) & (slot < S)
    c = tl.load(cos_ptr + pos * HALF + i, mask=ok & (i < HALF), other=0.0)
    s = tl.load(sin_ptr + pos * HALF + i, mask=ok & (i < HALF), other=0.0)
    src = qkv_ptr + t.to(tl.int64) * ((H + 2 * KVH) * D) + hh * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    o1 = rotate(x1, c, -(x2 * s)).to(q_ptr.dtype.element_ty)
    o2 = rotate(x2, c, x1 * s).to(q_ptr.dtype.element_ty)
    if hh < H:
        nan = tl.full([HALF], float("nan"), tl.float32).to(q_ptr.dtype.element_ty)
        dst = q_ptr + (t.to(tl.int64) * H + hh) * D
        tl.store(dst + i, tl.where(ok, o1, nan))
        tl.store(dst + HALF + i, tl.where(ok, o2, nan))
    else:
        row = ((hh - H) * S + slot).to(tl.int64) * D
        wm = ok & (i < HALF)
        tl.store(k_ptr + row + i, o1, mask=wm)
        tl.store(k_ptr + row + HALF + i, o2, mask=wm)
        vsrc = src + KVH * D
        tl.store(v_ptr + row + i, tl.load(vsrc + i), mask=wm)
        tl.store(v_ptr + row + HALF + i, tl.load(vsrc + HALF + i), mask=wm)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, D] rotated with cos/sin [T, D/2] in fp32, rounded to x.dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_kv_write_ref(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                      kv_heads: int) -> torch.Tensor:
    """Plain torch: returns rotated q [T, heads, D]; writes rotated k and v into the caches at `slots`."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"positions must be in [0, {cos.shape[0]}), got {positions.tolist()}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= k_cache.shape[1]):
        raise ValueError(f"slots must be in [0, {k_cache.shape[1]}), got {slots.tolist()}")
    x = qkv.view(T, heads + 2 * kv_heads, D)
    q, k, v = x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]
    c, s = cos[positions], sin[positions]
    k_cache[:, slots] = _rotate(k, c, s).transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)
    return _rotate(q, c, s)


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, *,
                  out: torch.Tensor | None = None, num_warps: int = 1) -> torch.Tensor:
    """Rotate q and k of qkv [T, (heads + 2 kv_heads) * D]; write k, v to caches [kv_heads, S, D] at slots [T].

    positions and slots are int64 [T]; cos/sin are fp32 [max_pos, D/2]; returns q [T, heads, D] (qkv's dtype).
    """
    RopeKVParams(num_warps=num_warps)
    check_int("heads", heads, 1)
    check_int("kv_heads", kv_heads, 1)
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    check_tensor("k_cache", k_cache, (kv_heads, None, None), ACT_DTYPES)
    dev, dt = k_cache.device, k_cache.dtype
    S, D = k_cache.shape[1], k_cache.shape[2]
    if D < 8 or D & (D - 1):
        raise ValueError(f"head_dim={D} must be a power of two >= 8")
    check_tensor("v_cache", v_cache, (kv_heads, S, D), dt, dev)
    check_tensor("qkv", qkv, (None, (heads + 2 * kv_heads) * D), dt, dev)
    T = qkv.shape[0]
    if T < 1:
        raise ValueError("qkv must hold at least one token")
    check_tensor("positions", positions, (T,), torch.int64, dev)
    check_tensor("slots", slots, (T,), torch.int64, dev)
    check_tensor("cos", cos, (None, D // 2), torch.float32, dev)
    check_tensor("sin", sin, cos.shape, torch.float32, dev)
    check_launchable(_rope_kv_kernel, dev)
    out = check_out("out", out, (T, heads, D), dt, dev)
    _rope_kv_kernel[(T, heads + kv_heads)](qkv, positions, slots, cos, sin, out, k_cache, v_cache, T, S,
                                           cos.shape[0], H=heads, KVH=kv_heads, HALF=D // 2,
                                           num_warps=num_warps)
    return out
