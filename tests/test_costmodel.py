"""Cost model on hand-built traces whose answers are known exactly."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from specpilot.costmodel import (
    LINEAR_OPS, ROOT, Ceilings, CostCurve, DirectionName, Tree, attribute, best_first_tree, classify_kernel,
    closed_form_speedup, expected_accepted, ideal_op_times, kernel_factor, overhead_factor, plot, render_markdown,
    replay_accepted, replay_prefix_accepted, tau_factor,
)
from specpilot.costmodel.attribution import Attribution
from specpilot.engines.shapes import SMOLLM2_135M, OpClass
from specpilot.engines.traces import KernelTrace, StepTrace

# Three depths, two candidates each. Path scores: 10:.6  10-20:.42  11:.4  10-20-30:.378  11-20:.28
# 11-20-30:.252  10-21:.18  10-21-30:.162 ... so best-first adds them in exactly that order.
TOPK_TOKENS = [[10, 11], [20, 21], [30, 31]]
TOPK_PROBS = [[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]]
BEST_FIRST_ORDER = [(10,), (10, 20), (11,), (10, 20, 30), (11, 20), (11, 20, 30), (10, 21), (10, 21, 30)]
CEILINGS = Ceilings(peak_flops=700e12, peak_bandwidth=4.0e12)
TOKENS, CONTEXT = 4, 256


def linear_cost(n: int) -> float:
    return 1.0 + 0.01 * (n - 1)


def make_step(accepted: int, target: list[int], draft_s: float = 0.0, verify_s: float = 0.0) -> StepTrace:
    return StepTrace(request_id="r0", step=0, position=CONTEXT, drafted=3, depth=3, accepted=accepted,
                     committed=accepted + 1, verify_tokens=4, draft_s=draft_s, verify_s=verify_s,
                     topk_tokens=TOPK_TOKENS, topk_probs=TOPK_PROBS, target_tokens=target)


def test_closed_form_endpoints_and_a_mid_value():
    for k, c in [(1, 0.1), (4, 0.05), (7, 0.0)]:
        assert closed_form_speedup(0.0, k, c) == pytest.approx(1.0 / (1.0 + k * c))
        assert closed_form_speedup(1.0, k, c) == pytest.approx((k + 1) / (1.0 + k * c))
    # E = 1 + .5 + .25 + .125 = 1.875 over 1 + 3 * 0.1.
    assert closed_form_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    with pytest.raises(ValueError):
        closed_form_speedup(1.2, 3, 0.1)
    with pytest.raises(ValueError):
        closed_form_speedup(0.5, 3, -0.1)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0 - 1e-9, 1.0])
@pytest.mark.parametrize("k", [0, 1, 2, 5, 9])
def test_expected_accepted_is_the_exact_mean_of_the_acceptance_distribution(alpha, k):
    # Exactly j drafts accepted with probability alpha^j (1 - alpha) for j < k, alpha^k for j = k; +1 bonus.
    probs = [alpha ** j * (1.0 - alpha) for j in range(k)] + [alpha ** k]
    assert math.fsum(probs) == pytest.approx(1.0)
    exact = math.fsum((j + 1) * p for j, p in enumerate(probs))
    assert expected_accepted(alpha, k) == pytest.approx(exact, rel=1e-9)


def test_best_first_tree_exact_node_sets_for_budgets_1_to_5():
    for budget in range(1, 6):
        tree = best_first_tree(TOPK_TOKENS, TOPK_PROBS, budget)
        assert list(tree.paths()) == BEST_FIRST_ORDER[:budget]
    tree = best_first_tree(TOPK_TOKENS, TOPK_PROBS, 5)
    assert tree.scores == pytest.approx((0.6, 0.42, 0.4, 0.378, 0.28))
    assert tree.parents == (ROOT, 0, ROOT, 1, 2)
    # Saturates at every path there is: 2 + 4 + 8.
    assert len(best_first_tree(TOPK_TOKENS, TOPK_PROBS, 64)) == 14
    assert len(best_first_tree(TOPK_TOKENS, TOPK_PROBS, 0)) == 0


def test_best_first_tree_equals_the_top_scoring_paths_by_enumeration():
    rng = np.random.default_rng(7)
    depths, width = 4, 3
    tokens = [[100 * d + j for j in range(width)] for d in range(depths)]
    probs = [list(rng.dirichlet(np.ones(width + 1))[:width]) for _ in range(depths)]
    scored = []
    for depth in range(1, depths + 1):
        for ranks in itertools.product(range(width), repeat=depth):
            path = tuple(tokens[d][j] for d, j in enumerate(ranks))
            scored.append((math.prod(probs[d][j] for d, j in enumerate(ranks)), path))
    scored.sort(reverse=True)
    for budget in range(1, len(scored) + 1):
        tree = best_first_tree(tokens, probs, budget)
        assert set(tree.paths()) == {path for _, path in scored[:budget]}


def test_best_first_tree_sorts_merges_and_drops_candidates():
    shuffled = best_first_tree([[11, 10], [21, 20], [31, 30]], [[0.4, 0.6], [0.3, 0.7], [0.1, 0.9]], 8)
    assert list(shuffled.paths()) == BEST_FIRST_ORDER
    # Token 5 listed twice is one candidate of probability 0.5; a zero-probability token is never verified.
    tree = best_first_tree([[4, 5, 5, 6]], [[0.45, 0.25, 0.25, 0.0]], 8)
    assert tree.tokens == (5, 4) and tree.scores == pytest.approx((0.5, 0.45))
    with pytest.raises(ValueError):
        best_first_tree([[1, 2]], [[0.5]], 2)
    with pytest.raises(ValueError):
        best_first_tree([[1]], [[-0.1]], 2)


def test_replay_all_none_branch_and_off_path_matches():
    chain = Tree.from_edges([5, 6, 7], [ROOT, 0, 1])
    assert replay_accepted(chain, [5, 6, 7, 8]) == 3
    assert replay_accepted(chain, [9, 6, 7]) == 0
    assert replay_accepted(chain, [5, 6]) == 2  # the continuation ends before the tree does
    # 5 -> {6 -> 8, 7}: the target takes 5's second child at depth 2.
    branchy = Tree.from_edges([5, 6, 7, 8], [ROOT, 0, 0, 1])
    assert replay_accepted(branchy, [5, 7, 1]) == 2
    assert replay_prefix_accepted(branchy, [5, 7, 1]) == (0, 1, 1, 2, 2)
    assert replay_accepted(branchy, [5, 6, 8]) == 3
    # A matching token under a non-matching parent is not on an accepted path.
    off_path = Tree.from_edges([5, 9, 6], [ROOT, ROOT, 1])
    assert replay_accepted(off_path, [5, 6]) == 1
    with pytest.raises(ValueError):
        Tree.from_edges([5, 6], [1, ROOT])


def test_tau_factor_is_one_when_the_system_already_accepted_the_optimum():
    steps = [make_step(3, [10, 20, 30, 7]), make_step(3, [11, 20, 30, 7])]
    result = tau_factor(steps, linear_cost)
    assert result.best_budget == 8
    assert result.tau == pytest.approx(1.0)
    assert result.current_tokens_per_step == pytest.approx(4.0)


def test_tau_factor_known_value_and_budget_table():
    # The system verified the chain 10-20-30 both times; the second target went down the 11 branch.
    steps = [make_step(3, [10, 20, 30, 7]), make_step(0, [11, 20, 30, 7]), make_step(2, [])]
    result = tau_factor(steps, linear_cost)
    assert [r.budget for r in result.rows] == [1, 2, 4, 8, 16, 32, 64]
    assert [r.accepted_total for r in result.rows] == [3, 4, 6, 8, 8, 8, 8]
    assert [r.tokens_per_step for r in result.rows] == pytest.approx([1.5, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0])
    assert result.rows[3].predicted_speedup == pytest.approx(4.0 / 1.08)
    assert result.best_budget == 8
    assert result.current_tokens_per_step == pytest.approx(2.5)
    assert result.tau == pytest.approx(0.625)
    assert result.gap == pytest.approx(1.6)
    assert result.current_predicted_speedup == pytest.approx(5.0 / (2 * 1.03))
    assert (result.steps, result.skipped_steps) == (2, 1)
    # Each table entry is the replay of an independently built tree of that budget.
    for row in result.rows:
        trees = [best_first_tree(s.topk_tokens, s.topk_probs, row.budget) for s in steps[:2]]
        assert row.accepted_total == sum(replay_accepted(t, s.target_tokens) + 1 for t, s in zip(trees, steps))
    # A steep cost curve makes small trees win: budget 1 (1.5 / 1.5) beats budget 8 (4 / 5).
    assert tau_factor(steps, lambda n: 1.0 + 0.5 * (n - 1)).best_budget == 1


def test_cost_curve_interpolates_extrapolates_and_normalises():
    curve = CostCurve.from_measured({9: 2.16e-3, 1: 2.0e-3, 17: 2.32e-3})  # seconds; normalised to 1 token
    assert curve(1) == pytest.approx(1.0)
    assert curve(5) == pytest.approx(1.04)
    assert curve(65) == pytest.approx(1.64)
    steps = [make_step(3, [10, 20, 30, 7]), make_step(0, [11, 20, 30, 7])]
    from_dict, from_callable = tau_factor(steps, {1: 1.0, 9: 1.08, 65: 1.64}), tau_factor(steps, linear_cost)
    assert (from_dict.best_budget, from_dict.tau) == (from_callable.best_budget, from_callable.tau)
    assert [r.verify_cost for r in from_dict.rows] == pytest.approx([r.verify_cost for r in from_callable.rows])
    with pytest.raises(ValueError):
        CostCurve(((1, 1.0),))


@pytest.mark.parametrize("name, ops", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", LINEAR_OPS),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", LINEAR_OPS),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>", LINEAR_OPS),
    ("cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", LINEAR_OPS),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_TNN", LINEAR_OPS),
    ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>>", (OpClass.ATTN,)),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", (OpClass.ATTN,)),
    ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, float, float, 7, false, false>", (OpClass.ATTN,)),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>", (OpClass.NORM,)),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)>", (OpClass.NORM,)),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<c10::BFloat16, unsigned int, 4, 64, 64>", (OpClass.ROPE_KV,)),
    ("void at::native::index_copy_kernel_impl<c10::BFloat16>", (OpClass.ROPE_KV,)),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", (OpClass.ROPE_KV,)),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>", (OpClass.ACT,)),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::binary_internal::MulFunctor<float>>", (OpClass.ACT,)),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", (OpClass.ACCEPT,)),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>", (OpClass.EMBED,)),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", (OpClass.OTHER,)),
    ("rmsnorm_linear_kernel", (OpClass.NORM, OpClass.QKV, OpClass.GATE_UP)),
    ("linear_kernel", LINEAR_OPS),
    ("rope_kv_write_kernel", (OpClass.ROPE_KV,)),
    ("attention_kernel", (OpClass.ATTN,)),
    ("swiglu_kernel", (OpClass.ACT,)),
    ("greedy_accept_kernel", (OpClass.ACCEPT,)),
])
def test_classify_kernel(name, ops):
    assert classify_kernel(name) == ops


def synthetic_kernels(multiple: float, steps: int = 10) -> list[KernelTrace]:
    """One kernel per op class (a shared cuBLAS GEMM for the linears), each `multiple` x its ideal time."""
    ideals = ideal_op_times(SMOLLM2_135M, TOKENS, CONTEXT, CEILINGS)
    names = {OpClass.EMBED: "indexSelectLargeIndex", OpClass.NORM: "rms_norm_kernel", OpClass.ROPE_KV: "rope_kv_write_kernel",
             OpClass.ATTN: "flash_fwd_kernel", OpClass.ACT: "swiglu_kernel", OpClass.ACCEPT: "greedy_accept_kernel"}
    traces = [KernelTrace(name, "other", calls=3 * steps, device_s=multiple * ideals[op].ideal_s * steps, steps=steps,
                          tokens=TOKENS) for op, name in names.items()]
    linear_s = sum(ideals[op].ideal_s for op in LINEAR_OPS)
    traces.append(KernelTrace("sm90_xmma_gemm_bf16bf16_bf16f32", "other", calls=5 * steps,
                              device_s=multiple * linear_s * steps, steps=steps, tokens=TOKENS))
    return traces


def test_kernel_factor_is_exactly_the_multiple_of_the_ideal():
    result = kernel_factor(synthetic_kernels(2.0), SMOLLM2_135M, TOKENS, CONTEXT, CEILINGS, launch_latency_s=5e-6)
    assert result.factor == pytest.approx(2.0)
    ideals = ideal_op_times(SMOLLM2_135M, TOKENS, CONTEXT, CEILINGS)
    assert result.ideal_s == pytest.approx(sum(i.ideal_s for i in ideals.values()))
    # Decode-width linears are bandwidth-bound, so splitting the shared GEMM by bytes gives each its 2x back.
    assert all(ideals[op].bound.value == "memory" for op in LINEAR_OPS)
    for gap in result.op_gaps:
        assert gap.gap == pytest.approx(2.0), gap.op
    assert result.launches == pytest.approx(6 * 3 + 5)
    assert result.launch_overhead_s == pytest.approx(23 * 5e-6)
    with pytest.raises(ValueError):
        kernel_factor(synthetic_kernels(2.0), SMOLLM2_135M, TOKENS + 1, CONTEXT, CEILINGS)


def test_kernel_factor_trusts_a_recorded_op_and_ranks_the_gaps():
    traces = synthetic_kernels(1.0)
    attn = next(t for t in traces if t.name == "flash_fwd_kernel")
    traces.append(KernelTrace("mystery_kernel", "attn", calls=10, device_s=4 * attn.device_s, steps=10, tokens=TOKENS))
    result = kernel_factor(traces, SMOLLM2_135M, TOKENS, CONTEXT, CEILINGS)
    top = result.op_gaps[0]
    assert top.op is OpClass.ATTN and top.gap == pytest.approx(5.0) and top.top_kernel == "mystery_kernel"


def test_overhead_factor_known_value():
    steps = [make_step(0, [1], draft_s=1e-4, verify_s=5e-4), make_step(0, [1], draft_s=3e-4, verify_s=7e-4)]
    result = overhead_factor(steps, kernel_s_per_step=4e-4)
    assert result.wall_s == pytest.approx(8e-4)
    assert result.factor == pytest.approx(2.0)


def attribution(kernel_multiple: float, overhead_multiple: float) -> Attribution:
    kernels = synthetic_kernels(kernel_multiple)
    ideal_s = sum(i.ideal_s for i in ideal_op_times(SMOLLM2_135M, TOKENS, CONTEXT, CEILINGS).values())
    wall_s = overhead_multiple * kernel_multiple * ideal_s
    steps = [make_step(3, [10, 20, 30, 7], 0.25 * wall_s, 0.75 * wall_s),
             make_step(0, [11, 20, 30, 7], 0.25 * wall_s, 0.75 * wall_s)]
    return attribute(steps, kernels, SMOLLM2_135M, CEILINGS, linear_cost)


def test_attribute_factors_total_gap_and_direction_ranking():
    attr = attribution(kernel_multiple=2.0, overhead_multiple=1.5)
    assert attr.kernel.context == CONTEXT and attr.kernel.tokens == TOKENS
    assert (attr.tau.tau, attr.kernel.factor, attr.overhead.factor) == pytest.approx((0.625, 2.0, 1.5))
    assert attr.total_gap == pytest.approx(1.6 * 2.0 * 1.5)
    assert [d.name for d in attr.directions] == [DirectionName.KERNELS, DirectionName.TREE_SHAPE, DirectionName.OVERHEAD]
    assert [d.predicted_gain for d in attr.directions] == pytest.approx([1.0, 0.6, 0.5])
    assert "budget 8" in attr.directions[1].rationale
    # The kernel rationale names the largest op-class gap (the biggest linear) and the kernel behind it.
    assert attr.kernel.op_gaps[0].op is OpClass.GATE_UP
    assert "gate_up 2.00x ideal" in attr.directions[0].rationale
    assert "sm90_xmma_gemm_bf16bf16_bf16f32" in attr.directions[0].rationale
    other = attribution(kernel_multiple=1.1, overhead_multiple=3.0)
    assert [d.name for d in other.directions] == [DirectionName.OVERHEAD, DirectionName.TREE_SHAPE, DirectionName.KERNELS]


def test_attribution_round_trips_through_json():
    attr = attribution(kernel_multiple=2.0, overhead_multiple=1.5)
    assert Attribution.from_dict(json.loads(json.dumps(attr.to_dict()))) == attr


def test_render_markdown_contains_the_numbers():
    text = render_markdown(attribution(kernel_multiple=2.0, overhead_multiple=1.5))
    for needle in ("**4.80x**", "tau 0.625", "| kernel | 2.00 |", "| overhead | 1.50 |", "| 8 (best) |",
                   "| 1 | kernels |", "flash_fwd_kernel"):
        assert needle in text, needle


def test_plot_writes_a_png(tmp_path):
    path = plot(attribution(kernel_multiple=2.0, overhead_multiple=1.5), tmp_path / "plots" / "attribution.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_fused_launches_are_labelled_by_their_role_in_launch_order():
    """The fused forward runs its norm + projection kernel as QKV, gate_up (each layer), then the LM head, and its
    projection kernel as o_proj, down: launch order splits their time, which their names cannot."""
    from specpilot.costmodel.classify import label_fused_launches
    layer = ["_rmsnorm_linear_kernel", "_attn_split_kernel", "_attn_combine_kernel", "_linear_kernel",
             "_rmsnorm_linear_kernel", "_linear_kernel"]
    forward = ["indexSelectSmallIndex"] + layer * 2 + ["_rmsnorm_linear_kernel", "_argmax_combine_kernel"]
    labels = label_fused_launches(forward * 3, layers=2)  # three profiled forwards
    Q, G, O, D, H = OpClass.QKV, OpClass.GATE_UP, OpClass.O_PROJ, OpClass.DOWN, OpClass.LM_HEAD
    assert labels[:len(forward)] == [None, Q, None, None, O, G, D, Q, None, None, O, G, D, H, None]
    assert labels == labels[:len(forward)] * 3
    # launches that are not whole forwards of that depth: no labels, attribution by name
    assert label_fused_launches(forward * 3, layers=3) is None
    assert label_fused_launches(forward[:-3], layers=2) is None
    assert label_fused_launches(["ampere_sgemm", "flash_fwd"], layers=2) is None


def test_step_weight_count_leaves_out_an_untied_input_embedding_only():
    from specpilot.engines.shapes import LLAMA3_8B
    # Llama-3-8B: 8.03e9 parameters, of which the step reads all but the 128256 x 4096 input embedding
    assert LLAMA3_8B.weight_count() - LLAMA3_8B.step_weight_count() == 128256 * 4096
    assert LLAMA3_8B.step_weight_count() * 2 == 15_009_849_344
    # the bytes of the cost model's ops (one token, no context, activations free) are those weights, less the norm
    # weights (counted as activations there) and plus one token's fp32 logits written by the LM head
    costs = LLAMA3_8B.op_costs(1, 0, weight_bytes=2.0, act_bytes=0)
    weights = sum(b for op, (_, b) in costs.items() if op is not OpClass.ACCEPT)
    assert weights == LLAMA3_8B.step_weight_count() * 2 - (2 * LLAMA3_8B.layers + 1) * 4096 * 2 + 128256 * 4
    assert SMOLLM2_135M.step_weight_count() == SMOLLM2_135M.weight_count()  # tied: the LM head reads the embedding
