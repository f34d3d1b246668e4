"""The block drafter's fused step (engine kernels, for Triton targets): its q/k norm + rotary + cache-write kernel
against its torch reference, the step against the reference step's distributions, and engines that run it."""
from __future__ import annotations

import pytest
import torch
from _tiny import prompt, tiny_model
from test_block_drafter import NO_EOS, cfg, damped, quick_drafter
from test_block_step import drafter_for

from specpilot.engines.build import build_engine
from specpilot.engines.drafters.block_fused import (DraftLaunches, FusedBlockStep, kv_norm_rope_layers,
                                                   kv_norm_rope_layers_ref, qk_norm_rope, qk_norm_rope_ref)
from specpilot.engines.drafters.block_step import BlockStep
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape
from specpilot.kernels import rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernel tests run compiled on a GPU host
# The drafter and engine tests build CPU models (`interpreter`); a GPU host runs the fused step in the device loop.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,extra_cols,norm", [(4, 2, 0, True), (0, 2, 48, True), (6, 3, 32, False),
                                                            (2, 2, 0, False)])
def test_qk_norm_rope_matches_its_reference(dtype, heads, kv_heads, extra_cols, norm):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    D, T, S = 16, 5, 40
    x = (torch.randn(T, (heads + 2 * kv_heads) * D + extra_cols, generator=g) * 3).to(DEV, dtype)
    rows = x[:, extra_cols // 2:] if extra_cols else x  # a view: row stride wider than its columns
    pos, slots = torch.tensor([3, 4, 5, 6, 30], device=DEV), torch.tensor([1, 2, 3, 9, 20], device=DEV)
    cos, sin = (t.to(DEV) for t in rope_tables(64, D, 500.0))
    qn, kn = ((torch.randn(D, generator=g) + 1).to(DEV, dtype) for _ in range(2)) if norm else (None, None)
    caches = [torch.full((kv_heads, S, D), 7.0, dtype=dtype, device=DEV) for _ in range(4)]
    q = qk_norm_rope(rows, heads, kv_heads, pos, slots, cos, sin, caches[0], caches[1], qn, kn, 1e-5)
    q_ref = qk_norm_rope_ref(rows, heads, kv_heads, pos, slots, cos, sin, caches[2], caches[3], qn, kn, 1e-5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=1 / 128)  # bf16: one ulp
    if heads:
        torch.testing.assert_close(q, q_ref, **tol)
    else:
        assert q is None and q_ref is None
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])  # v is copied
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert (caches[0][:, untouched] == 7).all() and (caches[1][:, untouched] == 7).all()


def test_qk_norm_rope_of_consecutive_rows_equals_it_with_their_positions():
    """consecutive: row t at positions[0] + t in that slot (the draft's block, no launch adding the offsets): the
    same q and cache writes as the explicit positions and slots."""
    g = torch.Generator().manual_seed(5)
    D, T, S = 16, 6, 32
    x = torch.randn(T, 7 * D, generator=g).to(DEV, torch.bfloat16)
    cos, sin = (t.to(DEV) for t in rope_tables(64, D, 500.0))
    qn, kn = ((torch.randn(D, generator=g) + 1).to(DEV, torch.bfloat16) for _ in range(2))
    caches = [torch.full((2, S, D), 7.0, dtype=torch.bfloat16, device=DEV) for _ in range(6)]
    start, pos = torch.tensor([9], device=DEV), torch.arange(9, 9 + T, device=DEV)
    q = qk_norm_rope(x, 3, 2, start, None, cos, sin, caches[0], caches[1], qn, kn, 1e-5, consecutive=True)
    q_pos = qk_norm_rope(x, 3, 2, pos, pos, cos, sin, caches[2], caches[3], qn, kn, 1e-5)
    q_ref = qk_norm_rope_ref(x, 3, 2, start, None, cos, sin, caches[4], caches[5], qn, kn, 1e-5, consecutive=True)
    assert torch.equal(q, q_pos) and all(torch.equal(caches[i], caches[i + 2]) for i in (0, 1))
    torch.testing.assert_close(q, q_ref, atol=0.0, rtol=1 / 128)
    assert (caches[0][:, 9:9 + T] != 7).any() and (caches[0][:, :9] == 7).all() and (caches[0][:, 9 + T:] == 7).all()
    with pytest.raises(ValueError, match="slots=None"):
        qk_norm_rope(x, 3, 2, start, pos, cos, sin, caches[0], caches[1], consecutive=True)
    with pytest.raises(ValueError, match="positions must have shape"):
        qk_norm_rope(x, 3, 2, pos, None, cos, sin, caches[0], caches[1], consecutive=True)


@pytest.mark.parametrize("norm,tree", [(True, False), (False, False), (True, True)])
def test_every_layers_context_keys_in_one_launch_equal_one_launch_a_layer(norm, tree):
    """kv_norm_rope_layers (the observe's keys and values of all layers, one launch) writes the bits of a
    qk_norm_rope a layer, into a [layers, 2, kv_heads, S, D] cache's k and v views, and nothing else. tree: rows
    rotated at positions other than their slots (a tree's rows before the move)."""
    g = torch.Generator().manual_seed(11)
    L, KVH, D, n, S = 3, 2, 16, 5, 24
    x = (torch.randn(n, L * 2 * KVH * D + 8, generator=g) * 2).to(DEV, torch.bfloat16)
    slots = torch.tensor([4, 5, 6, 7, 20], device=DEV)
    pos = torch.tensor([4, 5, 5, 6, 9], device=DEV) if tree else slots
    cos, sin = (t.to(DEV) for t in rope_tables(32, D, 500.0))
    kn = (torch.randn(L, D, generator=g) + 1).to(DEV, torch.bfloat16) if norm else None
    caches = [torch.full((L, 2, KVH, S, D), 7.0, dtype=torch.bfloat16, device=DEV) for _ in range(3)]
    kv_norm_rope_layers(x, KVH, slots, cos, sin, caches[0][:, 0], caches[0][:, 1], kn, 1e-5,
                        positions=pos if tree else None)
    for layer in range(L):
        w = None if kn is None else kn[layer]
        qk_norm_rope(x[:, layer * 2 * KVH * D:], 0, KVH, pos, slots, cos, sin, caches[1][layer, 0],
                     caches[1][layer, 1], w, w, 1e-5)
    kv_norm_rope_layers_ref(x, KVH, slots, cos, sin, caches[2][:, 0], caches[2][:, 1], kn, 1e-5,
                            positions=pos if tree else None)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(caches[0], caches[2], atol=0.0, rtol=1 / 128)
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert (caches[0][..., untouched, :] == 7).all()
    with pytest.raises(ValueError, match="equal strides"):
        kv_norm_rope_layers(x, KVH, slots, cos, sin, caches[0][:, 0], caches[0][:2, 1], kn, 1e-5)
    with pytest.raises(ValueError, match="x rows must hold"):
        kv_norm_rope_layers(x[:, :40], KVH, slots, cos, sin, caches[0][:, 0], caches[0][:, 1], kn, 1e-5)


def test_qk_norm_rope_refuses_bad_inputs():
    cos, sin = (t.to(DEV) for t in rope_tables(16, 16, 500.0))
    k, v = torch.zeros(2, 8, 16, device=DEV), torch.zeros(2, 8, 16, device=DEV)
    x, pos = torch.zeros(3, 6 * 16, device=DEV), torch.arange(3, device=DEV)
    with pytest.raises(ValueError, match="rows must hold"):
        qk_norm_rope(x[:, :80], 2, 2, pos, pos, cos, sin, k, v)
    with pytest.raises(ValueError, match="both q and k norm"):
        qk_norm_rope(x, 2, 2, pos, pos, cos, sin, k, v, q_norm=torch.ones(16, device=DEV))
    with pytest.raises(ValueError, match="head_dim=12"):
        qk_norm_rope(x, 2, 2, pos, pos, cos, sin, torch.zeros(2, 8, 12, device=DEV), torch.zeros(2, 8, 12, device=DEV))
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope(x, 2, 2, pos.int(), pos, cos, sin, k, v)


@pytest.mark.interpreter
@pytest.mark.parametrize("over,window", [({}, 0), ({"qk_norm": False}, 0),
                                         ({"input_scale": 1.7, "logit_scale": 0.8, "logit_softcap": 5.0}, 0),
                                         ({}, 6),
                                         ({"intermediate": 336}, 0)])  # widened (grow_drafter)
def test_fused_step_gives_the_reference_steps_distributions(over, window):
    """float32, under the interpreter: the same context caches up to rounding and the same top-1 tokens and
    probabilities (to 1e-4) as the reference step with the same Triton attention, over contexts of several lengths
    (window: the drafter's context window, both steps)."""
    target = tiny_model("gqa", 3, torch.float32)
    model = drafter_for(target, 3, 8, **over).eval()
    head = target.lm_head.weight
    ref = BlockStep(model, target.embed_tokens.weight, head, 64, 8, 5, triton_attention=True, window=window)
    fused = FusedBlockStep(model, target.embed_tokens.weight, head, 64, 8, 5, window=window)
    g = torch.Generator().manual_seed(3)
    n_ctx = 0
    for n in (12, 1, 5, 3):
        features = torch.randn(n, model.config.feature_dim, generator=g)
        for s in (ref, fused):
            s.project(features, torch.arange(n_ctx, n_ctx + n))
        n_ctx += n
        torch.testing.assert_close(fused.cache[..., :n_ctx, :], ref.cache[..., :n_ctx, :], atol=1e-5, rtol=1e-4)
        ints = torch.tensor([int(torch.randint(target.shape.vocab, (1,), generator=g)), n_ctx])
        (tok_r, p_r), (tok_f, p_f) = ref.draft(ints), fused.draft(ints)
        assert torch.equal(tok_f[:, 0], tok_r[:, 0]), n_ctx
        torch.testing.assert_close(p_f, p_r, atol=1e-4, rtol=1e-3)


@pytest.mark.interpreter
def test_rows_projected_at_tree_slots_then_moved_equal_rows_projected_in_place():
    """project(features, slots, positions): a tree's rows projected at their tree slots, rotated at their positions
    (EngineConfig.observe_overlap), then moved to the slots of those positions, are the rows a projection of the
    path in place writes: fused and reference steps, bit for bit each (the same rows through the same launches)."""
    target = tiny_model("gqa", 3, torch.float32)
    model = drafter_for(target, 3, 8).eval()
    head = target.lm_head.weight
    g = torch.Generator().manual_seed(4)
    features = torch.randn(6, model.config.feature_dim, generator=g)
    base, depths = 10, torch.tensor([0, 1, 1, 2, 2, 3])  # a tree of six rows at slots base + i
    path = torch.tensor([0, 2, 4, 5])  # its accepted path: depth d's row
    for make in (lambda: FusedBlockStep(model, target.embed_tokens.weight, head, 64, 8, 5),
                 lambda: BlockStep(model, target.embed_tokens.weight, head, 64, 8, 5, triton_attention=True)):
        tree, in_place = make(), make()
        tree.project(features, base + torch.arange(6), base + depths)
        moved = tree.cache[..., base + path, :].clone()
        in_place.project(features[path], base + torch.arange(4))
        assert torch.equal(moved, in_place.cache[..., base:base + 4, :]), type(tree).__name__
        # rotated at their slots instead, the side branch's rows differ
        wrong = make()
        wrong.project(features, base + torch.arange(6))
        assert not torch.equal(wrong.cache[..., base + path, :], moved)


@pytest.mark.interpreter
def test_the_drafter_keeps_the_reference_step_where_the_kernels_do_not_fit():
    target = tiny_model("gqa", 0, torch.float32)
    shape = TreeShape(False, 8, 8, 4, 7)
    for over, want in (({}, FusedBlockStep), ({"attention_bias": True}, BlockStep)):
        d = BlockTreeDrafter(drafter_for(target, 0, 8, **over), target, shape, 64, "cpu", fused=True)
        assert type(d.step) is want, over
    assert type(BlockTreeDrafter(drafter_for(target, 0, 8), target, shape, 64, "cpu").step) is BlockStep


@pytest.mark.interpreter
def test_a_triton_engine_drafts_with_the_fused_step_and_equals_ar():
    """The host loop here; tests/test_device_loop.py runs the fused step inside the device loop."""
    model = damped("mha_tied", 2)
    drafter = quick_drafter(model, 2, 40)
    p = prompt(model.shape.vocab, 10, 2)
    want = build_engine(cfg(drafter="none", kernel_backend="triton"), model, NO_EOS, "cpu").generate(p, 16).tokens
    eng = build_engine(cfg(device_steps=1, kernel_backend="triton"), model, NO_EOS, "cpu", block_drafter=drafter)
    assert isinstance(eng.drafter.step, FusedBlockStep)
    r = eng.generate(p, 16)
    assert r.tokens == want and max(s.accepted for s in r.steps) == 3
    # EngineConfig.drafter_launches: the projections' settings the fused step launches with (tokens still = AR)
    plain = build_engine(cfg(device_steps=1, kernel_backend="triton", drafter_launches="default"), model, NO_EOS,
                         "cpu", block_drafter=drafter)
    assert (plain.drafter.step.p_gate_up["block_n"], eng.drafter.step.p_gate_up["block_n"]) == (None, 32)
    assert plain.generate(p, 16).tokens == want


def test_draft_launches_are_typed_and_fit_the_mlp():
    """down's split K (4 runs of 256-wide chunks) drops to what a narrower MLP's chunks hold; a wrong params type is
    refused on construction."""
    from specpilot.engines.config import DrafterLaunches
    from specpilot.kernels.gemm import LinearParams
    from specpilot.kernels.norm_gemm import RMSNormLinearParams
    d = DraftLaunches()
    assert d.down_for(3072)["split_k"] == 4 and d.down_for(512)["split_k"] == 2 and d.down_for(336)["split_k"] == 2
    assert d.down_for(200)["split_k"] == 1
    with pytest.raises(TypeError, match="DraftLaunches.down must be a LinearParams"):
        DraftLaunches(down=RMSNormLinearParams())
    assert DraftLaunches(down=LinearParams()).down_for(3072)["split_k"] == 1
    assert DraftLaunches.of(DrafterLaunches.DEFAULT).down_for(3072)["split_k"] == 1
    assert DraftLaunches.of(DrafterLaunches.TUNED) == d


@pytest.mark.interpreter
def test_a_kernel_tables_draft_entries_set_the_drafters_launches():
    """EngineConfig.kernel_table's draft_<projection>@NxK@T<rows> entries: the layers' at the block's rows, the
    head's at the rows it drafts; an entry of another tile count or shape is not the step's. Tokens still = AR."""
    model = damped("mha_tied", 2)
    drafter = quick_drafter(model, 2, 40)
    c, v = drafter.config, model.shape.vocab
    qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
    table = ((f"draft_gate_up@{2 * c.intermediate}x{c.hidden}@T4", '{"block_n": 16, "num_warps": 2}'),
             (f"draft_down@{c.hidden}x{c.intermediate}@T4", '{"split_k": 1, "block_n": 32}'),
             (f"draft_head@{v}x{c.hidden}@T3", '{"block_n": 32}'),
             (f"draft_qkv@{qkv}x{c.hidden}@T64", '{"block_n": 64}'),  # 4 tiles: not a 4-row block's
             (f"draft_o_proj@{c.hidden + 16}x{c.hidden}@T4", '{"block_n": 64}'))  # another shape
    p = prompt(v, 10, 2)
    want = build_engine(cfg(drafter="none", kernel_backend="triton"), model, NO_EOS, "cpu").generate(p, 16).tokens
    eng = build_engine(cfg(device_steps=1, kernel_backend="triton", kernel_table=table), model, NO_EOS, "cpu",
                       block_drafter=drafter)
    step = eng.drafter.step
    assert (step.p_gate_up["block_n"], step.p_gate_up["num_warps"], step.p_gate_up["num_stages"]) == (16, 2, 3)
    assert (step.p_down["split_k"], step.p_down["block_n"], step.p_head["block_n"]) == (1, 32, 32)
    assert step.p_qkv == DraftLaunches().qkv.as_kwargs() and step.p_o == DraftLaunches().o_proj.as_kwargs()
    assert eng.generate(p, 16).tokens == want
    with pytest.raises(ValueError, match="unknown kernel"):
        DraftLaunches(table=(("draft_mlp@8x8@T4", "{}"),))


def assert_drafts_agree(model, target, launches: list) -> list:
    """Fused steps of `model` with each DraftLaunches, on the same 12 context features: one draft each, the same
    tokens and probabilities to float32 rounding. Returns the steps."""
    steps = [FusedBlockStep(model, target.embed_tokens.weight, target.lm_head.weight, 64, 8, 5, launches=la)
             for la in launches]
    features = torch.randn(12, model.config.feature_dim, generator=torch.Generator().manual_seed(4))
    for s in steps:
        s.project(features, torch.arange(12))
    (tok_a, p_a), (tok_b, p_b) = (s.draft(torch.tensor([5, 12])) for s in steps)
    assert torch.equal(tok_a, tok_b)
    torch.testing.assert_close(p_a, p_b, atol=1e-6, rtol=1e-5)
    return steps


@pytest.mark.interpreter
def test_the_heads_epilogue_top_k_drafts_what_the_top_k_launch_does():
    """DraftLaunches.topk_in_head (EngineConfig.drafter_topk: head): the draft's tokens and probabilities (to
    float32 rounding of the sums) equal the chunked top-k launch's over the stored logits; an engine drafting so
    still gives AR's tokens; a drafter with a logit softcap keeps the launch."""
    target = tiny_model("gqa", 3, torch.float32)
    model = drafter_for(target, 3, 8).eval()
    head = target.lm_head.weight
    steps = assert_drafts_agree(model, target, [DraftLaunches(topk_in_head=t) for t in (False, True)])
    assert [s.topk_in_head for s in steps] == [False, True]
    capped = drafter_for(target, 3, 8, logit_softcap=5.0).eval()
    assert not FusedBlockStep(capped, target.embed_tokens.weight, head, 64, 8, 5,
                              launches=DraftLaunches(topk_in_head=True)).topk_in_head
    model = damped("mha_tied", 2)
    drafter = quick_drafter(model, 2, 40)
    p = prompt(model.shape.vocab, 10, 2)
    want = build_engine(cfg(drafter="none", kernel_backend="triton"), model, NO_EOS, "cpu").generate(p, 16).tokens
    eng = build_engine(cfg(device_steps=1, kernel_backend="triton", drafter_topk="head"), model, NO_EOS, "cpu",
                       block_drafter=drafter)
    assert eng.drafter.step.topk_in_head and eng.generate(p, 16).tokens == want


@pytest.mark.interpreter
@pytest.mark.parametrize("topk_in_head", [False, True])
def test_producer_statistics_draft_what_the_norms_own_pass_does(topk_in_head):
    """producer_stat on the drafter's QKV, gate_up and head (a table's draft_* entries): o_proj and down store their
    rows' segment sums of squares and the norms read them (layer 0's QKV keeps its own pass: the embedding has no
    producer): the same tokens, probabilities to float32 rounding; an engine drafting so still gives AR's tokens."""
    from specpilot.kernels.norm_gemm import RMSNormLinearParams
    target = tiny_model("gqa", 3, torch.float32)
    model = drafter_for(target, 3, 8).eval()
    stat = RMSNormLinearParams(producer_stat=True)
    launches = [DraftLaunches(topk_in_head=topk_in_head),
                DraftLaunches(qkv=stat, gate_up=stat, head=stat, topk_in_head=topk_in_head)]
    assert_drafts_agree(model, target, launches)
    model = damped("mha_tied", 2)
    drafter = quick_drafter(model, 2, 40)
    c, v = drafter.config, model.shape.vocab
    on = '{"producer_stat": true}'
    table = ((f"draft_gate_up@{2 * c.intermediate}x{c.hidden}@T4", on),
             (f"draft_qkv@{(c.heads + 2 * c.kv_heads) * c.head_dim}x{c.hidden}@T4", on),
             (f"draft_head@{v}x{c.hidden}@T3", on))
    p = prompt(v, 10, 2)
    want = build_engine(cfg(drafter="none", kernel_backend="triton"), model, NO_EOS, "cpu").generate(p, 16).tokens
    eng = build_engine(cfg(device_steps=1, kernel_backend="triton", kernel_table=table,
                           drafter_topk="head" if topk_in_head else "chunks"), model, NO_EOS, "cpu",
                       block_drafter=drafter)
    step = eng.drafter.step
    assert step.p_qkv["producer_stat"] and step.p_gate_up["producer_stat"] and step.p_head["producer_stat"]
    assert eng.generate(p, 16).tokens == want
