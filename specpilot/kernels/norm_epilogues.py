"""Norm + projection launches that finish the next op in their epilogue, one launch fewer per use:

- rmsnorm_qkv_rope: rmsnorm(x) @ W_qkv.T, then rope_kv_write's rotation and cache write: returns q [T, H, D]
  and writes rotated k and plain v to the caches at `slots` (no qkv tensor, no rope_kv launch);
- rmsnorm_glu: (x + residual ->) rmsnorm @ W_gate_up.T, then silu(gate) * up: returns the MLP activation
  [T, I] (no gate_up tensor, no swiglu launch).

Same kernel as rmsnorm_linear (norm_gemm.py). A gate_up program owning output columns j also accumulates the up
rows I + j from the same normalised tile, in the same fixed K order; a QKV tile holds column pairs (j, its
rotate_half partner j + D/2) and exchanges its halves in registers, so W is read once. Every value equals the
unfused pair's: the projection rounded to the dtype, then the rotation (fp32, from the fp32 tables) or silu_mul.
Batch invariance is rmsnorm_linear's: nothing depends on T or other rows.
W may be a W12 weight (OctLayout or W12Tensor; bf16 x), decoded in the kernel's K loop as in rmsnorm_linear (w12_tile.py).
"""
from __future__ import annotations

import torch

from .w12_tile import W12Weight
from ._common import check_int, check_out, check_tensor, dot_precision, register_cap
from .act import swiglu_ref
from .gemm import BLOCK_K
from .norm_gemm import (BLOCK_M, _NO_ROPE, _rmsnorm_linear_kernel, check_norm_inputs, norm_launch_shape, norm_operand,
                        norm_pdl, norm_warps, rmsnorm_linear_ref)
from .rope_kv import check_rope_rows, rope_kv_write_ref


def rmsnorm_qkv_rope_ref(x, norm_w, W, eps, positions, slots, cos, sin, k_cache, v_cache, heads: int,
                         kv_heads: int) -> torch.Tensor:
    return rope_kv_write_ref(rmsnorm_linear_ref(x, norm_w, W, eps), positions, slots, cos, sin, k_cache, v_cache,
                             heads, kv_heads)


def rmsnorm_glu_ref(x, norm_w, W, eps, residual=None):
    y = rmsnorm_linear_ref(x, norm_w, W, eps, residual)
    return swiglu_ref(y) if residual is None else (swiglu_ref(y[0]), y[1])


def rmsnorm_qkv_rope(x: torch.Tensor, norm_w: torch.Tensor, W: torch.Tensor | W12Weight, eps: float,
                     positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, *,
                     out: torch.Tensor | None = None, block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, block_k: int = BLOCK_K, row_tile: int = BLOCK_M,
                     split_k: int = 1, stat_unroll: int = 8, act_prefetch: int = 2,
                     prenorm: bool = False, grid_dependency: int | None = None, producer_stat: bool = False,
                     row_sumsq: torch.Tensor | None = None, post_scale: bool = False,
                     scaled_x: torch.Tensor | None = None, max_registers: int | None = None,
                     tile_rows: int = BLOCK_M) -> torch.Tensor:
    """q [T, heads, D] of rope(rmsnorm(x) @ W.T); k, v written to k_cache/v_cache [kv_heads, S, D] at slots.

    W [(heads + 2 kv_heads) * D, K] is the fused q|k|v projection; positions, slots int64 [T]; cos, sin fp32
    [max_pos, D/2]. A token with an out-of-range position or slot writes no cache row and gets a NaN q row
    (no host sync can report it), as in rope_kv_write.
    """
    T, K, N, _, w_args, w12, rows_pp = check_norm_inputs(
        x, norm_w, W, eps, None, None, block_n, num_warps, num_stages, block_k, row_tile=row_tile, split_k=split_k,
        stat_unroll=stat_unroll, act_prefetch=act_prefetch, prenorm=prenorm, grid_dependency=grid_dependency,
        producer_stat=producer_stat, row_sumsq=row_sumsq, post_scale=post_scale, scaled_x=scaled_x,
        max_registers=max_registers, tile_rows=tile_rows)
    num_warps = norm_warps(K, num_warps)
    dev, dt = x.device, x.dtype
    check_int("heads", heads, 1)
    check_int("kv_heads", kv_heads, 1)
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    check_tensor("k_cache", k_cache, (kv_heads, None, None), dt, dev)
    S, D = k_cache.shape[1], k_cache.shape[2]
    if D < 16 or D & (D - 1):  # a tile (16 columns at least) holds rotary pairs of one head
        raise ValueError(f"head_dim={D} must be a power of two >= 16")
    if N != (heads + 2 * kv_heads) * D:
        raise ValueError(f"W has {N} rows; heads={heads}, kv_heads={kv_heads}, head_dim={D} need "
                         f"{(heads + 2 * kv_heads) * D}")
    check_tensor("v_cache", v_cache, (kv_heads, S, D), dt, dev)
    check_rope_rows(positions, slots, T, False, dev)
    check_tensor("cos", cos, (None, D // 2), torch.float32, dev)
    check_tensor("sin", sin, cos.shape, torch.float32, dev)
    out = check_out("out", out, (T, heads, D), dt, dev)
    # a tile holds rotary pairs (norm_gemm._rope_tile_cols): at most one head's columns
    bn, stages, launches = norm_launch_shape(x, N, block_n, num_stages, block_k, rows_pp, split_k, max_block_n=D,
                                             w12=w12)
    op = norm_operand(x, norm_w, eps, None, None, prenorm, block_k, row_tile, num_warps, row_sumsq, scaled_x)
    for r0, r1, grid, ws, counters, per_split in launches:
        _rmsnorm_linear_kernel[grid](op.x[r0:r1], x, norm_w, *w_args, x, out[r0:r1], out, x, x, x, x, ws, counters,
                                     op.row_sumsq[r0:r1], positions[r0:r1], slots[r0:r1], cos, sin, k_cache,
                                     v_cache, S, cos.shape[0],
                                     r1 - r0, N, K, per_split, float(eps), HAS_RES=False, HAS_BIAS=False,
                                     DOT_PREC=dot_precision(dt), W12=w12, STORE_Y=True, ARGMAX=False, EPI=2, H=heads,
                                     KVH=kv_heads, HALF=D // 2, BLOCK_M=rows_pp, BLOCK_N=bn, BLOCK_K=block_k,
                                     SPLIT_K=split_k, STAT_UNROLL=stat_unroll, ACT_PREFETCH=act_prefetch,
                                     NORM=op.norm, STAT_SEGS=op.stat_segs, num_warps=num_warps, num_stages=stages,
                                     **norm_pdl(x, N, K, grid_dependency), **register_cap(max_registers))
    return out


def rmsnorm_glu(x: torch.Tensor, norm_w: torch.Tensor, W: torch.Tensor | W12Weight, eps: float,
                residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None, block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, block_k: int = BLOCK_K, row_tile: int = BLOCK_M, split_k: int = 1,
                stat_unroll: int = 8, act_prefetch: int = 2, prenorm: bool = False,
                grid_dependency: int | None = None, producer_stat: bool = False,
                row_sumsq: torch.Tensor | None = None, post_scale: bool = False, scaled_x: torch.Tensor | None = None,
                max_registers: int | None = None, tile_rows: int = BLOCK_M):
    """silu(gate) * up of rmsnorm(x (+ residual)) @ W.T for W [2I, K] = [gate ; up]: [T, I], or
    (activation, x + residual) when residual is given."""
    T, K, N, residual_out, w_args, w12, rows_pp = check_norm_inputs(
        x, norm_w, W, eps, residual, residual_out, block_n, num_warps, num_stages, block_k, w_rows_per_out=2,
        row_tile=row_tile, split_k=split_k, stat_unroll=stat_unroll, act_prefetch=act_prefetch, prenorm=prenorm,
        grid_dependency=grid_dependency, producer_stat=producer_stat, row_sumsq=row_sumsq, post_scale=post_scale,
        scaled_x=scaled_x, max_registers=max_registers, tile_rows=tile_rows)
    num_warps = norm_warps(K, num_warps, w12_pair=w12)
    dev, dt = x.device, x.dtype
    out = check_out("out", out, (T, N), dt, dev)
    bn, stages, launches = norm_launch_shape(x, N, block_n, num_stages, block_k, rows_pp, split_k, pair=True, w12=w12)
    op = norm_operand(x, norm_w, eps, residual, residual_out, prenorm, block_k, row_tile, num_warps, row_sumsq,
                      scaled_x)
    rk = op.residual
    has_res = rk is not None
    for r0, r1, grid, ws, counters, per_split in launches:
        _rmsnorm_linear_kernel[grid](op.x[r0:r1], rk[r0:r1] if has_res else x, norm_w, *w_args, x, out[r0:r1],
                                     residual_out[r0:r1] if has_res else out, x, x, x, x, ws, counters,
                                     op.row_sumsq[r0:r1], *_NO_ROPE(x),
                                     r1 - r0, N, K, per_split, float(eps), HAS_RES=has_res, HAS_BIAS=False,
                                     DOT_PREC=dot_precision(dt), W12=w12, STORE_Y=True, ARGMAX=False, EPI=1, H=1,
                                     KVH=1, HALF=1, BLOCK_M=rows_pp, BLOCK_N=bn, BLOCK_K=block_k, SPLIT_K=split_k,
                                     STAT_UNROLL=stat_unroll, ACT_PREFETCH=act_prefetch, NORM=op.norm,
                                     STAT_SEGS=op.stat_segs, num_warps=num_warps, num_stages=stages,
                                     **norm_pdl(x, 2 * N, K, grid_dependency), **register_cap(max_registers))
    return out if residual is None else (out, residual_out)
