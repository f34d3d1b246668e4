"""Batch-invariant GEMM/GEMV y = x @ W.T (+ bias) (+ residual): o_proj, down_proj and lm_head for T tokens.

Invariance: the token dimension is tiled by the fixed BLOCK_M (16, padding rows are zero and never mix into
other rows), and every output element accumulates its K-reduction as one `tl.dot` chain over fixed BLOCK_K
(128) chunks in ascending order, in fp32. split_k > 1 (a reduction-order setting, one per shape) cuts that chain
into split_k runs of whole chunks, each program summing one from zero; the last program of a tile to finish adds
the runs' partials in split order (split_k_combine): the order is fixed, only who adds them varies, so the bits do
not depend on T or on scheduling (an atomic counts arrivals; no atomic touches a value). BLOCK_N only decides which
output columns a
program owns, and num_warps / num_stages only how a tile is spread over threads and pipelined: none of them
changes any element's accumulation order (T-neutral). row_tile=1 (a reduction-order setting, the same for every
T of a build) gives each program one row and sums each K chunk's fp32 products with tl.sum instead: no tensor-core
tile padded from 1 to 16 rows, no shared-memory staging; block_n and num_warps then shape that sum's tree, so
they too must hold for every T (LaunchParams.t_neutral). `swiglu_linear` is the same kernel with a prologue that
computes silu(gate) * up for each x tile on the fly, with the same bits as `swiglu` (so it equals
`linear(swiglu(gate_up), W)` bit for bit).

Rounding follows nn.Linear followed by a residual add in the activation dtype: y = round(acc + bias), then
round(y + residual). With out_dtype=torch.float32 (e.g. lm_head logits) the accumulator is stored unrounded.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import (ACT_DTYPES, ARRIVAL_COUNTERS, BLOCK_M, MAX_REGISTERS, MMA_TILE_ROWS, ROW_TILES, LaunchParams,
                      arrival_counters, check_launchable, check_out, check_tensor, dot_precision, register_cap)
from .act import silu_mul, swiglu_ref
from .pdl import check_launch_mode, pdl_launch, prefetch_rows, release_successor, wait_for_predecessor
from .rmsnorm import STAT_SEGMENT, store_row_sumsq
from .w12_tile import OCT_BLOCK, W12Weight, check_w12_launch, oct_block, oct_cell, oct_cols, weight_operand

BLOCK_K = 128  # reduction chunk: part of the numerics, never tuned
SPLIT_KS = (1, 2, 4, 8)  # split-K factors a launch may use (split_k_combine unrolls the sum)


def check_split(split_k: int) -> None:
    if split_k not in SPLIT_KS:
        raise ValueError(f"split_k={split_k!r} must be one of {SPLIT_KS}")


@dataclasses.dataclass(frozen=True)
class LinearParams(LaunchParams):
    """None picks a default: block_n from N and T (default_block_n), num_stages from the shared memory a stage
    takes (default_num_stages). Defaults from a sweep on an H200 at Llama-3-8B shapes (o_proj, down)."""

    block_n: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    block_k: int = BLOCK_K  # the K chunk of the accumulation chain: a reduction-order field (per shape, all T)
    row_tile: int = BLOCK_M  # tokens per program (ROW_TILES): a reduction-order field
    # rows of a program's tensor-core tile (MMA_TILE_ROWS): 32 reads each W chunk once for two 16-row slabs (T-neutral)
    tile_rows: int = BLOCK_M
    split_k: int = 1  # K runs per output tile, added in a fixed order: a reduction-order field (more programs)
    early_residual: bool = True  # load residual and bias before the K loop, not after it (latency: T-neutral)
    w_preload: bool = False  # preload_chunks: the whole W tile loaded before the predecessor wait (T-neutral)
    # this launch's PDL mode (pdl.GridDependency value; None: pdl.grid_dependency's policy by matrix size). Scheduling
    # only (T-neutral), and not searched: a kernel timed against itself says nothing of how it overlaps its
    # predecessor in a step; judge it with the captured step (scripts/gpu_step_ab.py).
    grid_dependency: int | None = None
    max_registers: int | None = None  # ptxas maxnreg (_common.MAX_REGISTERS): occupancy only, T-neutral
    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("block_n", "num_warps", "num_stages", "early_residual", "w_preload",
                                            "grid_dependency", "max_registers", "tile_rows")
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"block_n": (16, 32, 64, 128), "num_warps": (2, 4, 8),
                                                "num_stages": (2, 3, 4, 5), "block_k": (64, 128, 256, 512),
                                                "row_tile": ROW_TILES, "split_k": SPLIT_KS,
                                                "early_residual": (False, True), "w_preload": (False, True),
                                                "max_registers": MAX_REGISTERS, "tile_rows": MMA_TILE_ROWS}

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("early_residual", "w_preload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        check_launch_mode(self.grid_dependency)


@triton.jit
def tile_mac(a, w, acc, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc + a @ w for a [BLOCK_M, BLOCK_K], w [BLOCK_K, BLOCK_N]: a tensor-core dot chain for 16-row tiles; for
    a one-row tile the chunk's exact fp32 products summed on CUDA cores (tl.sum: the tree follows the layout)."""
    if BLOCK_M == 1:
        acc = acc + tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def split_k_combine(acc, acc2, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K: tl.constexpr, PAIR: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(acc, acc2, last): in the last of a tile's SPLIT_K programs to arrive, the sums of the tile's partials in
    split order 0, 1, ... (acc2 too when PAIR) and last=True; elsewhere last=False (the caller masks its stores).
    The arrival counter cnt_ptr[tile] is back at 0 when the kernel ends (graph replays reuse it)."""
    last = tile >= 0  # true
    if SPLIT_K > 1:
        SZ: tl.constexpr = BLOCK_M * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        base = ws_ptr + tile.to(tl.int64) * (SPLIT_K * SZ * (1 + PAIR))
        tl.store(base + pid_k * SZ + offs, acc)
        if PAIR:
            tl.store(base + (SPLIT_K + pid_k) * SZ + offs, acc2)
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
        if last:  # .cg: read the other programs' partials from L2, never a stale L1 line
            acc = tl.load(base + offs, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(base + s * SZ + offs, cache_modifier=".cg")
            if PAIR:
                acc2 = tl.load(base + SPLIT_K * SZ + offs, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc2 += tl.load(base + (SPLIT_K + s) * SZ + offs, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
    return acc, acc2, last


# w_preload: a program loads its whole W tile (every K chunk, as registers) before it waits for its predecessor,
# so after the wait only the activations' L2 trip and the dots remain on its critical path (the pipelined K loop
# starts its W loads after the wait; PDL's L2 prefetch only shortens them). The whole tile for tiles up to this size
# (the launch-bound small matrices: SmolLM2's W tiles are 18-48 KiB); bf16/fp16 W and no split-K only; larger tiles
# as below. The same dots in the same order: the same bits. Off by default, a tuner field: on an H200 (session 20)
# a SmolLM2 step with o_proj and down preloaded was 3-5% slower (each unrolled tile reaches its MMA through a
# register-to-shared conversion, where the K loop's tiles arrive by cp.async). Not in the norm + projection kernels:
# they already hold ~255 registers a thread at SmolLM2 shapes; preloaded there they spilled (ptxas: 20 KB a thread at
# 4 warps, 0.8-1.4 KB at 8) and the step took 1.41 / 0.87 ms against 0.70.
# A larger tile (Llama-3-8B's) preloads only its first chunks, up to PRELOAD_HEAD_BYTES, and runs the K loop over the
# rest: under PDL its first W bytes then arrive while the predecessor still runs, instead of after the wait.
PRELOAD_MAX_BYTES = 64 << 10
PRELOAD_HEAD_BYTES = 16 << 10


def preload_chunks(w_preload: bool, w12: bool, split_k: int, block_n: int, k: int, block_k: int,
                   elem_size: int) -> int:
    """The W_PRELOAD constexpr of a launch: how many K chunks its programs load before the wait (0: none): every
    chunk of a tile up to PRELOAD_MAX_BYTES, else the first ones within PRELOAD_HEAD_BYTES."""
    if not w_preload or w12 or split_k != 1:
        return 0
    chunks = triton.cdiv(k, block_k)
    chunk_bytes = block_n * block_k * elem_size
    if chunks * chunk_bytes <= PRELOAD_MAX_BYTES:
        return chunks
    return PRELOAD_HEAD_BYTES // chunk_bytes  # fewer than chunks: the tile is over PRELOAD_MAX_BYTES


@triton.jit
def preload_w(w_cols, ks, col_ok, K, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr):
    """The W tile's CHUNKS K chunks, each [BLOCK_K, BLOCK_N] and masked as the K loop masks them, loaded at once."""
    tiles = ()
    for c in tl.static_range(CHUNKS):
        kk = c * BLOCK_K + ks
        tiles = tiles + (tl.load(w_cols + kk[:, None], mask=(kk < K)[:, None] & col_ok[None, :], other=0.0),)
    return tiles


# A split-K launch covers at most this many token rows (a longer T, e.g. a prefill, is launched in row chunks):
# workspace and counters stay small. Rows are batch-invariant, so chunking changes no bit.
SPLIT_K_ROWS = 64


def split_size(k: int, block_k: int, split_k: int) -> int:
    """K elements of each split-K run: whole chunks of block_k, as even as they go (the last run may be shorter)."""
    chunks = triton.cdiv(k, block_k)
    if split_k > chunks:
        raise ValueError(f"split_k={split_k} exceeds the {chunks} K chunks of {block_k} (K={k})")
    return triton.cdiv(chunks, split_k) * block_k


def split_launches(device: torch.device, tokens: int, n: int, k: int, block_k: int, row_tile: int, block_n: int,
                   split_k: int, pair: bool = False) -> list[tuple]:
    """The launches of a projection over `tokens` rows and n output columns: one without split-K, else one per
    SPLIT_K_ROWS rows; each (first row, end row, grid, partials workspace, arrival counters, K elements per split).
    pair: two W row sets per column, whose partials split-K keeps too."""
    per_split = split_size(k, block_k, split_k)
    step = tokens if split_k == 1 else SPLIT_K_ROWS
    launches = []
    for r0 in range(0, tokens, step):
        r1 = min(tokens, r0 + step)
        tiles = triton.cdiv(r1 - r0, row_tile) * triton.cdiv(n, block_n)
        if split_k == 1:  # no partials: the counters stand in for the unused workspace argument
            ws = arrival_counters(device)
        elif tiles > ARRIVAL_COUNTERS:
            raise ValueError(f"{tiles} output tiles exceed the {ARRIVAL_COUNTERS} split-K counters")
        else:
            ws = torch.empty(tiles * split_k * row_tile * block_n * (2 if pair else 1), dtype=torch.float32,
                             device=device)
        launches.append((r0, r1, (tiles * split_k,), ws, arrival_counters(device), per_split))
    return launches


def default_block_n(n: int, tokens: int, target_programs: int = 128, row_tile: int = BLOCK_M,
                    w12: bool = False) -> int:
    """Largest column tile that still gives `target_programs` programs (about one wave on a 132-SM GPU).

    It may depend on T because block_n is T-neutral (each output element's reduction is the same whatever
    tile owns it; test_t_neutral_params_change_no_bit checks every block_n/num_warps/num_stages on the GPU),
    except with one row per program, where it shapes the reduction tree: then it depends on n alone.
    W12 tiles stop at 64 columns: 128 ran 1.04-1.65x slower on the H200 (fewer stages fit; session 29).
    """
    m_tiles = 1 if row_tile == 1 else triton.cdiv(tokens, row_tile)
    for bn in ((64, 32) if w12 else (128, 64, 32)):
        if triton.cdiv(n, bn) * m_tiles >= target_programs:
            return bn
    return 16


# The W12 launches' default pipeline. Since the cell index is carried from the previous iteration
# (w12_tile.oct_cell), stages set how many 256-K blocks are in flight (~41 KiB each at 64 columns). Session 31 on
# the H200 (notes/h200.md): tiles up to 64 columns run best at 3 stages (4096x14336 split 1: 83 -> 67 us at 64
# columns, 68 -> 43 at 32; the LM head even), the GLU's 128-column pair at 2 (83 vs 100 us); 4 lost everywhere
# (fewer programs an SM).
W12_STAGES = 3
W12_WIDE_STAGES = 2  # tiles wider than W12_NARROW columns (the GLU's gate|up pair of 64)
W12_NARROW = 64


def default_num_stages(block_n: int, elem_size: int, a_tiles: int = 1, most: int = 5,
                       smem_budget: int = 200 * 1024, block_k: int = BLOCK_K, row_tile: int = BLOCK_M,
                       w12: bool = False) -> int:
    """Deepest pipeline (up to `most`) whose x and W tiles fit the shared-memory budget; W12 (block_n: the whole
    tile's columns): W12_STAGES up to W12_NARROW columns, W12_WIDE_STAGES beyond."""
    if w12:
        return min(most, W12_STAGES if block_n <= W12_NARROW else W12_WIDE_STAGES)
    per_stage = (a_tiles * row_tile + block_n) * block_k * elem_size
    return max(1, min(most, smem_budget // per_stage))


def fit_block_n(block_n: int, block_k: int, elem_size: int, smem_budget: int = 160 * 1024) -> int:
    """Halve a default column tile until one K chunk's dot operands fit shared memory (228 KiB per SM on an
    H200; a one-chunk kernel with a 1024-wide chunk would otherwise ask for 288 KiB)."""
    while block_n > 16 and (BLOCK_M + block_n) * block_k * elem_size > smem_budget:
        block_n //= 2
    return block_n


@triton.jit
def _epilogue_inputs(b_ptr, r_ptr, offs, cols, row_ok, col_ok, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """(bias fp32 [BLOCK_N] or 0, residual tile or 0): what the epilogue adds to the accumulator."""
    bias = 0.0
    r = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return bias, r


@triton.jit
def _x_chunk(x_rows, kk, row_ok, K, SWIGLU: tl.constexpr):
    """The dot's left operand for K columns kk: x, or silu(gate) * up from the gate_up rows."""
    xm = row_ok[:, None] & (kk < K)[None, :]
    if SWIGLU:
        g = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        u = tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0)
        return silu_mul(g, u)
    return tl.load(x_rows + kk[None, :], mask=xm, other=0.0)


@triton.jit
def _w12_block_mac(acc, x_rows, words_ptr, codes_ptr, fat_ptr, w_rows, b2, f, col_ok, row_ok, k0, K, Kp,
                   SWIGLU: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, TAIL: tl.constexpr):
    """acc + x[:, k0:k0 + 256] @ W12 block k0 of the tile's rows: eight 32-wide dots in ascending K. TAIL: K ends
    inside this block, and its padding slices are skipped (a branch only there keeps the whole-block loop free of
    them: with per-slice branches Triton did not pipeline it, 1.1-1.4x slower on the H200, session 28)."""
    js = tl.arange(0, 32)
    ws = oct_block(words_ptr, codes_ptr, fat_ptr, w_rows, b2, f, col_ok, k0, Kp)
    for e in tl.static_range(8):
        if not TAIL or k0 + 32 * e < K:
            acc = tile_mac(_x_chunk(x_rows, k0 + 32 * e + js, row_ok, K, SWIGLU), ws[e], acc, DOT_PREC, BLOCK_M)
    return acc


@triton.jit(do_not_specialize=["T"])
def _linear_kernel(x_ptr, w_ptr, words_ptr, codes_ptr, base_ptr, fcell_ptr, fat_ptr, Kp, b_ptr, r_ptr, y_ptr,
                   ws_ptr, cnt_ptr, ss_ptr, sw_ptr, g_ptr, T, N, K, K_SPLIT, stride_x, SWIGLU: tl.constexpr,
                   HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr, DOT_PREC: tl.constexpr, W12: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                   EARLY_RES: tl.constexpr = 0, W_PRELOAD: tl.constexpr = 0, K_LOOP: tl.constexpr = 1,
                   PDL: tl.constexpr = 0,
                   PF_LINES: tl.constexpr = 16, ROW_SUMSQ: tl.constexpr = 0, SCALED: tl.constexpr = 0):
    # token tiles vary fastest, so the programs sharing a W column tile run together and W is read from HBM once
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    tile = pid % tiles
    pid_k = pid // tiles  # split-K run (0 without split-K)
    pid_m = tile % num_m
    pid_n = tile // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    if W_PRELOAD > 0:  # the W tile (a large one's first chunks) now, while the predecessor runs (never written)
        w_pre = preload_w(w_cols, ks, col_ok, K, BLOCK_K, W_PRELOAD)
    elif not W12:
        prefetch_rows(w_ptr + tl.minimum(cols, N - 1).to(tl.int64) * K, K, PDL, PF_LINES)
    wait_for_predecessor(PDL)  # x and the residual come from the previous kernel
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if EARLY_RES:  # their L2 latency overlaps the K loop instead of following it
        bias, r = _epilogue_inputs(b_ptr, r_ptr, offs, cols, row_ok, col_ok, HAS_BIAS, HAS_RES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    if W_PRELOAD > 0:  # every x chunk loaded before the first dot (one L2 trip), then the same dot chain
        xs = ()
        for c in tl.static_range(W_PRELOAD):
            xs = xs + (_x_chunk(x_rows, c * BLOCK_K + ks, row_ok, K, SWIGLU),)
        for c in tl.static_range(W_PRELOAD):
            acc = tile_mac(xs[c], w_pre[c], acc, DOT_PREC, BLOCK_M)
        k_lo = W_PRELOAD * BLOCK_K  # a large tile's K loop takes the chunks it did not preload
    if W12:  # W12 weights (w12_tile.py): 256-element blocks, each eight 32-wide dots in ascending K
        w_rows, b2, cells = oct_cols(base_ptr, cols, col_ok, Kp)
        k_end = tl.minimum(K, k_lo + K_SPLIT)
        k_full = k_lo + (k_end - k_lo) // OCT_BLOCK * OCT_BLOCK
        f = oct_cell(fcell_ptr, cells, col_ok, k_lo, Kp)  # each block's cells loaded one iteration ahead (oct_cell)
        for k0 in range(k_lo, k_full, OCT_BLOCK):  # whole blocks: a body without branches, which Triton pipelines
            f_next = oct_cell(fcell_ptr, cells, col_ok, k0 + OCT_BLOCK, Kp)
            acc = _w12_block_mac(acc, x_rows, words_ptr, codes_ptr, fat_ptr, w_rows, b2, f, col_ok, row_ok, k0, K,
                                 Kp, SWIGLU, DOT_PREC, BLOCK_M, False)
            f = f_next
        if k_full < k_end:  # K's tail block, its padding slices skipped
            acc = _w12_block_mac(acc, x_rows, words_ptr, codes_ptr, fat_ptr, w_rows, b2, f, col_ok, row_ok, k_full,
                                 K, Kp, SWIGLU, DOT_PREC, BLOCK_M, True)
    elif K_LOOP:  # 0: the whole tile was preloaded
        for k0 in range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = _x_chunk(x_rows, kk, row_ok, K, SWIGLU)
            wm = k_ok[:, None] & col_ok[None, :]
            w = tl.load(w_cols + kk[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tile_mac(a, w, acc, DOT_PREC, BLOCK_M)
    release_successor(PDL)
    acc, _, last = split_k_combine(acc, acc, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K, False, BLOCK_M, BLOCK_N)
    if not EARLY_RES:
        bias, r = _epilogue_inputs(b_ptr, r_ptr, offs, cols, row_ok, col_ok, HAS_BIAS, HAS_RES)
    if HAS_BIAS:
        acc += bias[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    om = row_ok[:, None] & col_ok[None, :] & last
    if HAS_RES:
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=om)
    if ROW_SUMSQ:  # for the norm launch that reads these rows next (rmsnorm.py, producer statistics)
        store_row_sumsq(ss_ptr, y, rows, pid_n, row_ok & last, N, BLOCK_M, BLOCK_N)
    if SCALED:  # y times that launch's norm weight, its operand with post_scale (rmsnorm.scaled_rows_ref)
        sw = tl.load(sw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(g_ptr + offs, (y.to(tl.float32) * sw[None, :]).to(g_ptr.dtype.element_ty), mask=om)


def linear_ref(x: torch.Tensor, W: torch.Tensor, residual: torch.Tensor | None = None, *,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch: round(x @ W.T + bias) in out_dtype (default x.dtype), then + residual in out_dtype."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype == x.dtype:
        y = torch.nn.functional.linear(x, W, bias)
    else:
        y = torch.nn.functional.linear(x.float(), W.float(), None if bias is None else bias.float()).to(out_dtype)
    return y if residual is None else y + residual


def swiglu_linear_ref(gate_up: torch.Tensor, W: torch.Tensor, residual: torch.Tensor | None = None, *,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return linear_ref(swiglu_ref(gate_up), W, residual, bias=bias, out_dtype=out_dtype)


def _launch(x: torch.Tensor, W: torch.Tensor | W12Weight, residual, bias, out_dtype, out, swiglu: bool,
            block_n, num_warps: int, num_stages, block_k: int = BLOCK_K, row_tile: int = BLOCK_M,
            split_k: int = 1, early_residual: bool = True, w_preload: bool = False,
            grid_dependency: int | None = None, row_sumsq_out: torch.Tensor | None = None,
            scale_w: torch.Tensor | None = None, scaled_out: torch.Tensor | None = None,
            max_registers: int | None = None, tile_rows: int = BLOCK_M) -> torch.Tensor:
    rows_pp = LinearParams(block_n=block_n, num_warps=num_warps, num_stages=num_stages, block_k=block_k,
                           row_tile=row_tile, tile_rows=tile_rows, split_k=split_k, early_residual=early_residual,
                           w_preload=w_preload, grid_dependency=grid_dependency,
                           max_registers=max_registers).program_rows()
    xname = "gate_up" if swiglu else "x"
    check_tensor(xname, x, (None, None), ACT_DTYPES)
    dev, dt = x.device, x.dtype
    T = x.shape[0]
    K = x.shape[1] // 2 if swiglu else x.shape[1]
    if T < 1 or K < 1 or (swiglu and x.shape[1] % 2):
        raise ValueError(f"{xname} must be [T >= 1, {'2*I' if swiglu else 'K'}], got {list(x.shape)}")
    w_args, w12, N = weight_operand(W, K, dt, dev)
    check_split(split_k)
    out_dtype = dt if out_dtype is None else out_dtype
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"out_dtype must be one of {ACT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, (N,), dt, dev)
    if residual is not None:
        check_tensor("residual", residual, (T, N), out_dtype, dev)
    check_launchable(_linear_kernel, dev)
    out = check_out("out", out, (T, N), out_dtype, dev)
    bn = default_block_n(N, T, row_tile=rows_pp, w12=w12) if block_n is None else block_n
    if row_sumsq_out is not None:
        if N % STAT_SEGMENT:
            raise ValueError(f"row_sumsq_out needs N a multiple of {STAT_SEGMENT}, got {N}")
        check_tensor("row_sumsq_out", row_sumsq_out, (T, N // STAT_SEGMENT), torch.float32, dev)
    if (scale_w is None) != (scaled_out is None):
        raise ValueError("scale_w and scaled_out go together (y * scale_w stored to scaled_out)")
    if scale_w is not None:
        check_tensor("scale_w", scale_w, (N,), out_dtype, dev)
        check_tensor("scaled_out", scaled_out, (T, N), out_dtype, dev)
    stages = (default_num_stages(bn, x.element_size(), 2 if swiglu else 1, block_k=block_k, row_tile=rows_pp,
                                 w12=w12) if num_stages is None else num_stages)
    pdl = pdl_launch(dev, N, K, x.element_size(), grid_dependency)
    preload = preload_chunks(w_preload, w12, split_k, bn, K, block_k, x.element_size())
    launches = split_launches(dev, T, N, K, block_k, rows_pp, bn, split_k)
    check_w12_launch(w12, rows_pp, launches[0][5], K)
    for r0, r1, grid, ws, counters, per_split in launches:
        res = x if residual is None else residual[r0:r1]
        ss = ws if row_sumsq_out is None else row_sumsq_out[r0:r1]
        _linear_kernel[grid](x[r0:r1], *w_args, x if bias is None else bias, res, out[r0:r1], ws, counters, ss,
                             out if scale_w is None else scale_w, out if scaled_out is None else scaled_out[r0:r1],
                             r1 - r0, N, K, per_split, x.shape[1], SWIGLU=swiglu,
                             HAS_BIAS=bias is not None, HAS_RES=residual is not None, DOT_PREC=dot_precision(dt),
                             W12=w12, BLOCK_M=rows_pp, BLOCK_N=bn, BLOCK_K=block_k, SPLIT_K=split_k,
                             EARLY_RES=int(early_residual), W_PRELOAD=preload,
                             K_LOOP=int(preload < triton.cdiv(K, block_k)),
                             ROW_SUMSQ=int(row_sumsq_out is not None), SCALED=int(scale_w is not None),
                             num_warps=num_warps, num_stages=stages, **pdl, **register_cap(max_registers))
    return out


def linear(x: torch.Tensor, W: torch.Tensor | W12Weight, residual: torch.Tensor | None = None, *,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
           block_k: int = BLOCK_K, row_tile: int = BLOCK_M, split_k: int = 1,
           early_residual: bool = True, w_preload: bool = False, grid_dependency: int | None = None,
           row_sumsq_out: torch.Tensor | None = None, scale_w: torch.Tensor | None = None,
           scaled_out: torch.Tensor | None = None, max_registers: int | None = None,
           tile_rows: int = BLOCK_M) -> torch.Tensor:
    """y = x @ W.T (+ bias) (+ residual) for x [T, K] and W [N, K] (nn.Linear layout), both contiguous; W may be a
    W12 weight (an OctLayout, or a W12Tensor converted on each call; bf16 x), read ~1.52 bytes a weight and decoded in
    the kernel: the bits of linear(x, decode(W)).

    bias [N] has x's dtype; residual [T, N] and the result have out_dtype (default x.dtype). row_sumsq_out: a
    float32 [T, N / 16] tensor that gets the sums of squares of y's 16-column segments (rmsnorm.row_sumsq_ref), for
    a norm launch with producer_stat=True reading y next. scale_w [N] with scaled_out [T, N] (out_dtype): y * scale_w
    stored there too (rmsnorm.scaled_rows_ref), for a norm launch with post_scale=True and that norm weight.
    """
    return _launch(x, W, residual, bias, out_dtype, out, False, block_n, num_warps, num_stages, block_k, row_tile,
                   split_k, early_residual, w_preload, grid_dependency, row_sumsq_out, scale_w, scaled_out,
                   max_registers, tile_rows)


def swiglu_linear(gate_up: torch.Tensor, W: torch.Tensor | W12Weight, residual: torch.Tensor | None = None, *,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None, block_n: int | None = None, num_warps: int = 4,
                  num_stages: int | None = None, block_k: int = BLOCK_K, row_tile: int = BLOCK_M,
                  split_k: int = 1, early_residual: bool = True, w_preload: bool = False,
                  grid_dependency: int | None = None, row_sumsq_out: torch.Tensor | None = None,
                  max_registers: int | None = None, tile_rows: int = BLOCK_M) -> torch.Tensor:
    """(silu(gate) * up) @ W.T (+ bias) (+ residual) for gate_up [T, 2I] = [gate ; up] and W [N, I].

    Bit-identical to linear(swiglu(gate_up), W, ...), but every column-tile program recomputes the activation of
    its 16-row tile, N / block_n times the work of `swiglu`: on an H200 at Llama-3-8B's down_proj it took 199 us
    at T=1 against 1.3 + 37.6 us for swiglu + linear. Prefer the two launches unless N / block_n is small.
    """
    return _launch(gate_up, W, residual, bias, out_dtype, out, True, block_n, num_warps, num_stages, block_k,
                   row_tile, split_k, early_residual, w_preload, grid_dependency, row_sumsq_out,
                   max_registers=max_registers, tile_rows=tile_rows)
