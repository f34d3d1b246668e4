"""The whole decode/verify step of a small Llama as one persistent kernel: every layer's launches run inside it.

At SmolLM2-135M shapes a step is 180 launches of 2-7 us that each move ~1 MB: launch and first-load latency, not
bytes, set the step time (0.83 ms with PDL against a 0.063 ms weight-bandwidth floor). Here a grid of one program
per SM walks the step's stages (per layer: norm + QKV + rotary + cache write, attention split, o_proj + residual,
norm + gate_up + SwiGLU, down + residual; then the LM head + argmax). Each stage's work items are exactly the
programs of that stage's launch, executed by the same per-program bodies (linear_program, rmsnorm_linear_program,
attn_split_program, attn_combine_row, argmax_combine_row) with the same reduction-order parameters, so every
output has the bits the launches give, and AR steps through this kernel agree with verifies through the launches.

Between stages a program waits (spinning on an arrival counter) only for the stage it reads: each program that
worked on a stage counts one arrival after its stores; attention's combine runs in the last split of each
(row tile, kv head) to arrive, as split-K does (gemm.split_k_combine). Before its first wait of a layer each
program asks L2 for its share of the next layer's weights (weights are never written), so the stages read them
from L2, not HBM. Deadlock freedom needs every program resident at once: one program per SM, no other kernel
running beside it. The interpreter runs programs one after another, so on CPU each stage is its own launch
(grid_sync=False): the same bodies, no spinning.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ._common import BLOCK_M, NO_FP_FUSION, check_launchable, check_tensor, dot_precision
from .attn import LOG2E, SPLIT_GROUP, attn_combine_row, attn_split_program
from .gemm import linear_program
from .norm_gemm import argmax_combine_row, rmsnorm_linear_program

STAGES_PER_LAYER = 5  # qkv, attention, o_proj, gate_up, down; the LM head is stage 5 * layers


@dataclasses.dataclass(frozen=True)
class StackedLlama:
    """A Llama's weights with one tensor per kind, layer-major ([L, ...]), so the step kernel indexes a layer by
    offset. eps, heads, kv_heads, head_dim: the shape the kernel needs beyond the tensors' sizes."""
    qkv: torch.Tensor  # [L, (heads + 2 kv_heads) * D, hidden]
    ln1: torch.Tensor  # [L, hidden]
    o: torch.Tensor  # [L, hidden, heads * D]
    ln2: torch.Tensor  # [L, hidden]
    gate_up: torch.Tensor  # [L, 2 I, hidden]: gate rows then up rows
    down: torch.Tensor  # [L, hidden, I]
    norm: torch.Tensor  # [hidden]
    head: torch.Tensor  # [vocab, hidden]
    eps: float
    heads: int
    kv_heads: int

    def __post_init__(self) -> None:
        L, n_qkv, hidden = self.qkv.shape
        dt, dev = self.qkv.dtype, self.qkv.device
        if self.heads % self.kv_heads or n_qkv % (self.heads + 2 * self.kv_heads):
            raise ValueError(f"qkv rows {n_qkv} do not split into heads={self.heads}, kv_heads={self.kv_heads}")
        D = n_qkv // (self.heads + 2 * self.kv_heads)
        inter = self.down.shape[2] if self.down.dim() == 3 else -1
        for name, shape in (("qkv", (L, n_qkv, hidden)), ("ln1", (L, hidden)), ("o", (L, hidden, self.heads * D)),
                            ("ln2", (L, hidden)), ("gate_up", (L, 2 * inter, hidden)), ("down", (L, hidden, inter)),
                            ("norm", (hidden,)), ("head", (None, hidden))):
            check_tensor(name, getattr(self, name), shape, dt, dev)

    @property
    def head_dim(self) -> int:
        return self.qkv.shape[1] // (self.heads + 2 * self.kv_heads)


@triton.jit
def _prefetch_share(ptr, n_elems, pid, NPROG: tl.constexpr, PF: tl.constexpr):
    """Program pid asks L2 for its contiguous 1/NPROG of the n_elems at ptr, 128-byte line by line (a hint: it
    changes no value)."""
    if PF:
        EPL: tl.constexpr = 128 // (ptr.dtype.element_ty.primitive_bitwidth // 8)
        n_lines = tl.cdiv(n_elems, EPL)
        per = tl.cdiv(n_lines, NPROG)
        for l0 in range(pid * per, tl.minimum(pid * per + per, n_lines), 256):
            ln = tl.minimum(l0 + tl.arange(0, 256), n_lines - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptr + ln.to(tl.int64) * EPL],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence(x, FENCE: tl.constexpr):
    """Every thread: fence.acq_rel.gpu, so its own earlier stores are visible GPU-wide before its later memory
    operations, and its later loads miss any stale L1 line (a program re-reads, one stage later, activations it read
    before other SMs rewrote them; an acquire by one thread alone left such lines in use on an H200)."""
    if FENCE:
        x = tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


FLAG_STRIDE = 8  # int32s between two programs' progress flags: one 32-byte sector each, no shared writes


@triton.jit
def _stamp(trace_ptr, pid, s, k: tl.constexpr, N_ST: tl.constexpr, TRACE: tl.constexpr):
    """Diagnostics: trace[pid, s, k] = the GPU's global nanosecond timer (k: 0 stage start, 1 after the wait,
    2 published)."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [tl.zeros([1], dtype=tl.int32)],
                                      dtype=tl.int64, is_pure=False, pack=1)
        tl.store(trace_ptr + (pid * N_ST + s) * 3 + k + tl.arange(0, 1), t)


@triton.jit
def _publish(flags_ptr, pid, done, FENCE: tl.constexpr, STRIDE: tl.constexpr):
    """This program has finished stages < done: every thread's stores are made visible, then its flag is set."""
    f = _fence(tl.zeros([1], dtype=tl.int32), FENCE)
    tl.debug_barrier()
    tl.atomic_xchg(flags_ptr + pid * STRIDE, done + tl.sum(f, axis=0), sem="release")


@triton.jit
def _wait_all(flags_ptr, stage, GRID_SYNC: tl.constexpr, FENCE: tl.constexpr, NPROG: tl.constexpr,
              NP2: tl.constexpr, STRIDE: tl.constexpr,
        N_ST: tl.constexpr = 1, TRACE: tl.constexpr = False):
    """Spins until every program has finished the stages < `stage` (one load of all flags per poll: no atomic
    on a shared counter), then fences: their stores are visible to every thread here."""
    if GRID_SYNC:
        i = tl.arange(0, NP2)
        m = tl.min(tl.load(flags_ptr + i * STRIDE, mask=i < NPROG, other=2147483647, volatile=True), axis=0)
        while m < stage:
            m = tl.min(tl.load(flags_ptr + i * STRIDE, mask=i < NPROG, other=2147483647, volatile=True), axis=0)
        tl.debug_barrier()
        _fence(tl.zeros([1], dtype=tl.int32) + m, FENCE)
        tl.debug_barrier()


@triton.jit(do_not_specialize=["T", "STAGE_LO", "STAGE_HI"])
def _decode_step_kernel(
        x_ptr, q_ptr, o_ptr, act_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, att_cnt_ptr, flags_ptr,
        pos_ptr, slot_ptr, base_ptr, anc_ptr, bslot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
        wqkv_ptr, ln1_ptr, wo_ptr, ln2_ptr, wgu_ptr, wd_ptr, lnf_ptr, whead_ptr,
        logits_ptr, pmax_ptr, pidx_ptr, argmax_ptr, feat_ptr, cap_ptr, trace_ptr,
        T, S, max_pos, A, eps, qk_scale, STAGE_LO, STAGE_HI,
        L: tl.constexpr, HID: tl.constexpr, HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
        INTER: tl.constexpr, VOCAB: tl.constexpr,
        BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
        BN_HEAD: tl.constexpr, BK_HEAD: tl.constexpr, ATT_BN: tl.constexpr, ATT_SPLIT: tl.constexpr,
        HAS_SLOTS: tl.constexpr, STORE_LOGITS: tl.constexpr, N_CAP: tl.constexpr, DOT_PREC: tl.constexpr, NPROG: tl.constexpr,
        GRID_SYNC: tl.constexpr, FENCE: tl.constexpr, PF: tl.constexpr, BLOCK_T: tl.constexpr, _STAGES: tl.constexpr,
        _BLOCK_M: tl.constexpr, _SPLIT_GROUP: tl.constexpr, NP2: tl.constexpr, STRIDE: tl.constexpr,
        N_ST: tl.constexpr = 1, TRACE: tl.constexpr = False):
    pid = tl.program_id(0)
    G: tl.constexpr = HEADS // KVH
    QD: tl.constexpr = HEADS * D
    N_QKV: tl.constexpr = (HEADS + 2 * KVH) * D
    m_tiles = tl.cdiv(T, _BLOCK_M)
    base = tl.load(base_ptr).to(tl.int32)
    n_live = tl.cdiv(tl.minimum(base + T, S), ATT_SPLIT)  # key splits holding context (attn.py's combine count)
    n_att_m = T * tl.cdiv(G, _BLOCK_M) if HAS_SLOTS else tl.cdiv(T * G, _BLOCK_M)
    kv_layer = KVH * S * D
    if STAGE_LO == 0:
        _prefetch_share(wqkv_ptr, N_QKV * HID, pid, NPROG, PF)
    for s in range(STAGE_LO, STAGE_HI):
        _stamp(trace_ptr, pid, s, 0, N_ST, TRACE)
        layer = s // _STAGES
        kind = s % _STAGES
        if s == L * _STAGES:  # LM head: norm + projection with the argmax in its epilogue
            items = m_tiles * tl.cdiv(VOCAB, BN_HEAD)
            if pid < items:
                _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for v in range(pid, items, NPROG):
                    rmsnorm_linear_program(v, x_ptr, x_ptr, lnf_ptr, whead_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr,
                                           x_ptr, 1, x_ptr, logits_ptr, x_ptr, pmax_ptr, pidx_ptr, flags_ptr, flags_ptr,
                                           x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 1, 1, T, VOCAB, HID,
                                           tl.cdiv(HID, BK_HEAD) * BK_HEAD, eps, False, False, DOT_PREC, False,
                                           STORE_LOGITS, True, 0, 1, 1, 1, _BLOCK_M, BN_HEAD, BK_HEAD, 1, 0, 0)
        elif s == L * _STAGES + 1:  # each row's winner over the LM head's column tiles
            if pid == 0:
                _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for row in range(0, T):
                    argmax_combine_row(row, pmax_ptr, pidx_ptr, argmax_ptr, tl.cdiv(VOCAB, BN_HEAD), BLOCK_T)
        elif kind == 0:  # norm + QKV, rotary, k/v into the cache
            _prefetch_share(wo_ptr + layer * HID * QD, HID * QD, pid, NPROG, PF)
            _prefetch_share(wgu_ptr + layer * 2 * INTER * HID, 2 * INTER * HID, pid, NPROG, PF)
            _prefetch_share(wd_ptr + layer * HID * INTER, HID * INTER, pid, NPROG, PF)
            if layer + 1 < L:
                _prefetch_share(wqkv_ptr + (layer + 1) * N_QKV * HID, N_QKV * HID, pid, NPROG, PF)
            items = m_tiles * tl.cdiv(N_QKV, BN_QKV)
            if pid < items:
                if s > 0:
                    _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                    _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for v in range(pid, items, NPROG):
                    rmsnorm_linear_program(v, x_ptr, x_ptr, ln1_ptr + layer * HID, wqkv_ptr + layer * N_QKV * HID,
                                           x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 1, x_ptr, q_ptr, x_ptr, x_ptr,
                                           x_ptr, flags_ptr, flags_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                                           kc_ptr + layer * kv_layer, vc_ptr + layer * kv_layer, S, max_pos, T,
                                           N_QKV, HID, tl.cdiv(HID, BK_QKV) * BK_QKV, eps, False, False, DOT_PREC,
                                           False, True, False, 2, HEADS, KVH, D // 2, _BLOCK_M, BN_QKV, BK_QKV, 1, 0,
                                           0)
        elif kind == 1:  # attention: split pass; the last split of a (row tile, kv head) combines its rows
            items = n_att_m * KVH * n_live
            if pid < items:
                _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for v in range(pid, items, NPROG):
                    split = v % n_live
                    tile = v // n_live  # = pid_m * KVH + kvh
                    kvh = tile % KVH
                    pid_m = tile // KVH
                    attn_split_program(pid_m, kvh, split, q_ptr, kc_ptr + layer * kv_layer,
                                       vc_ptr + layer * kv_layer, anc_ptr, base_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr,
                                       bslot_ptr, T, 0, S, A, qk_scale, HEADS, G, D, True, DOT_PREC, _BLOCK_M,
                                       ATT_BN, ATT_SPLIT, HAS_SLOTS)
                    f = _fence(tl.zeros([1], dtype=tl.int32), FENCE)
                    tl.debug_barrier()
                    if tl.atomic_add(att_cnt_ptr + tile, 1 + tl.sum(f, axis=0), sem="acq_rel") == n_live - 1:
                        tl.atomic_xchg(att_cnt_ptr + tile, 0)
                        _fence(f, FENCE)
                        for i in range(0, _BLOCK_M):
                            if HAS_SLOTS:  # rows of one token's G heads (attn.py's HAS_SLOTS tiling)
                                g = (pid_m % tl.cdiv(G, _BLOCK_M)) * _BLOCK_M + i
                                row = (pid_m // tl.cdiv(G, _BLOCK_M)) * HEADS + kvh * G + g
                                ok = g < G
                            else:  # rows (token, head of the group) in token-major order
                                r = pid_m * _BLOCK_M + i
                                row = (r // G) * HEADS + kvh * G + r % G
                                ok = r < T * G
                            if ok:
                                attn_combine_row(row, ws_m_ptr, ws_l_ptr, ws_o_ptr, o_ptr, base_ptr, T, 0, S, HEADS,
                                                 D, True, ATT_SPLIT, _SPLIT_GROUP)
        elif kind == 2:  # o_proj + residual, in place on the stream (each program owns its columns)
            items = m_tiles * tl.cdiv(HID, BN_O)
            if pid < items:
                _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for v in range(pid, items, NPROG):
                    linear_program(v, o_ptr, wo_ptr + layer * HID * QD, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 1,
                                   x_ptr, x_ptr, x_ptr, flags_ptr, flags_ptr, T, HID, QD, tl.cdiv(QD, BK_O) * BK_O, QD,
                                   False, False, True, DOT_PREC, False, _BLOCK_M, BN_O, BK_O, 1, 0, 0)
        elif kind == 3:  # norm + gate_up + SwiGLU
            items = m_tiles * tl.cdiv(INTER, BN_GU)
            if pid < items:
                _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for v in range(pid, items, NPROG):
                    rmsnorm_linear_program(v, x_ptr, x_ptr, ln2_ptr + layer * HID, wgu_ptr + layer * 2 * INTER * HID,
                                           x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 1, x_ptr, act_ptr, x_ptr, x_ptr,
                                           x_ptr, flags_ptr, flags_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 1, 1,
                                           T, INTER, HID, tl.cdiv(HID, BK_GU) * BK_GU, eps, False, False, DOT_PREC,
                                           False, True, False, 1, 1, 1, 1, _BLOCK_M, BN_GU, BK_GU, 1, 0, 0)
        else:  # down + residual, in place on the stream
            items = m_tiles * tl.cdiv(HID, BN_D)
            if pid < items:
                _wait_all(flags_ptr, s, GRID_SYNC, FENCE, NPROG, NP2, STRIDE)
                _stamp(trace_ptr, pid, s, 1, N_ST, TRACE)
                for v in range(pid, items, NPROG):
                    linear_program(v, act_ptr, wd_ptr + layer * HID * INTER, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr,
                                   x_ptr, 1, x_ptr, x_ptr, x_ptr, flags_ptr, flags_ptr, T, HID, INTER,
                                   tl.cdiv(INTER, BK_D) * BK_D, INTER, False, False, True, DOT_PREC, False, _BLOCK_M,
                                   BN_D, BK_D, 1, 0, 0)
                if N_CAP > 0:  # a captured layer: its output tiles also go to the features (block drafters)
                    slot = tl.load(cap_ptr + layer)
                    if slot >= 0:
                        tl.debug_barrier()  # this program's stream stores are visible to all its threads
                        for v in range(pid, items, NPROG):
                            pid_m = v % m_tiles
                            cols = (v // m_tiles) * BN_D + tl.arange(0, BN_D)
                            rows = pid_m * _BLOCK_M + tl.arange(0, _BLOCK_M)
                            ok = (rows < T)[:, None] & (cols < HID)[None, :]
                            h = tl.load(x_ptr + rows[:, None] * HID + cols[None, :], mask=ok)
                            tl.store(feat_ptr + rows[:, None] * (N_CAP * HID) + slot * HID + cols[None, :], h, mask=ok)
        _publish(flags_ptr, pid, s + 1, FENCE, STRIDE)  # with or without work items in it
        _stamp(trace_ptr, pid, s, 2, N_ST, TRACE)


@functools.lru_cache(maxsize=64)
def _capture_slots(cap: tuple[int, ...], layers: int, device: torch.device) -> torch.Tensor:
    """[layers] int32 on the device: each captured layer's feature slot, -1 elsewhere. Cached: made by the first
    (warm-up) call, never by a CUDA-graph capture, which forbids host-to-device copies."""
    slots = torch.full((layers,), -1, dtype=torch.int32)
    slots[list(cap)] = torch.arange(len(cap), dtype=torch.int32)
    return slots.to(device)


def persistent_step(x: torch.Tensor, w: StackedLlama, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    base: torch.Tensor, anc: torch.Tensor, *, block_slots: torch.Tensor | None = None,
                    block_k: dict[str, int], block_n: dict[str, int], attention: dict[str, int],
                    programs: int, store_logits: bool = False, capture: tuple[int, ...] = (), num_warps: int = 4,
                    num_stages: int = 2, grid_sync: bool | None = None, prefetch: bool | None = None,
                    trace: torch.Tensor | None = None):
    """One forward of T tokens through every layer and the LM head: (logits fp32 [T, V] or None, argmax [T],
    features [T, len(capture) * hidden] or None: the outputs of the layers in `capture`, in layer order).

    x [T, hidden]: the embedded tokens, overwritten with the final residual stream. k_cache, v_cache
    [L, kv_heads, S, D]; positions, slots int64 [T]; base int [1] on the device; anc [T, T] bool; block_slots as
    in attention(). block_k (qkv, o_proj, gate_up, down, lm_head) and attention (block_n, split_keys) set the
    reduction order: pass the launches' values to get their bits. block_n (T-neutral): column tile per work item.
    programs: the grid (at most one per SM with grid_sync). grid_sync (default: on CUDA) runs the stages in one
    launch; off, one launch per stage (the interpreter, which runs programs one after another)."""
    dev, dt = x.device, x.dtype
    check_tensor("x", x, (None, w.qkv.shape[2]), dt, w.qkv.device)
    T, hidden = x.shape
    L, D, H, KVH = w.qkv.shape[0], w.head_dim, w.heads, w.kv_heads
    check_tensor("k_cache", k_cache, (L, KVH, None, D), dt, dev)
    S = k_cache.shape[2]
    check_tensor("v_cache", v_cache, k_cache.shape, dt, dev)
    check_tensor("positions", positions, (T,), torch.int64, dev)
    check_tensor("slots", slots, (T,), torch.int64, dev)
    check_tensor("base", base, (1,), (torch.int32, torch.int64), dev)
    check_tensor("anc", anc, (T, T), torch.bool, dev)
    check_tensor("cos", cos, (None, D // 2), torch.float32, dev)
    check_tensor("sin", sin, cos.shape, torch.float32, dev)
    if block_slots is not None:
        check_tensor("block_slots", block_slots, (T, None), torch.int64, dev)
    for name in ("qkv", "o_proj", "gate_up", "down", "lm_head"):
        if block_k.get(name) not in (64, 128, 256, 512) or block_n.get(name) not in (16, 32, 64, 128):
            raise ValueError(f"{name}: block_k={block_k.get(name)!r} / block_n={block_n.get(name)!r} not supported")
    if attention["split_keys"] % attention["block_n"]:
        raise ValueError(f"attention split_keys={attention['split_keys']} must be a multiple of its block_n")
    grid_sync = dev.type == "cuda" if grid_sync is None else grid_sync
    if grid_sync and dev.type == "cuda" and programs > torch.cuda.get_device_properties(dev).multi_processor_count:
        raise ValueError(f"programs={programs} exceed the SMs: a grid-synchronised step would deadlock")
    check_launchable(_decode_step_kernel, dev)
    inter, vocab = w.down.shape[2], w.head.shape[0]
    n_split = triton.cdiv(S, attention["split_keys"])
    G = H // KVH
    n_att_m = T * triton.cdiv(G, BLOCK_M) if block_slots is not None else triton.cdiv(T * G, BLOCK_M)
    f32 = dict(dtype=torch.float32, device=dev)
    q, o = torch.empty(T, H * D, dtype=dt, device=dev), torch.empty(T, H * D, dtype=dt, device=dev)
    act = torch.empty(T, inter, dtype=dt, device=dev)
    ws_m, ws_l, ws_o = torch.empty(n_split * T * H, **f32), torch.empty(n_split * T * H, **f32), \
        torch.empty(n_split * T * H * D, **f32)
    att_cnt = torch.zeros(n_att_m * KVH, dtype=torch.int32, device=dev)
    flags = torch.zeros(programs * FLAG_STRIDE, dtype=torch.int32, device=dev)
    n_tiles = triton.cdiv(vocab, block_n["lm_head"])
    logits = torch.empty((T, vocab) if store_logits else (1, 1), **f32)
    pmax, pidx = torch.empty(T, n_tiles, **f32), torch.empty(T, n_tiles, dtype=torch.int32, device=dev)
    argmax = torch.empty(T, dtype=torch.int64, device=dev)
    cap = tuple(sorted(set(capture)))
    if cap and not 0 <= cap[0] <= cap[-1] < L:
        raise ValueError(f"capture={capture} names layers outside 0..{L - 1}")
    feats = torch.empty(T, len(cap) * hidden, dtype=dt, device=dev) if cap else x
    cap_slot = _capture_slots(cap, L, dev)
    n_stages = STAGES_PER_LAYER * L + 2  # the layers', the LM head, the argmax
    stages = [(0, n_stages)] if grid_sync else [(s, s + 1) for s in range(n_stages)]
    # on the GPU: a cooperative launch (all programs resident, or a launch error instead of a deadlock), and loads
    # that skip L1 (-dlcm=cg): a program re-reads activations that other SMs rewrote since it last read them
    gpu = {"launch_cooperative_grid": True, "ptx_options": "-dlcm=cg"} if grid_sync and dev.type == "cuda" else {}
    for lo, hi in stages:
        _decode_step_kernel[(programs,)](
            x, q, o, act, ws_m, ws_l, ws_o, att_cnt, flags, positions, slots, base, anc.view(torch.uint8),
            block_slots if block_slots is not None else positions, cos, sin, k_cache, v_cache,
            w.qkv, w.ln1, w.o, w.ln2, w.gate_up, w.down, w.norm, w.head, logits, pmax, pidx, argmax, feats, cap_slot,
            flags if trace is None else trace,
            T, S, cos.shape[0], 0 if block_slots is None else block_slots.shape[1], float(w.eps), LOG2E / D ** 0.5,
            lo, hi, L=L, HID=hidden, HEADS=H, KVH=KVH, D=D, INTER=inter, VOCAB=vocab,
            BN_QKV=block_n["qkv"], BK_QKV=block_k["qkv"], BN_O=block_n["o_proj"], BK_O=block_k["o_proj"],
            BN_GU=block_n["gate_up"], BK_GU=block_k["gate_up"], BN_D=block_n["down"], BK_D=block_k["down"],
            BN_HEAD=block_n["lm_head"], BK_HEAD=block_k["lm_head"], ATT_BN=attention["block_n"],
            ATT_SPLIT=attention["split_keys"], HAS_SLOTS=block_slots is not None, STORE_LOGITS=store_logits,
            N_CAP=len(cap),            DOT_PREC=dot_precision(dt), NPROG=programs, GRID_SYNC=grid_sync, FENCE=dev.type == "cuda",
            PF=dev.type == "cuda" if prefetch is None else prefetch, BLOCK_T=triton.next_power_of_2(n_tiles),
            _STAGES=STAGES_PER_LAYER, _BLOCK_M=BLOCK_M, _SPLIT_GROUP=SPLIT_GROUP,
            NP2=triton.next_power_of_2(programs), STRIDE=FLAG_STRIDE, N_ST=n_stages, TRACE=trace is not None, num_warps=num_warps, num_stages=num_stages,
            **NO_FP_FUSION, **gpu)
    return (logits if store_logits else None), argmax, (feats if cap else None)
