"""The block drafter's run-time step (BlockStep): bit for bit what BlockDrafterModel computes, and a pinned number
of launched ops per drafting step and per observe (on CUDA each is a kernel launch, 2-5 us inside a graph)."""
from __future__ import annotations

import collections

import pytest
import torch
from _tiny import SHAPES, prompt, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig, VerifyMode
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.drafters.block_step import BlockStep
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = ({}, {"qk_norm": False}, {"attention_bias": True},
            {"input_scale": 1.7, "logit_scale": 0.8, "logit_softcap": 5.0})
# One drafting step and one observe of a 2-layer bf16 drafter with q/k norms, as the engine runs them (the graph
# bodies on CUDA). Before BlockStep: 145 ops a step and 51 an observe, the observe launched eagerly every step.
DRAFT_OPS = {"mul": 24, "add": 15, "mm": 15, "_to_copy": 10, "pow": 9, "mean": 9, "rsqrt": 9, "copy_": 4, "cat": 2,
             "sdpa": 2, "silu": 2, "index_select": 1, "index": 1, "lt": 1, "where": 1, "_log_softmax": 1, "topk": 1,
             "exp": 1, "clone": 4}  # clone: the k/v heads spelled out for GQA (block_step._attention)
PROJECT_OPS = {"mul": 8, "mm": 5, "add": 4, "_to_copy": 3, "pow": 3, "mean": 3, "rsqrt": 3, "index_copy_": 3,
               "index": 1, "cat": 1}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel: every op but views (aliases) and bare allocations."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
            name = func.overloadpacket.__name__
            self.ops["sdpa" if "scaled_dot_product" in name else name] += 1
        return func(*args, **(kwargs or {}))


def drafter_for(target, seed: int, block_size: int, **over) -> BlockDrafterModel:
    """A 2-layer drafter with random norms and biases (unit norms and zero biases would hide their arithmetic)."""
    conf = BlockDrafterConfig.for_target(target.shape, layers=2, block_size=block_size)
    model = BlockDrafterModel(BlockDrafterConfig(**{**conf.to_dict(), **over})).init_weights(seed, std=0.2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def reference_step(model: BlockDrafterModel, embed, head, cache, pending: int, position: int, width: int, topk: int,
                   window: int = 0):
    """The drafting step through BlockDrafterModel's forward (the run-time code before BlockStep): the block
    attends to the concatenated zero-padded context cache [layers, k/v, kv_heads, C, D], masked from `position`
    (and below position - window)."""
    x = model.block_inputs(embed[torch.tensor([pending])], width)
    pos = (position + torch.arange(width))[None]
    slot = torch.arange(cache.shape[3])
    ctx_ok = ((slot < position) & ((slot >= position - window) if window else True)).expand(width, -1)
    mask = torch.cat([ctx_ok, torch.ones(width, width, dtype=torch.bool)], dim=1)[None]
    ctx = [(cache[i, 0, None], cache[i, 1, None]) for i in range(cache.shape[0])]
    hidden = model(x, pos, ctx, mask)[0, 1:]
    top = torch.topk(torch.log_softmax(model.logits(hidden, head).float(), dim=-1), topk, dim=-1)
    return top.indices, top.values.exp()


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_step_and_observe_equal_the_reference_bit_for_bit(shape, dtype, window):
    capacity, width = 64, 6
    for seed, over in enumerate(VARIANTS):
        target = tiny_model(shape, seed, dtype)
        d = BlockTreeDrafter(drafter_for(target, seed, width, **over), target, TreeShape(False, width, 8, 4, width - 1),
                             capacity, "cpu", window=window)
        model, c = d.step.model, d.step.config  # the drafter's run-time copy: reference modules at its dtype
        head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        cache = torch.zeros(c.layers, 2, c.kv_heads, capacity, c.head_dim, dtype=dtype)
        g = torch.Generator().manual_seed(100 + seed)
        n_ctx = 0
        for n in (13, 1, 4, 6, 2, 5):
            features = torch.randn(n, c.feature_dim, generator=g).to(dtype)
            d.observe(n_ctx, features)
            for i, (k, v) in enumerate(model.context_kv(features[None], torch.arange(n_ctx, n_ctx + n)[None])):
                cache[i, :, :, n_ctx:n_ctx + n] = torch.stack([k[0], v[0]])
            n_ctx += n
            assert torch.equal(d.step.cache[..., :n_ctx, :], cache[..., :n_ctx, :]), (seed, over, n_ctx)
            pending = int(torch.randint(c.vocab, (1,), generator=g))
            tokens, probs = d.distributions(pending, n_ctx, width - 1)
            ref_tokens, ref_probs = reference_step(model, target.embed_tokens.weight, head, cache, pending, n_ctx,
                                                   width, d.topk, window)
            assert tokens == ref_tokens.tolist() and probs == ref_probs.tolist(), (seed, over, n_ctx)


@pytest.mark.parametrize("verify", [VerifyMode.CHAIN, VerifyMode.TREE])
def test_one_drafting_step_launches_a_pinned_number_of_ops(verify, monkeypatch):
    """Counted in a real engine run (bf16 tiny target, 2-layer drafter): every drafting step and every observe, the
    prompt's included (its count does not depend on how many tokens it projects)."""
    target = tiny_model("gqa", 0, torch.bfloat16)
    cfg = EngineConfig(dtype="bfloat16", max_seq_len=128, token_tile=8, drafter=DrafterKind.BLOCK, block_size=8,
                       verify=verify)
    engine = build_engine(cfg, target, frozenset(), "cpu", block_drafter=drafter_for(target, 0, 8))
    step = engine.drafter.step
    seen: dict[str, list[dict]] = {"draft": [], "project": []}
    for name in seen:
        def counted(*args, _real=getattr(step, name), _calls=seen[name]):
            with OpCounter() as counter:
                out = _real(*args)
            _calls.append(dict(counter.ops))
            return out
        monkeypatch.setattr(step, name, counted)
    result = engine.generate(prompt(target.shape.vocab, 10, 0), 16)
    assert len(seen["draft"]) >= 2 and len(seen["project"]) == len(result.steps) + 1
    assert all(ops == DRAFT_OPS for ops in seen["draft"]), seen["draft"][0]
    assert all(ops == PROJECT_OPS for ops in seen["project"]), seen["project"][0]
    assert sum(DRAFT_OPS.values()) == 112 and sum(PROJECT_OPS.values()) == 34


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [0, 7])
def test_triton_attention_step_matches_the_sdpa_step(window):
    """On CUDA the draft's attention is the engine's Triton kernel (block keys at their own positions): other bits
    than SDPA's, the same distributions up to rounding. Run here under the interpreter on a float32 drafter."""
    target = tiny_model("gqa", 3, torch.float32)
    model = drafter_for(target, 3, 8).eval()
    head = target.lm_head.weight if target.lm_head is not None else target.embed_tokens.weight
    steps = [BlockStep(model, target.embed_tokens.weight, head, 64, 8, 5, triton_attention=t, window=window)
             for t in (False, True)]
    g = torch.Generator().manual_seed(3)
    features = torch.randn(20, model.config.feature_dim, generator=g)
    for s in steps:
        s.project(features, torch.arange(20))
    ints = torch.tensor([7, 20])
    (tok_a, p_a), (tok_b, p_b) = (s.draft(ints) for s in steps)
    torch.testing.assert_close(p_b, p_a, atol=1e-4, rtol=1e-3)
    assert torch.equal(tok_a[:, 0], tok_b[:, 0])
    # the Triton path wrote the block's keys at positions 20..27, past the context, which stays untouched
    assert torch.equal(steps[1].cache[:, :, :, :20], steps[0].cache[:, :, :, :20])
