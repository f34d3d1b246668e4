"""The Llama forward through SpecPilot's fused, batch-invariant Triton kernels (KernelBackend.TRITON).

Six launches per layer instead of ~15 stock ops: norm+QKV+rotary+KV write, attention (split + combine),
o_proj+residual, norm+gate_up+SwiGLU, down+residual. Every kernel tiles tokens by a fixed BLOCK_M and reduces in
a fixed order, so a token's row is bit-identical whatever the forward's width: AR (1 token) and verify (k tokens)
agree without padding to a common shape. Same weights as the torch path (the LlamaModel's).

weight_format=W12: the same launches read the projections as W12 weights (specpilot.weights) in the kernels' oct
layout, decoded in each kernel's K loop (kernels/w12_tile.py), which gives the bf16 bits on the decoded weights; the
W12 weights and their layouts are built once and checked bit for bit against the model, so W12 changes no output,
only the bytes read per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specpilot.engines.config import WeightFormat
from specpilot.engines.llama import LlamaModel
from specpilot.kernels.attn import AttentionParams
from specpilot.kernels.table import LaunchTable
from specpilot.weights.model import OctWeights, W12Weights


@dataclass
class FusedTables:
    cos: torch.Tensor  # [max_pos, D/2] fp32
    sin: torch.Tensor
    w12: OctWeights | None = None  # the projections in W12, kernel layout (weight_format=W12); None: the model's bf16
    launch: LaunchTable = field(default_factory=LaunchTable)  # EngineConfig.kernel_table (tuned launch params)


def rope_tables_for(model: LlamaModel, max_positions: int, device,
                    weight_format: WeightFormat = WeightFormat.NATIVE, w12: W12Weights | None = None,
                    kernel_table: tuple[tuple[str, str], ...] = (), layouts: OctWeights | None = None) -> FusedTables:
    """Rotary tables, the launch table, and for W12 the packed projections: `layouts` (kernel layouts already made
    from this model, e.g. shared by the step gate's engines), else `w12` (e.g. from a pack), else encoded from the
    model."""
    from specpilot.kernels import rope_tables
    sh = model.shape
    cos, sin = rope_tables(max_positions, sh.head_dim, sh.rope_theta, device)
    if layouts is not None:
        if weight_format is not WeightFormat.W12 or w12 is not None:
            raise ValueError("kernel layouts are for weight_format=w12, without w12 weights beside them")
        return FusedTables(cos.contiguous(), sin.contiguous(), layouts, LaunchTable(tuple(kernel_table)))
    packed = None
    if weight_format is WeightFormat.W12:
        check_fusable(model, weight_format)
        if w12 is None:
            packed = W12Weights.from_model(model)
        else:
            packed = w12.to(next(model.parameters()).device)
            packed.check_against(model)  # the engine's exactness rests on decoding to the very weights it runs
    elif w12 is not None:
        raise ValueError(f"W12 weights given but weight_format={weight_format.value}")
    return FusedTables(cos.contiguous(), sin.contiguous(), None if packed is None else packed.kernel_layouts(),
                       LaunchTable(tuple(kernel_table)))


def check_fusable(model: LlamaModel, weight_format: WeightFormat = WeightFormat.NATIVE) -> None:
    sh = model.shape
    if sh.qk_norm or sh.attention_bias:
        raise ValueError(f"the Triton backend does not fuse {sh.model_type} (q/k norms or QKV biases); "
                         "use kernel_backend=torch")
    dtype = next(model.parameters()).dtype
    if weight_format is WeightFormat.W12 and dtype != torch.bfloat16:
        raise ValueError(f"weight_format=w12 stores bf16 weights; this model runs in {dtype}")


# Attention's reduction order for the fused forward (a kernel table may override it per model): AttentionParams'
# defaults, which the kernel tuner also starts from.
ATTENTION_ORDER = {"split_keys": AttentionParams.split_keys, "block_n": AttentionParams.block_n}


def feature_rows(features: torch.Tensor) -> torch.Tensor:
    """Layer-major features [layers, T, H] (fused_forward's captured layers) as rows [T, layers * H], each row its
    layers side by side (what a block drafter reads)."""
    return features.transpose(0, 1).reshape(features.shape[1], -1)


def fused_forward(model: LlamaModel, tables: FusedTables, ids, positions, slots, base, anc, k_caches, v_caches,
                  capture: tuple[int, ...] = (), block_slots=None, want_logits: bool = True, on_features=None):
    """Same contract as LlamaModel.forward, but attention visibility is (base [1] tensor, anc [T, T]) and the
    result is the pre-norm residual stream's final norm applied inside the LM-head kernel: returns
    (logits fp32 [T, V] or None, argmax [T], captured layer outputs [len(capture), T, H] in layer order or None).
    want_logits=False: the LM head finds the argmax in its epilogue and never writes the logits (the AR/verify hot
    path needs only the argmax).
    block_slots [T, A] (llama.ancestor_slots): keys read in position order through each token's ancestors'
    slots (then anc is not read). on_features(captured): called once the last captured layer has written its rows,
    before the layers after it (the device loop queues the drafter's observe there, on a second stream)."""
    from specpilot.kernels import attention, linear, rmsnorm_linear
    from specpilot.kernels.embed import embedding
    from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
    sh = model.shape
    packed = tables.w12
    if packed is None:  # the model's bf16 (or fp32) weights
        ws = [(a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight)
              for a, m in ((layer.self_attn, layer.mlp) for layer in model.layers)]
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    else:  # W12 in the oct layout: the same kernels decode it in their K loop (kernels/w12_tile.py)
        ws = [(p.qkv, p.o, p.gate_up, p.down) for p in packed.layers]
        head = packed.head
    T, lt = ids.shape[0], tables.launch
    H, I, qkv_n = sh.hidden, sh.intermediate, sh.q_dim + 2 * sh.kv_dim
    p_qkv = lt.get("qkv", qkv_n, H, T)
    p_attn = lt.get("attention", sh.q_dim, sh.kv_dim, T, **ATTENTION_ORDER)
    p_o = lt.get("o_proj", H, sh.q_dim, T)
    p_gate_up = lt.get("gate_up", 2 * I, H, T)
    p_down = lt.get("down", H, I, T)
    p_head = lt.get("lm_head", sh.vocab, H, T)
    # producer statistics (kernels/rmsnorm.py): o_proj / down store their rows' segment sums of squares for the norm
    # launch after them, where its table entry asks; the first QKV reads the embedding, which nobody summed
    sums = lambda p: torch.empty(T, H // 16, dtype=torch.float32, device=ids.device) if p else None  # noqa: E731
    sums_mlp, sums_attn = sums(p_gate_up.get("producer_stat")), sums(p_qkv.get("producer_stat"))
    sums_head = sums(p_head.get("producer_stat"))
    # post_scale: the producer also stores its rows times the next launch's norm weight, which that launch projects
    dt = model.embed_tokens.weight.dtype
    scaled = lambda p: torch.empty(T, H, dtype=dt, device=ids.device) if p.get("post_scale") else None  # noqa: E731
    g_mlp, g_attn, g_head = scaled(p_gate_up), scaled(p_qkv), scaled(p_head)
    stream = embedding(ids, model.embed_tokens.weight)
    stat_in = g_in = None
    # A captured layer's down projection writes its rows into the stack: no concatenation after the forward (a
    # copy kernel and a boundary without PDL a step); the stack's layer j is the next layer's contiguous stream.
    layer_of = {layer: j for j, layer in enumerate(sorted(set(capture)))}
    captured = torch.empty(len(layer_of), T, H, dtype=dt, device=ids.device) if layer_of else None
    for i, layer in enumerate(model.layers):
        w_qkv, w_o, w_gate_up, w_down = ws[i]
        ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        # rotary + cache write in the QKV kernel's epilogue: the same bits as rope_kv_write, one launch fewer
        q = rmsnorm_qkv_rope(stream, ln1, w_qkv, sh.rms_eps, positions, slots, tables.cos, tables.sin,
                             k_caches[i], v_caches[i], sh.heads, sh.kv_heads,
                             **{**p_qkv, "producer_stat": stat_in is not None, "post_scale": g_in is not None},
                             row_sumsq=stat_in, scaled_x=g_in)
        o = attention(q, k_caches[i], v_caches[i], base, anc, block_slots=block_slots, **p_attn)
        stream = linear(o, w_o, residual=stream, row_sumsq_out=sums_mlp, **p_o,
                        scale_w=None if g_mlp is None else ln2, scaled_out=g_mlp)
        # The activation goes in gate_up's epilogue (each output column owns its gate and up pair), not in the down
        # GEMM's prologue, where every column tile recomputes it (H200: 5x slower at 8B, 19.8 vs 4 + 1 us at SmolLM2).
        act = rmsnorm_glu(stream, ln2, w_gate_up, sh.rms_eps, **p_gate_up, row_sumsq=sums_mlp, scaled_x=g_mlp)
        last = i + 1 == len(model.layers)
        stat_in, g_in = (sums_head, g_head) if last else (sums_attn, g_attn)
        nw_next = model.norm.weight if last else model.layers[i + 1].input_layernorm.weight
        stream = linear(act, w_down, residual=stream, row_sumsq_out=stat_in, **p_down,
                        scale_w=None if g_in is None else nw_next, scaled_out=g_in,
                        out=captured[layer_of[i]] if i in layer_of else None)
        if on_features is not None and layer_of and i == max(layer_of):
            on_features(captured)
    logits, argmax = rmsnorm_linear(stream, model.norm.weight, head, sh.rms_eps, out_dtype=torch.float32,
                                    argmax=True, store_y=want_logits, **p_head, row_sumsq=stat_in, scaled_x=g_in)
    return logits, argmax, captured
