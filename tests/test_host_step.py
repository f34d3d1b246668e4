"""Host work per speculative step stays off the per-step path: block layouts (ancestors, depths, padded verify
inputs, their validation) are built once per shape, a chain's accepted features reach the drafter as a view (no
index tensor, which on CUDA is a pageable copy with a stream sync), and the one-pass acceptance equals the
children-list definition. Counts, not wall clock: scripts/host_step_cost.py measures the time."""
from __future__ import annotations

import random

import numpy as np
import pytest
from _tiny import prompt, tiny_model

from specpilot.engines import layout
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig, VerifyMode
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.engine import greedy_accept
from specpilot.engines.layout import tree_anc

pytestmark = pytest.mark.usefixtures("one_thread")
NO_EOS: frozenset[int] = frozenset()


def block_engine(model, verify: VerifyMode, block: int = 6):
    drafter = BlockDrafterModel(BlockDrafterConfig.for_target(model.shape, layers=1, block_size=block)).init_weights(0)
    # device_steps=1: the host loop, whose per-step work these tests count (the device loop has none)
    cfg = EngineConfig(dtype="float32", max_seq_len=256, token_tile=8, drafter=DrafterKind.BLOCK, block_size=block,
                       verify=verify, device_steps=1)
    return build_engine(cfg, model, NO_EOS, "cpu", block_drafter=drafter)


def ar_tokens(model, p, n):
    cfg = EngineConfig(dtype="float32", max_seq_len=256, token_tile=8, drafter=DrafterKind.NONE)
    return build_engine(cfg, model, NO_EOS, "cpu").generate(p, n).tokens


def test_chain_steps_build_each_layout_once_and_observe_views():
    model = tiny_model("gqa", 0)
    engine = block_engine(model, VerifyMode.CHAIN)
    observed = []
    observe = engine.drafter.observe
    engine.drafter.observe = lambda start, features: (observed.append(features), observe(start, features))[1]
    layout.draft_layout.cache_clear()
    layout._verify_layout.cache_clear()
    p = prompt(model.shape.vocab, 12, 1)
    r = engine.generate(p, 60)
    shapes = {s.drafted for s in r.steps}  # the full chain, and shorter ones where few tokens remain
    assert len(r.steps) > 2 * len(shapes)
    for cache in (layout.draft_layout, layout._verify_layout):
        info = cache.cache_info()
        assert info.misses == len(shapes) and info.hits == len(r.steps) - len(shapes), (cache, info, shapes)
    # After the prompt's features, every observe of a chain step reads the verify's feature rows in place.
    assert len(observed) == len(r.steps) + 1
    assert all(f._is_view() for f in observed[1:])
    assert sum(f.shape[0] for f in observed[1:]) == sum(s.accepted + 1 for s in r.steps)
    assert r.tokens == ar_tokens(model, p, 60)


def test_tree_steps_equal_ar_with_cached_layouts():
    model = tiny_model("mha_tied", 1)
    p = prompt(model.shape.vocab, 10, 2)
    ar = ar_tokens(model, p, 40)
    engine = block_engine(model, VerifyMode.TREE)
    assert engine.generate(p, 40).tokens == ar
    assert engine.generate(p, 40).tokens == ar  # again, every layout now from the caches


def test_cached_layouts_are_read_only_and_match_tree_anc():
    lay = layout.draft_layout((-1, 0, 0, 2))
    assert lay.parents == (-1, 0, 1, 1, 3) and lay.depths == (0, 1, 2, 2, 3) and not lay.chain
    assert np.array_equal(lay.anc, tree_anc(list(lay.parents)))
    assert layout.draft_layout((-1, 0, 1)).chain and layout.draft_layout(()).max_depth == 0
    v = layout.verify_layout(5, lay.anc, lay.depths, 0, 8)
    assert (v.width, v.padded) == (8, 8) and v.positions.tolist() == [0, 1, 2, 2, 3, 5, 6, 7]
    for a in (lay.anc, v.anc, v.positions, v.slots):
        with pytest.raises(ValueError):
            a[0] = 0  # shared between steps: a write would corrupt every later step of this shape
    with pytest.raises(ValueError, match="must precede"):
        layout.draft_layout((-1, 1))
    for _ in range(2):  # a rejected block is rejected every time (errors are never cached)
        with pytest.raises(ValueError, match="depths"):
            layout.verify_layout(3, tree_anc([-1, 0, 0]), [0, 1, 2], 0, 8)
    with pytest.raises(ValueError, match="depths"):
        layout.verify_layout(4, tree_anc([-1, 0, 1]), [0, 1, 2], 0, 8)  # anc of 3 rows for a 4-token block


def _accept_by_children(block, parents, argmax):
    """The definition: from the root, repeatedly step to the earliest child whose token is the argmax."""
    path, node = [0], 0
    while True:
        nxt = next((c for c in range(1, len(parents)) if parents[c] == node and block[c] == argmax[node]), None)
        if nxt is None:
            return path, [block[i] for i in path[1:]] + [argmax[node]]
        path.append(nxt)
        node = nxt


def test_one_pass_acceptance_equals_the_children_definition():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 12)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        block = [rng.randrange(3) for _ in range(n)]  # few tokens: many matches and duplicate siblings
        argmax = [rng.randrange(3) for _ in range(n)]
        acc = greedy_accept(block, parents, argmax)
        assert (acc.path, acc.tokens) == _accept_by_children(block, parents, argmax), (block, parents, argmax)

