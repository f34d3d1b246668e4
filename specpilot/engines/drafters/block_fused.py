"""The block drafter's run-time step on the engine's fused Triton kernels (targets on KernelBackend.TRITON).

BlockStep reproduces the trainer's reference bit for bit and so runs ~108 small ops a draft: inside a CUDA graph on
an H200 that took 0.42 ms, half a SmolLM2 target step, for a 2-layer drafter. Drafts are only proposals
(verification decides), so this step trades those bits for launches: per layer norm+QKV (one GEMM over q|k|v) with
the q/k norms, rotary and the block's cache write in a launch of their own (`qk_norm_rope` below: moved into the
QKV launch's epilogue, with a head a tile, the step gained nothing on an H100, session 51), attention, o_proj+residual,
norm+gate_up+SwiGLU, down+residual; then norm+LM head and the top-k. ~18 launches a draft; an observe is the fc
GEMM, one norm+GEMM for every layer's context keys/values, and one `kv_norm_rope_layers` for all layers.
Same cache layout, inputs and outputs as BlockStep, so the drafter and the device loop use either.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from specpilot.engines.config import DrafterLaunches, DrafterTopk
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.drafters.block_step import check_window
from specpilot.kernels import attention, linear, rmsnorm_linear, rope_tables
from specpilot.kernels._common import ACT_DTYPES, check_launchable, check_out, check_tensor, next_pow2
from specpilot.kernels.embed import embedding
from specpilot.kernels.gemm import LinearParams
from specpilot.kernels.norm_gemm import RMSNormLinearParams
from specpilot.kernels.norm_epilogues import rmsnorm_glu
from specpilot.kernels.pdl import pdl_launch, release_successor, wait_for_predecessor
from specpilot.kernels.rope_kv import check_qk_norms, check_rope_rows
from specpilot.kernels.table import check_invariance, launch_params
from specpilot.kernels.topk import BLOCK as TOPK_BLOCK
from specpilot.kernels.topk import check_chunk, merge_topk, topk_probs


@triton.jit
def _qk_norm_rope_kernel(x_ptr, row_stride, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps, q_ptr, k_ptr,
                         v_ptr, S, layer_stride, H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
                         QK_NORM: tl.constexpr, CONSECUTIVE: tl.constexpr = False, LAYERS: tl.constexpr = 1,
                         PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the rows are the QKV launch's
    t = tl.program_id(0)
    hh = tl.program_id(1)  # 0..H-1: q heads; H..H+KVH-1: k and v heads (of each layer's columns, LAYERS > 1)
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)
    if LAYERS > 1:  # context keys/values of every layer at once (H == 0): layer l's columns, cache and k norm
        layer = hh // KVH
        hh = hh % KVH
        x_ptr += layer * (2 * KVH * D)
        kn_ptr += layer * D
        k_ptr += layer.to(tl.int64) * layer_stride
        v_ptr += layer.to(tl.int64) * layer_stride
    if CONSECUTIVE:  # row t at position pos_ptr[0] + t, written to that slot
        pos = tl.load(pos_ptr) + t
    else:
        pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * HALF + i)
    s = tl.load(sin_ptr + pos * HALF + i)
    src = x_ptr + t.to(tl.int64) * row_stride + hh * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    if QK_NORM:  # llama.RMSNorm: normalise in fp32, round to the dtype, times the weight, round again
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        is_q = hh < H
        w1 = tl.where(is_q, tl.load(qn_ptr + i), tl.load(kn_ptr + i)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + HALF + i), tl.load(kn_ptr + HALF + i)).to(tl.float32)
        dt = q_ptr.dtype.element_ty
        x1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = (x1 * c - x2 * s).to(q_ptr.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(q_ptr.dtype.element_ty)
    if hh < H:
        dst = q_ptr + (t.to(tl.int64) * H + hh) * D
        tl.store(dst + i, o1)
        tl.store(dst + HALF + i, o2)
    else:
        slot = pos if CONSECUTIVE else tl.load(slot_ptr + t)
        row = ((hh - H) * S + slot).to(tl.int64) * D
        tl.store(k_ptr + row + i, o1)
        tl.store(k_ptr + row + HALF + i, o2)
        vsrc = src + KVH * D
        tl.store(v_ptr + row + i, tl.load(vsrc + i))
        tl.store(v_ptr + row + HALF + i, tl.load(vsrc + HALF + i))
    release_successor(PDL)


def _check_qk(x, heads, kv_heads, positions, slots, cos, k_cache, v_cache, q_norm, k_norm, consecutive=False):
    check_tensor("k_cache", k_cache, (kv_heads, None, None), ACT_DTYPES)
    dev, dt = k_cache.device, k_cache.dtype
    S, D = k_cache.shape[1:]
    if D < 8 or D & (D - 1):
        raise ValueError(f"head_dim={D} must be a power of two >= 8")
    check_tensor("v_cache", v_cache, (kv_heads, S, D), dt, dev)
    check_tensor("x", x, (None, None), dt, dev, contiguous=False)
    if x.stride(1) != 1 or x.shape[1] < (heads + 2 * kv_heads) * D:
        raise ValueError(f"x rows must hold {heads} q, {kv_heads} k and {kv_heads} v heads of {D} contiguously, got "
                         f"shape {list(x.shape)} strides {x.stride()}")
    T = x.shape[0]
    check_rope_rows(positions, slots, T, consecutive, dev)
    check_tensor("cos", cos, (None, D // 2), torch.float32, dev)
    check_qk_norms(q_norm, k_norm, D, dt, dev)
    return T, S, D


def qk_norm_rope(x: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor, slots: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                 consecutive: bool = False) -> torch.Tensor | None:
    """Rows of x [T, >= (heads + 2 kv_heads) * D] (unit column stride, any row stride) hold [q heads; k heads;
    v heads]. Each q and k head is RMS-normed with q_norm / k_norm [D] (when given) and rotated (rotate_half) at
    positions[t] (cos/sin fp32 [max_pos, D/2]); k and v go to k_cache / v_cache [kv_heads, S, D] at slots[t].
    consecutive: positions is [1] and row t sits at positions[0] + t, in that slot (slots None): the draft's block,
    without a launch adding the offsets. Returns q [T, heads, D], or None for heads == 0 (context keys/values only).
    Positions and slots must be in range: they are not checked on the device (no host sync)."""
    T, S, D = _check_qk(x, heads, kv_heads, positions, slots, cos, k_cache, v_cache, q_norm, k_norm, consecutive)
    check_tensor("sin", sin, cos.shape, torch.float32, x.device)
    check_launchable(_qk_norm_rope_kernel, x.device)
    q = check_out("q", None, (T, heads, D), x.dtype, x.device) if heads else None
    norm = q_norm is not None
    _qk_norm_rope_kernel[(T, heads + kv_heads)](
        x, x.stride(0), positions, positions if consecutive else slots, cos, sin, q_norm if norm else cos,
        k_norm if norm else cos, float(eps), k_cache if q is None else q, k_cache, v_cache, S, 0, H=heads,
        KVH=kv_heads, HALF=D // 2, QK_NORM=norm, CONSECUTIVE=consecutive, num_warps=1,
        **pdl_launch(x.device))
    return q


def qk_norm_rope_ref(x, heads, kv_heads, positions, slots, cos, sin, k_cache, v_cache, q_norm=None, k_norm=None,
                     eps=1e-6, consecutive=False):
    """Plain torch, the kernel's arithmetic: fp32 norm and rotary, rounded to the dtype where the kernel rounds."""
    T, S, D = _check_qk(x, heads, kv_heads, positions, slots, cos, k_cache, v_cache, q_norm, k_norm, consecutive)
    if consecutive:
        positions = slots = positions + torch.arange(T, device=positions.device)
    dt = x.dtype
    h = x[:, :(heads + 2 * kv_heads) * D].reshape(T, heads + 2 * kv_heads, D).float()
    qk = h[:, :heads + kv_heads]
    if q_norm is not None:
        w = torch.cat([q_norm.expand(heads, D), k_norm.expand(kv_heads, D)]).float()
        qk = ((qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)).to(dt).float() * w).to(dt).float()
    c, s = cos[positions][:, None], sin[positions][:, None]
    x1, x2 = qk[..., :D // 2], qk[..., D // 2:]
    rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(dt)
    k_cache[:, slots] = rot[:, heads:].transpose(0, 1)
    v_cache[:, slots] = h[:, heads + kv_heads:].to(dt).transpose(0, 1)
    return rot[:, :heads] if heads else None


def kv_norm_rope_layers(x: torch.Tensor, kv_heads: int, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, k_norm: torch.Tensor | None = None,
                        eps: float = 1e-6, positions: torch.Tensor | None = None) -> None:
    """qk_norm_rope's context keys/values (no q heads) of L layers in one launch: rows of x [n, >= L * 2 kv_heads * D]
    hold [k_0; v_0; k_1; v_1; ...]; layer l's k heads are normed with k_norm[l] ([L, D], when given), rotated at
    positions[t] (default: slots[t]) and, with its v heads, written to k_cache[l] / v_cache[l] ([L, kv_heads, S, D]:
    each layer contiguous, any layer stride, the same for both) at slots[t]. The bits of one qk_norm_rope a layer."""
    positions = slots if positions is None else positions
    check_tensor("k_cache", k_cache, (None, kv_heads, None, None), ACT_DTYPES, contiguous=False)
    L = k_cache.shape[0]
    if not (k_cache[0].is_contiguous() and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()):
        raise ValueError(f"k_cache / v_cache must be [L, {kv_heads}, S, D] with contiguous layers and equal strides")
    if k_norm is not None:
        check_tensor("k_norm", k_norm, (L, k_cache.shape[-1]), k_cache.dtype, k_cache.device)
    n = x.shape[0]
    D = k_cache.shape[-1]
    if x.dim() != 2 or x.shape[1] < L * 2 * kv_heads * D:
        raise ValueError(f"x rows must hold {L} layers' {kv_heads} k and {kv_heads} v heads of {D}, got shape "
                         f"{list(x.shape)}")
    _check_qk(x, 0, kv_heads, positions, slots, cos, k_cache[0], v_cache[0], None if k_norm is None else k_norm[0],
              None if k_norm is None else k_norm[0])
    check_tensor("sin", sin, cos.shape, torch.float32, x.device)
    check_launchable(_qk_norm_rope_kernel, x.device)
    norm = k_norm is not None
    _qk_norm_rope_kernel[(n, L * kv_heads)](
        x, x.stride(0), positions, slots, cos, sin, k_norm if norm else cos, k_norm if norm else cos, float(eps),
        k_cache, k_cache, v_cache, k_cache.shape[2], k_cache.stride(0), H=0, KVH=kv_heads, HALF=D // 2,
        QK_NORM=norm, LAYERS=L, num_warps=1, **pdl_launch(x.device))


def kv_norm_rope_layers_ref(x, kv_heads, slots, cos, sin, k_cache, v_cache, k_norm=None, eps=1e-6, positions=None):
    """Plain torch: qk_norm_rope_ref of each layer's columns."""
    width = 2 * kv_heads * k_cache.shape[-1]
    for layer in range(k_cache.shape[0]):
        kn = None if k_norm is None else k_norm[layer]
        qk_norm_rope_ref(x[:, layer * width:], 0, kv_heads, slots if positions is None else positions, slots, cos,
                         sin, k_cache[layer], v_cache[layer], kn, kn, eps)


@dataclasses.dataclass(frozen=True)
class DraftLaunches:
    """The fused step's projection launches. A draft is a proposal (verification decides), so unlike the target's
    launches these may change the reduction order (down's split K). Defaults: the best of session 46's sweep on an
    H100 at the shipped drafter's shapes (`scripts/gpu_gemv_sweep.py --shape smollm2-drafter`, notes/h200.md: us in
    a CUDA graph, default -> these: gate_up 5.26 -> 4.99, down 7.14 -> 5.00, head 6.77 -> 5.94; qkv and o_proj
    within 1% of their defaults), ~5.5 us of a draft."""

    qkv: RMSNormLinearParams = RMSNormLinearParams()
    o_proj: LinearParams = LinearParams()
    gate_up: RMSNormLinearParams = RMSNormLinearParams(block_n=32, num_warps=4, num_stages=3)
    down: LinearParams = LinearParams(block_n=64, num_warps=4, num_stages=3, block_k=256, split_k=4)
    head: RMSNormLinearParams = RMSNormLinearParams(block_n=64, num_warps=4, num_stages=3)
    topk_block: int = TOPK_BLOCK  # logits a program of the top-k's first launch sorts (kernels.topk)
    # The head's epilogue ranks its column tiles (EngineConfig.drafter_topk: head) instead of a chunked top-k launch
    # over stored logits; drafters with a logit scale or softcap keep the launch.
    topk_in_head: bool = False
    # A kernel table (EngineConfig.kernel_table): its draft_<field>@NxK@T<rows> entries override these fields for the
    # drafter's shapes (`resolved`), so a step-level A/B or the tuner sets the drafter's launches like the target's.
    table: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_chunk(self.topk_block)
        object.__setattr__(self, "table", tuple(tuple(p) for p in self.table))
        check_invariance(self.table)
        for name, want in (("qkv", RMSNormLinearParams), ("o_proj", LinearParams), ("gate_up", RMSNormLinearParams),
                           ("down", LinearParams), ("head", RMSNormLinearParams)):
            if not isinstance(getattr(self, name), want):
                raise TypeError(f"DraftLaunches.{name} must be a {want.__name__}")

    @classmethod
    def of(cls, which: DrafterLaunches, table: tuple[tuple[str, str], ...] = (),
           topk: DrafterTopk = DrafterTopk.CHUNKS) -> "DraftLaunches":
        """EngineConfig.drafter_launches' settings: these defaults, or every projection at its wrapper's; a kernel
        table's draft_* entries over either; drafter_topk's place for the top-k."""
        head_topk = topk is DrafterTopk.HEAD
        if which is DrafterLaunches.TUNED:
            return cls(table=table, topk_in_head=head_topk)
        return cls(gate_up=RMSNormLinearParams(), down=LinearParams(), head=RMSNormLinearParams(), table=table,
                   topk_in_head=head_topk)

    def resolved(self, c: BlockDrafterConfig, head_rows: int, block_size: int) -> "DraftLaunches":
        """These launches with the table's entries for this drafter's shapes (the layers run block_size rows, the
        head the block's last block_size - 1 over head_rows tokens): an entry's fields over the field's."""
        shapes = {"qkv": ((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden, block_size),
                  "o_proj": (c.hidden, c.heads * c.head_dim, block_size),
                  "gate_up": (2 * c.intermediate, c.hidden, block_size), "down": (c.hidden, c.intermediate, block_size),
                  "head": (head_rows, c.hidden, block_size - 1)}
        fields = {}
        for name, (n, k, t) in shapes.items():
            entry = launch_params(self.table, f"draft_{name}", n, k, t) if self.table else None
            if entry:
                base = getattr(self, name)
                fields[name] = type(base)(**{**dataclasses.asdict(base), **entry})
        return dataclasses.replace(self, table=(), **fields)

    def down_for(self, k: int) -> dict:
        """down's launch for a K-wide MLP: its split K lowered to what K's chunks hold (a narrower drafter)."""
        split, chunks = self.down.split_k, triton.cdiv(k, self.down.block_k)
        while split > chunks:  # gemm.split_size's limit: a run holds one K chunk at least
            split //= 2
        return dataclasses.replace(self.down, split_k=split).as_kwargs()


def fusable(model: BlockDrafterModel) -> bool:
    """Whether FusedBlockStep runs this drafter: no attention biases, a power-of-two head size (the kernels')."""
    c = model.config
    return not c.attention_bias and c.head_dim >= 16 and c.head_dim & (c.head_dim - 1) == 0


class FusedBlockStep:
    """BlockStep's interface and cache ([layers, k/v, kv_heads, capacity + block_size, D]) on fused kernels."""

    def __init__(self, model: BlockDrafterModel, embed: torch.Tensor, head: torch.Tensor, capacity: int,
                 block_size: int, topk: int, window: int = 0, token_map: torch.Tensor | None = None,
                 launches: DraftLaunches = DraftLaunches()):
        if not fusable(model):
            raise ValueError("the fused drafter step needs a drafter without attention biases and a power-of-two "
                             "head size of at least 16")
        c = self.config = model.config
        self.model, self.embed, self.head, self.topk, self.token_map = model, embed, head, topk, token_map
        self.capacity, self.width, self.window = capacity, block_size, check_window(window)
        launches = launches.resolved(c, head.shape[0], block_size)
        self.p_qkv, self.p_o = launches.qkv.as_kwargs(), launches.o_proj.as_kwargs()
        self.p_gate_up, self.p_head = launches.gate_up.as_kwargs(), launches.head.as_kwargs()
        self.p_down, self.topk_block = launches.down_for(c.intermediate), launches.topk_block
        self.topk_in_head = launches.topk_in_head and c.logit_scale == 1.0 and c.logit_softcap <= 0
        dev, dtype = embed.device, embed.dtype
        self.cos, self.sin = (t.contiguous() for t in rope_tables(capacity + block_size, c.head_dim, c.rope_theta, dev))
        self.cache = torch.zeros(c.layers, 2, c.kv_heads, capacity + block_size, c.head_dim, dtype=dtype, device=dev)
        layers = model.layers
        cat = lambda *ws: torch.cat([w.weight for w in ws]).contiguous()  # noqa: E731
        self.w_qkv = [cat(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in layers)]
        self.w_gate_up = [cat(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers]
        # Every layer's context keys/values in one GEMM: [k_0; v_0; k_1; v_1; ...]
        self.w_ctx = torch.cat([cat(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in layers]).contiguous()
        self.k_norms = torch.stack([layer.self_attn.k_norm.weight for layer in layers]).contiguous() \
            if c.qk_norm else None  # [layers, D]: the observe's keys normed in one launch
        self.x = torch.zeros(block_size, c.hidden, dtype=dtype, device=dev)
        self.x[1:] = model.mask_embed[:block_size - 1].to(dtype) * c.input_scale
        self.block_visible = torch.ones(block_size, block_size, dtype=torch.bool, device=dev)  # non-causal block

    def _qk(self, x, i, start):
        """Layer i's block rows: q out, keys/values into the cache at positions start[0] + t (their own slots)."""
        a = self.model.layers[i].self_attn
        c = self.config
        norms = (a.q_norm.weight, a.k_norm.weight) if c.qk_norm else (None, None)
        return qk_norm_rope(x, c.heads, c.kv_heads, start, None, self.cos, self.sin, self.cache[i, 0],
                            self.cache[i, 1], *norms, eps=c.rms_eps, consecutive=True)

    @torch.no_grad()
    def project(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """BlockStep.project: target features [n, feature_dim] of positions `positions` ([n] long; default: the
        slots) -> keys/values in every layer's cache at `slots`."""
        m, c = self.model, self.config
        ctx = linear(features.to(m.fc.weight.dtype).contiguous(), m.fc.weight)
        kv = rmsnorm_linear(ctx, m.hidden_norm.weight, self.w_ctx, c.rms_eps)  # [n, layers * 2 kv_heads * D]
        kv_norm_rope_layers(kv, c.kv_heads, slots, self.cos, self.sin, self.cache[:, 0], self.cache[:, 1],
                            self.k_norms, c.rms_eps, positions=positions)

    @torch.no_grad()
    def draft(self, ints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ints = (pending token, its position) on the device -> top-k tokens and probabilities [B - 1, k]."""
        m, c = self.model, self.config
        if c.input_scale == 1.0:
            embedding(ints[:1], self.embed, out=self.x[:1])
        else:
            torch.mul(self.embed[ints[:1]], c.input_scale, out=self.x[:1])
        x = self.x
        # Producer statistics (RMSNormLinearParams.producer_stat, from a table's draft_* entries): o_proj and down
        # store their rows' segment sums of squares for the norm launch after them, as the target's forward does;
        # layer 0's QKV reads the embedding, which nobody summed.
        stats = lambda p: (torch.empty(self.width, c.hidden // 16, dtype=torch.float32, device=x.device)  # noqa: E731
                           if p.get("producer_stat") else None)
        s_qkv, s_mlp, s_head = stats(self.p_qkv), stats(self.p_gate_up), stats(self.p_head)
        s_in = None
        for i, layer in enumerate(m.layers):
            p_qkv = {**self.p_qkv, "producer_stat": s_in is not None}
            qkv = rmsnorm_linear(x, layer.input_layernorm.weight, self.w_qkv[i], c.rms_eps, **p_qkv, row_sumsq=s_in)
            q = self._qk(qkv, i, ints[1:2])
            o = attention(q, self.cache[i, 0], self.cache[i, 1], ints[1:2], self.block_visible, window=self.window)
            x = linear(o, layer.self_attn.o_proj.weight, residual=x, row_sumsq_out=s_mlp, **self.p_o)
            act = rmsnorm_glu(x, layer.post_attention_layernorm.weight, self.w_gate_up[i], c.rms_eps, **self.p_gate_up,
                              row_sumsq=s_mlp)
            s_in = s_head if i + 1 == len(m.layers) else s_qkv
            x = linear(act, layer.mlp.down_proj.weight, residual=x, row_sumsq_out=s_in, **self.p_down)
        s_head = None if s_head is None else s_head[1:]  # the head reads rows 1.. (the block's drafted positions)
        if self.topk_in_head:  # each column tile's top-k, max and sum of exp from the head's epilogue, then merged
            kp = next_pow2(self.topk, 2)  # tl.topk's k: a power of two >= 2, as topk_probs takes it
            _, parts = rmsnorm_linear(x[1:], m.norm.weight, self.head, c.rms_eps, out_dtype=torch.float32,
                                      store_y=False, topk=kp, **self.p_head, row_sumsq=s_head)
            return merge_topk(parts, self.topk, self.token_map)
        logits = rmsnorm_linear(x[1:], m.norm.weight, self.head, c.rms_eps, out_dtype=torch.float32, **self.p_head,
                                row_sumsq=s_head)
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.logit_softcap > 0:
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        # two launches where torch.topk + logsumexp took ~25
        return topk_probs(logits, self.topk, self.token_map, block=self.topk_block)
