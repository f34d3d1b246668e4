"""The device loop (block drafter, several speculative steps per host round trip, chains and calibrated static
trees) gives the host loop's tokens and AR's, stops where they stop, hands over to the host loop where its steps
would not fit, and stays out of the way of policies that must see every step."""
from __future__ import annotations

import contextlib

import pytest
import torch
from _tiny import prompt, tiny_model
from test_block_drafter import NO_EOS, ar, cfg, damped, quick_drafter

from specpilot.engines.build import build_engine
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.engines.device_drafters import NgramDeviceDrafter, ngram_lookup, ngram_lookup_ref
from specpilot.engines.drafters.ngram_prefix import LeadGate
from specpilot.engines.device_loop import CALIBRATION_STEPS, StaticTree
from specpilot.engines.engine import StepBudgets
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape
from specpilot.engines.graph_if import GuardedGraph, unsupported_reason
from specpilot.engines.side_stream import SideStream
from specpilot.engines.policy import EnginePolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(model, drafter, eos=NO_EOS, **kw):
    return build_engine(cfg(**kw), model, eos, "cpu", block_drafter=drafter)


@pytest.mark.parametrize("shape", ["gqa", "mha_tied"])
def test_device_steps_equal_host_steps_and_ar(shape):
    accepted = []
    for seed in range(4):
        model = damped(shape, seed)
        drafter = quick_drafter(model, seed, 40)
        p = prompt(model.shape.vocab, 10, seed)
        want = ar(model, p, 37)  # not a multiple of any chunk's tokens
        host = engine(model, drafter, device_steps=1)
        assert host.device_loop is None
        host_run = host.generate(p, 37)
        assert host_run.tokens == want
        for k in (2, 4, 8):
            eng = engine(model, drafter, device_steps=k)
            assert eng.device_loop is not None
            r = eng.generate(p, 37)
            assert r.tokens == want, (shape, seed, k)
            assert r.stop_reason == "max_tokens"
            assert sum(s.committed for s in r.steps) == len(r.tokens) - 1  # the first token comes from prefill
            assert [s.position for s in r.steps] == [s.position for s in host_run.steps][:len(r.steps)]
            # Device steps share one wall time (draft_s 0); only a last step with one token to go drafts nothing,
            # on the host.
            assert all(s.draft_s == 0.0 and s.verify_s > 0 and len(s.topk_tokens) == s.depth == 3 for s in r.steps
                       if s.drafted)
            assert [s.target_tokens[:s.committed] for s in r.steps] == \
                [want[s.position - len(p):s.position - len(p) + s.committed] for s in r.steps]
            accepted += [s.accepted for s in r.steps]
    assert max(accepted) == 3 and sum(a > 0 for a in accepted) > 20  # steps really accept drafts


def test_device_steps_stop_at_eos_inside_a_chunk(monkeypatch):
    """The device tracks the host's stop rule: a chunk's results end at the step that stopped (the steps after it,
    which a captured graph skips, are dropped), and a device rule that disagrees with the host's is an error."""
    import specpilot.engines.device_loop as device_loop

    model = damped("gqa", 1)
    drafter = quick_drafter(model, 1, 40)
    p = prompt(model.shape.vocab, 10, 1)
    want = ar(model, p, 40)
    eos = frozenset({want[17]})
    cut = want[:want.index(want[17]) + 1]
    results, collect = [], device_loop.DeviceLoop._collect
    monkeypatch.setattr(device_loop.DeviceLoop, "_collect", lambda self, *a: results.append(
        collect(self, *a)) or results[-1])
    for k in (1, 4, 8):
        results.clear()
        eng = engine(model, drafter, eos, device_steps=k)
        r = eng.generate(p, 40)
        assert (r.tokens, r.stop_reason) == (cut, "eos"), k
        if k > 1:
            assert eng.device_loop.stop is not None and results[-1].stopped
            assert not any(res.stopped for res in results[:-1])
            assert int(results[-1].accepted[-1]) == r.steps[-1].accepted  # the stop is the chunk's last step
    eng = engine(model, drafter, eos, device_steps=8)
    eng.device_loop.stop_on(frozenset({next(t for t in cut[1:-1] if t not in eos)}))  # not the host's rule
    with pytest.raises(RuntimeError, match="where the host did not"):
        eng.generate(p, 40)


def test_the_host_loop_takes_over_where_device_steps_would_not_fit():
    """Near the end of the cache a chunk of steps could write past it: those steps run on the host (draft_s > 0)."""
    model = damped("mha_tied", 2)
    drafter = quick_drafter(model, 2, 40)
    p = prompt(model.shape.vocab, 10, 2)
    eng = build_engine(cfg(device_steps=4, max_seq_len=64), model, NO_EOS, "cpu", block_drafter=drafter)
    r = eng.generate(p, 52)
    want = build_engine(cfg(drafter="none", max_seq_len=64), model, NO_EOS, "cpu").generate(p, 52).tokens
    assert r.tokens == want
    host_full_depth = [s.draft_s > 0 and s.drafted == 3 for s in r.steps]
    assert not host_full_depth[0] and any(host_full_depth[-5:])  # device steps first, host steps at the end
    with pytest.raises(ValueError, match="do not fit"):
        eng.device_loop.run(p + want[:51], 4)  # the pending token at slot 60


def test_run_refuses_a_drafter_that_has_not_seen_the_context():
    model = tiny_model("gqa", 0)
    eng = engine(model, quick_drafter(model, 0), device_steps=4)
    with pytest.raises(RuntimeError, match="features for 0 positions"):
        eng.device_loop.run([7] * 6, 2)


def test_a_policy_with_its_own_stop_rule_keeps_steps_past_the_device_stop():
    class NoStop(EnginePolicy):  # commits everything: the engine's EOS never stops it
        def commit(self, new, eos, remaining):
            return new[:remaining], False

    model = damped("gqa", 1)
    drafter = quick_drafter(model, 1, 40)
    p = prompt(model.shape.vocab, 10, 1)
    want = ar(model, p, 40)
    eng = build_engine(cfg(device_steps=4), model, frozenset({want[3]}), "cpu", block_drafter=drafter,
                       policy=NoStop())
    assert eng.device_loop is not None and eng.device_loop.stop is None
    assert eng.generate(p, 40).tokens == want


def test_a_policy_that_picks_depths_keeps_the_host_loop():
    class Shallow(EnginePolicy):
        def draft_depth(self, history, default):
            return 1

    model = damped("gqa", 0)
    drafter = quick_drafter(model, 0, 40)
    eng = build_engine(cfg(device_steps=4), model, NO_EOS, "cpu", block_drafter=drafter, policy=Shallow())
    assert eng.device_loop is None
    p = prompt(model.shape.vocab, 10, 0)
    r = eng.generate(p, 20)
    assert r.tokens == ar(model, p, 20) and all(s.drafted <= 1 for s in r.steps)


def test_wide_chains_and_two_level_keep_the_host_loop():
    model = tiny_model("gqa", 0)
    drafter = quick_drafter(model, 0, block_size=16)
    assert engine(model, drafter, verify="two_level", device_steps=4, block_size=16).device_loop is None
    # 16 rows at a tile of 8 take two forwards a step: the host loop runs them.
    assert engine(model, drafter, device_steps=4, block_size=16).device_loop is None
    assert engine(model, drafter, device_steps=4, block_size=16, token_tile=16).device_loop is not None


def test_static_tree_is_the_best_first_tree_of_mean_probabilities():
    mean = [[0.9, 0.05, 0.01], [0.8, 0.1, 0.0]]
    # depth 1 rank 0 (0.9), its rank-0 child (0.72), then that node's rank-1 sibling (0.09) before depth-1 rank 1
    assert StaticTree.calibrated(mean, 3, 2) == StaticTree((-1, 0, 0), (0, 0, 1))
    assert StaticTree.calibrated(mean, 4, 3) == StaticTree((-1, 0, 0, -1), (0, 0, 1, 1))
    assert StaticTree.calibrated(mean, 9, 1) == StaticTree.chain(2) == StaticTree((-1, 0), (0, 0))


TREE = dict(verify="tree", tree_budget=7, level_one_keep=4, position_ordered_attention=True, device_tree="calibrated")


def tree_case(shape: str, seed: int, tokens: int = 90):
    """(model, its quick drafter, a prompt, AR's tokens with position-ordered attention) for the tree tests."""
    model = damped(shape, seed)
    p = prompt(model.shape.vocab, 10, seed)
    want = build_engine(cfg(drafter="none", position_ordered_attention=True), model, NO_EOS, "cpu").generate(
        p, tokens).tokens
    return model, quick_drafter(model, seed, 40), p, want


@pytest.mark.parametrize("shape", ["gqa", "mha_tied"])
def test_tree_device_steps_calibrate_a_static_tree_and_equal_ar(shape):
    deep = 0
    for seed in range(2):
        model, drafter, p, want = tree_case(shape, seed)
        eng = engine(model, drafter, device_steps=4, **TREE)
        assert not eng.device_loop.ready
        r = eng.generate(p, 90)
        assert r.tokens == want, (shape, seed)
        host = [s for s in r.steps if s.draft_s > 0 and s.drafted]  # the calibrating host steps
        device = [s for s in r.steps if s.draft_s == 0]
        assert len(host) == CALIBRATION_STEPS and r.steps[:len(host)] == host and device and eng.device_loop.ready
        tree = eng.device_loop.tree
        assert len(tree.parents) == 7 and all(s.drafted == 7 and s.verify_tokens == 8 for s in device)
        assert eng.generate(p, 90).tokens == want  # the next request runs on the device from its first step
        deep += sum(s.accepted >= 2 for s in device)
    assert deep >= 3  # static trees accept whole paths


PER_STEP = dict(TREE, device_tree="per_step")


@pytest.mark.parametrize("shape", ["gqa", "mha_tied"])
def test_per_step_trees_are_the_host_loops_trees_and_equal_ar(shape):
    """device_tree=per_step: the device grows each step's best-first tree from that step's candidates, so its steps
    accept what the host loop's steps accept (the host loop's tree is the same best-first tree), from the first step
    (nothing to calibrate), and the tokens are AR's."""
    deep = 0
    for seed in range(3):
        model, drafter, p, want = tree_case(shape, seed)
        host = engine(model, drafter, device_steps=1, **PER_STEP).generate(p, 90)
        eng = engine(model, drafter, device_steps=4, **PER_STEP)
        assert eng.device_loop.ready and eng.device_loop.tree is None
        r = eng.generate(p, 90)
        assert r.tokens == host.tokens == want, (shape, seed)
        device = [s for s in r.steps if s.draft_s == 0]
        assert len(device) >= len(r.steps) - 1 and all(s.drafted == 7 and s.verify_tokens == 8 for s in device)
        # The host loop drafts shallower trees in the last steps (no deeper than the tokens left): compared before.
        full = len(p) + 90 - 4
        assert [(s.position, s.accepted) for s in r.steps if s.position <= full] == \
            [(s.position, s.accepted) for s in host.steps if s.position <= full]
        deep += sum(s.accepted >= 2 for s in device)
    assert deep >= 5


def test_a_drafter_context_window_drafts_otherwise_and_still_equals_ar():
    """drafter_window: the drafter attends to the last few context positions only. Host and device loops draft the
    same windowed trees (the same acceptance step for step), the tokens stay AR's, and the drafts differ from the
    whole-context drafter's."""
    model, drafter, p, want = tree_case("gqa", 1)
    engines = [engine(model, drafter, device_steps=1, **PER_STEP),
               engine(model, drafter, device_steps=1, drafter_window=6, **PER_STEP),
               engine(model, drafter, device_steps=4, drafter_window=6, **PER_STEP)]
    full, host, r = (e.generate(p, 90) for e in engines)
    assert r.tokens == host.tokens == full.tokens == want
    end = len(p) + 90 - 4
    assert [(s.position, s.accepted) for s in r.steps if s.position <= end] == \
        [(s.position, s.accepted) for s in host.steps if s.position <= end]
    # the same cached context (every committed token's features), other distributions past the window
    ints = torch.tensor([5, len(p) + 80])
    (t_full, p_full), (t_win, p_win) = (e.drafter.step.draft(ints) for e in engines[:2])
    assert not torch.equal(p_full, p_win)
    assert torch.equal(engines[0].drafter.step.cache, engines[1].drafter.step.cache)
    for bad in (-1, True, 2.5):
        with pytest.raises(ConfigError, match="drafter_window"):
            cfg(drafter_window=bad)
        with pytest.raises(ValueError, match="window"):
            BlockTreeDrafter(drafter, model, TreeShape.from_config(cfg()), 64, "cpu", window=bad)


def test_a_lookup_deeper_than_the_block_leads_the_tree_past_its_depth():
    """lookup_depth: where the lookup's match runs long, the grown tree follows it past the block's depth (3 here) as
    deep as the budget goes; host loop, device loop and overlapped one-step chunks accept the same, tokens = AR."""
    deeper = 0
    for seed in range(2):
        model = damped("gqa", seed)
        drafter = quick_drafter(model, seed, 40)
        p = prompt(model.shape.vocab, 10, seed) * 2  # the output repeats the prompt for a while: long matches
        want = build_engine(cfg(drafter="none", position_ordered_attention=True), model, NO_EOS, "cpu").generate(
            p, 90).tokens
        lead = dict(PER_STEP, ngram_prefix=True, ngram_min=2)
        block_deep = engine(model, drafter, device_steps=1, **lead).generate(p, 90)
        runs = [engine(model, drafter, lookup_depth=7, **kw, **lead).generate(p, 90)
                for kw in (dict(device_steps=1), dict(device_steps=4), dict(device_steps=1, device_overlap=True))]
        end = len(p) + 90 - 8
        for r in [block_deep] + runs:
            assert r.tokens == want, seed
        assert max(s.accepted for s in block_deep.steps) <= 3
        host = [(s.position, s.accepted) for s in runs[0].steps if s.position <= end]
        for r in runs[1:]:
            assert [(s.position, s.accepted) for s in r.steps if s.position <= end] == host, seed
        deeper += sum(s.accepted > 3 for s in runs[0].steps)
    assert deeper >= 5
    for bad, why in ((dict(lookup_depth=7), "ngram_prefix"),
                     (dict(lookup_depth=7, ngram_prefix=True, verify="chain"), "verify=tree"),
                     (dict(lookup_depth=7, **dict(TREE, ngram_prefix=True)), "per_step"),
                     (dict(lookup_depth=2, **lead), "below the block's depth"),
                     (dict(lookup_depth=128, **lead), "0..127"), (dict(lookup_depth=True, **lead), "lookup_depth")):
        with pytest.raises(ConfigError, match=why):
            cfg(**bad)


@pytest.mark.parametrize("gate", [{}, {"lookup_agree_topk": 2, "lookup_doubt_prob": 0.14}], ids=["lookup", "gated"])
def test_a_step_verifies_the_wide_tree_only_where_the_step_two_before_accepted_enough(gate):
    """narrow_tree_budget: each step's tree budget follows from the step two before it (wide where it accepted >=
    wide_tree_after draft tokens), so the host loop and overlapped one-step chunks (whose next chunk is queued before
    the current one is read) verify the same shapes and accept the same; the tokens are AR's. Also with the lookup
    gated by the block (the quick drafter's top-1: p 0.07-0.18)."""
    model = damped("gqa", 1)
    drafter = quick_drafter(model, 1, 40)
    p = prompt(model.shape.vocab, 10, 1) * 2
    want = build_engine(cfg(drafter="none", position_ordered_attention=True, token_tile=16), model, NO_EOS,
                        "cpu").generate(p, 90).tokens
    kw = dict(PER_STEP, tree_budget=15, narrow_tree_budget=7, wide_tree_after=3, ngram_prefix=True, ngram_min=2,
              lookup_depth=15, lookup_periodic=True, device_steps=1, token_tile=16, **gate)  # one forward: 16 rows
    overlapped = engine(model, drafter, device_overlap=True, **kw)
    host, device = engine(model, drafter, **kw).generate(p, 90), overlapped.generate(p, 90)
    assert host.tokens == device.tokens == want
    loop, seen = overlapped.device_loop, {}
    for budget in (7, 15, 7, 15):  # captured graphs read a shape's slots by address: switching keeps each alive
        loop.use_budget(budget)
        assert seen.setdefault(loop.width, loop.slots) is loop.slots
    end = len(p) + 90 - 16  # the host loop drafts no deeper than the tokens left: compared before
    shapes = [(s.accepted, s.verify_tokens) for s in host.steps if s.position <= end]
    assert [(s.accepted, s.verify_tokens) for s in device.steps if s.position <= end] == shapes
    assert sum(s.draft_s == 0 for s in device.steps) >= len(device.steps) - 2  # on the device
    for j, (acc, rows) in enumerate(shapes):
        assert rows == (16 if j >= 2 and shapes[j - 2][0] >= 3 else 8), j
    assert {rows for _, rows in shapes} == {8, 16} and max(acc for acc, _ in shapes) > 7
    for bad, why in ((dict(kw, device_steps=4), "device_steps=1"), (dict(kw, narrow_tree_budget=15), "1..tree_budget"),
                     (dict(kw, device_tree="calibrated"), "per_step"), (dict(kw, wide_tree_after=-1), "wide_tree_after"),
                     (dict(kw, narrow_tree_budget=True), "narrow_tree_budget")):
        with pytest.raises(ConfigError, match=why):
            cfg(**bad)


def test_step_budgets_follow_the_step_two_before():
    """engine.StepBudgets: deep where the step two before accepted >= deep_after, else wide where >= after, else
    narrow (0: wide); the first two steps have no such step (-1)."""
    three = StepBudgets(7, 15, 3, deep=31, deep_after=10)
    assert [three.following(a) for a in (-1, 0, 2, 3, 9, 10, 31)] == [7, 7, 7, 15, 15, 31, 31]
    assert [StepBudgets(0, 15, 3, 31, 10).following(a) for a in (-1, 3, 10)] == [15, 15, 31]
    assert StepBudgets(7, 15, 3).following(40) == 15 and three.extra == (7, 31)


@pytest.mark.parametrize("deep,chain", [(31, False), (127, False), (31, True), (255, True)])
def test_a_step_verifies_the_deep_tree_where_the_step_two_before_accepted_more(deep, chain):
    """deep_tree_budget: a third budget, 32 rows (two 16-row tiles) where the step two before accepted >=
    deep_tree_after draft tokens; the host loop and overlapped one-step chunks take the same steps, the tokens are
    AR's, and every budget runs. 127: a 128-row tree led by the lookup 127 deep (rows past 64: the grow kernel's
    second ancestor word on the GPU) accepting more than a 64-row tree could. deep_tree_chain: that step a chain of
    its rows (the device's in slot order, no block slots; the host's as long as the lookup or the block drafts,
    the device's rows past it filler), drafting and accepting what the host's does; as a chain it may go past the
    grown tree's 127 nodes (255: a 256-row step)."""
    model = damped("gqa", 2)  # its greedy text settles into a loop the periodic lookup predicts 31 deep
    drafter = quick_drafter(model, 1, 40)
    p = prompt(model.shape.vocab, 10, 1) * 2
    n, seq_len = {31: (90, 512), 127: (400, 512), 255: (800, 1024)}[deep]
    # One forward a block, the device loop's need: torch kernels run the token tile (at most 64), so past 63 nodes
    # the overlapped engine runs the host loop here too (its GPU twin: test_device_steps_on_gpu_..., "deeper" kinds)
    tile = min(deep + 1, 64)
    want = build_engine(cfg(drafter="none", position_ordered_attention=True, token_tile=tile, max_seq_len=seq_len),
                        model, NO_EOS, "cpu").generate(p, n).tokens
    kw = dict(PER_STEP, tree_budget=15, narrow_tree_budget=7, wide_tree_after=3, deep_tree_budget=deep,
              deep_tree_after=8, ngram_prefix=True, ngram_min=2, lookup_depth=deep, lookup_periodic=True, device_steps=1,
              token_tile=tile, max_seq_len=seq_len, deep_tree_chain=chain)
    engines = [engine(model, drafter, **kw, **o) for o in ({}, {"device_overlap": True})]
    assert engines[0].device_loop is None and (engines[1].device_loop is not None) == (deep < 64)
    host, device = (e.generate(p, n) for e in engines)
    assert host.tokens == device.tokens == want
    if deep < 64:  # the device loop ran them
        assert sum(s.draft_s == 0 for s in device.steps) > len(device.steps) // 2
    end = len(p) + n - deep - 1  # the host loop drafts no deeper than the tokens left: compared before
    if chain:  # the host's chain steps verify as many rows as were drafted, the device's all of the deep step's
        deep_steps = [[s for j, s in enumerate(r.steps)
                       if s.position <= end and j >= 2 and r.steps[j - 2].accepted >= 8] for r in (host, device)]
        assert [(s.accepted, s.drafted) for s in deep_steps[0]] == [(s.accepted, s.drafted) for s in deep_steps[1]]
        assert deep_steps[0] and all(s.depth == s.drafted for s in deep_steps[0])
        for s in deep_steps[0] + deep_steps[1]:
            s.verify_tokens = deep + 1
    shapes = [(s.accepted, s.verify_tokens) for s in host.steps if s.position <= end]
    assert [(s.accepted, s.verify_tokens) for s in device.steps if s.position <= end] == shapes
    for j, (acc, rows) in enumerate(shapes):
        before = shapes[j - 2][0] if j >= 2 else -1
        assert rows == (deep + 1 if before >= 8 else 16 if before >= 3 else 8), j
    assert {rows for _, rows in shapes} == {8, 16, deep + 1}
    assert max(acc for acc, rows in shapes if rows == deep + 1) > (deep + 1) // 2 - 1
    for bad, why in ((dict(kw, deep_tree_budget=15), "above tree_budget"),
                     (dict(kw, deep_tree_budget=256 if chain else 128), "deep"),
                     (dict(kw, device_tree="calibrated"), "per_step"),
                     (dict(kw, deep_tree_after=65), "deep_tree_after"),
                     (dict(kw, deep_tree_budget=31.0), "deep_tree_budget"),
                     (dict(kw, deep_tree_budget=255, lookup_depth=255, deep_tree_chain=False), "deep_tree_chain only"),
                     (dict(kw, deep_tree_chain=True, lookup_depth=deep - 1), "lookup at least as deep"),
                     (dict(kw, deep_tree_chain=1), "deep_tree_chain")):
        with pytest.raises(ConfigError, match=why):
            cfg(**bad)


@pytest.mark.interpreter  # a GPU host without the interpreter runs these kernels in its graph tests
@pytest.mark.parametrize("lookup_depth", [0, 7, "switched"])
def test_per_step_trees_with_the_glue_kernels_equal_ar(monkeypatch, lookup_depth):
    """The grow, assemble, tree commit and tree move kernels (interpreted), lookup-led (also past the block's depth,
    and switching between a 16- and an 8-row tree per step), where the CPU loop runs their torch references."""
    import specpilot.engines.device_loop as device_loop

    monkeypatch.setattr(device_loop, "grow_tree_ref", device_loop.grow_tree)
    monkeypatch.setattr(device_loop, "assemble_ref", device_loop.assemble)
    monkeypatch.setattr(device_loop, "tree_commit_ref", device_loop.tree_commit)
    monkeypatch.setattr(device_loop, "tree_move_ref", device_loop.tree_move)
    model = damped("gqa", 1)
    p = prompt(model.shape.vocab, 10, 1) * 2
    switched = dict(tree_budget=15, narrow_tree_budget=7, wide_tree_after=3, lookup_depth=15, lookup_periodic=True,
                    device_steps=1, device_overlap=True, token_tile=16)
    kw = switched if lookup_depth == "switched" else dict(device_steps=4, lookup_depth=lookup_depth)
    want = build_engine(cfg(drafter="none", position_ordered_attention=True, token_tile=kw.get("token_tile", 8)),
                        model, NO_EOS, "cpu").generate(p, 40).tokens
    eng = engine(model, quick_drafter(model, 1, 40), ngram_prefix=True, **{**PER_STEP, **kw})
    r = eng.generate(p, 40)
    device = [s for s in r.steps if s.draft_s == 0]
    assert r.tokens == want and device and any(s.accepted >= (4 if lookup_depth else 2) for s in device)
    if lookup_depth == "switched":
        assert {s.verify_tokens for s in device} == {8, 16}


@pytest.mark.interpreter
def test_tree_device_steps_with_the_glue_kernels_equal_ar(monkeypatch):
    """The loop's assemble, tree commit and tree move kernels (interpreted) where the CPU loop runs their torch
    references."""
    import specpilot.engines.device_loop as device_loop

    monkeypatch.setattr(device_loop, "assemble_ref", device_loop.assemble)
    monkeypatch.setattr(device_loop, "tree_commit_ref", device_loop.tree_commit)
    monkeypatch.setattr(device_loop, "tree_move_ref", device_loop.tree_move)
    model = damped("gqa", 1)
    p = prompt(model.shape.vocab, 10, 1)
    want = build_engine(cfg(drafter="none", position_ordered_attention=True), model, NO_EOS, "cpu").generate(
        p, 60).tokens
    eng = engine(model, quick_drafter(model, 1, 40), device_steps=4, **TREE)
    eng.warm_up(p)
    r = eng.generate(p, 60)
    device = [s for s in r.steps if s.draft_s == 0]
    assert r.tokens == want and device and any(s.accepted >= 2 for s in device)


def test_warm_up_calibrates_the_static_tree():
    model = damped("gqa", 0)
    eng = engine(model, quick_drafter(model, 0, 40), device_steps=4, **TREE)
    eng.warm_up(prompt(model.shape.vocab, 10, 0))
    assert eng.device_loop.ready


@pytest.mark.interpreter
@pytest.mark.parametrize("nmin,nmax,k,periodic", [(1, 4, 5, False), (2, 3, 7, False), (1, 1, 3, False),
                                                  (2, 8, 6, False), (1, 4, 12, True), (2, 8, 31, True)])
def test_device_ngram_proposals_equal_the_host_drafters(nmin, nmax, k, periodic):
    """Over contexts with repeats (and none), the device lookup (kernel and torch reference) proposes NgramDrafter's
    tokens: as many as it proposes (its proposal can end at the context's end, or with `periodic` repeat), the rest
    filler not counted."""
    g = torch.Generator().manual_seed(nmin * 100 + nmax * 10 + k)
    host = NgramDrafter(k, nmax, nmin, periodic)
    dev = NgramDeviceDrafter(NgramDrafter(k, nmax, nmin, periodic), 96, torch.device("cpu"))
    seen = 0
    for trial in range(60):
        vocab = int(torch.randint(3, 12, (1,), generator=g))  # small vocabularies: many matches
        context = torch.randint(0, vocab, (int(torch.randint(1, 80, (1,), generator=g)),), generator=g).tolist()
        if trial % 7 == 0:
            context = list(range(len(context)))  # no repeats: no proposal
        want = host.propose(context, k).tokens
        seq = list(context)  # a new request to the device half
        dev.begin(seq, len(seq) - 1)
        state = torch.tensor([seq[-1], len(seq) - 1])
        draft = dev.draft(state)  # on CPU the torch reference
        tokens, proposed = draft.tokens, draft.proposed
        assert int(proposed) == len(want) and tokens[:len(want), 0].tolist() == want, (trial, context)
        kernel_tokens, kernel_proposed = ngram_lookup(dev.sequence, state, nmin, nmax, k,
                                                      periodic=periodic)  # interpreted here
        assert torch.equal(kernel_tokens, tokens[:, 0]) and int(kernel_proposed) == int(proposed)
        seen += len(want) > 0
    assert seen > 20


def test_a_periodic_lookup_repeats_a_loop_past_the_contexts_end():
    """A match whose continuation reaches the pending token: the plain lookup proposes what is left, the periodic
    one the loop's turns again (the text since the occurrence, repeated)."""
    context = [9, 1, 2, 3, 1, 2, 3]  # "2 3" last occurred 3 tokens back: the continuation is 1 2 3, then the end
    assert NgramDrafter(7, 2, 2).propose(context, 7).tokens == [1, 2, 3]
    assert NgramDrafter(7, 2, 2, periodic=True).propose(context, 7).tokens == [1, 2, 3, 1, 2, 3, 1]
    assert NgramDrafter(2, 2, 2, periodic=True).propose(context, 7).tokens == [1, 2]
    assert NgramDrafter(7, 2, 2, periodic=True).propose([4, 5, 6, 4], 7).tokens == []  # "6 4" never occurred


@pytest.mark.interpreter
def test_device_lookup_over_several_scan_blocks_takes_the_longest_suffix_then_the_latest():
    """Contexts longer than the kernel's 1024-token scan block: the longest suffix wins over a later shorter match
    in another block, and of two equally long ones the later wins, across blocks (the packed max)."""
    filler = [3 + i % 40 for i in range(2600)]  # no repeat of the suffix below: period 40 over tokens 3..42
    suffix = [50, 51, 52, 53, 54, 55, 56, 57]
    cases = {  # context -> the continuation the host drafter proposes
        "longest in the first block": suffix + [60, 61] + filler[:1500] + suffix[-3:] + [70] + filler[:1200] + suffix,
        "latest of two equal ones": suffix + [60] + filler[:1500] + suffix + [80, 81] + filler[:900] + suffix,
        "none": filler + [99]}
    for name, context in cases.items():
        k = 4
        want = NgramDrafter(k, 8, 2).propose(context, k).tokens
        tokens = torch.tensor(context + [0] * (k + 1))
        state = torch.tensor([context[-1], len(context) - 1])
        for lookup in (ngram_lookup_ref, ngram_lookup):  # the kernel interpreted here
            draft, proposed = lookup(tokens, state, 2, 8, k)
            assert int(proposed) == len(want) and draft[:len(want)].tolist() == want, (name, lookup)
    assert NgramDrafter(4, 8, 2).propose(cases["longest in the first block"], 4).tokens[:2] == [60, 61]
    assert NgramDrafter(4, 8, 2).propose(cases["latest of two equal ones"], 4).tokens[:2] == [80, 81]


@pytest.mark.interpreter
def test_a_gated_device_lookup_proposes_only_where_the_block_does_not_contradict_it():
    """LeadGate on the device (kernel, interpreted, and torch reference) against the host rule, over hand-built
    depth-1 candidates: the match's first token among the first agree_topk of them, or the block's top-1 in doubt."""
    gate = LeadGate(2, 0.5)
    seq = [5, 6, 7, 1, 5, 6]  # the suffix [5, 6] matched at 0: the proposal is [7, 1, 5, 6]
    dev = NgramDeviceDrafter(NgramDrafter(4, 2, 1), 32, torch.device("cpu"))
    dev.begin(seq, len(seq) - 1)
    state = torch.tensor([seq[-1], len(seq) - 1])
    cases = [([7, 9, 3], [0.9, 0.05, 0.01], True),  # agrees at rank 1
             ([9, 7, 3], [0.9, 0.05, 0.01], True),  # rank 2
             ([9, 3, 7], [0.9, 0.05, 0.01], False),  # rank 3: past agree_topk, and the block is sure
             ([9, 3, 7], [0.4999, 0.3, 0.1], True),  # the block is in doubt
             ([9, 3, 7], [0.5, 0.3, 0.1], False)]  # exactly at doubt_prob: not in doubt
    for tokens, probs, leads in cases:
        assert gate.leads(7, tokens, probs) == leads
        cand, cand_p = torch.tensor(tokens), torch.tensor(probs)
        for lookup in (ngram_lookup_ref, ngram_lookup):
            draft, proposed = lookup(dev.sequence, state, 1, 2, 4, gate, cand, cand_p)
            assert draft.tolist() == [7, 1, 5, 6] and int(proposed) == (4 if leads else 0), (lookup, tokens, probs)
    with pytest.raises(ValueError, match="gate comes with"):
        ngram_lookup_ref(dev.sequence, state, 1, 2, 4, gate)


def test_device_ngram_steps_equal_host_steps_and_ar():
    model = damped("gqa", 2)  # its text repeats: the lookup finds matches that hold for 5 tokens
    p = prompt(model.shape.vocab, 12, 2) * 3
    want = ar(model, p, 60)
    host = build_engine(cfg(drafter="ngram", draft_len=5, device_steps=1), model, NO_EOS, "cpu").generate(p, 60)
    eng = build_engine(cfg(drafter="ngram", draft_len=5, device_steps=4), model, NO_EOS, "cpu")
    assert isinstance(eng.device_loop.drafter, NgramDeviceDrafter)
    for _ in range(2):  # a second request starts its device copy of the sequence afresh
        r = eng.generate(p, 60)
        assert r.tokens == want == host.tokens
        device = [s for s in r.steps if s.draft_s == 0]
        assert len(device) > len(r.steps) // 2 and any(s.accepted >= 3 for s in device)
        assert all(s.accepted <= s.drafted <= 5 for s in r.steps)
    # the same proposals as the host loop's: the same acceptance, step for step, until the last few tokens
    n = len(r.steps) - 3
    assert [s.accepted for s in r.steps[:n]] == [s.accepted for s in host.steps[:n]]


OVERLAP_KINDS = {"block chain": {}, "block tree": TREE, "ngram": {"drafter": "ngram", "draft_len": 5},
                 "prefix chain": {"ngram_prefix": True}}


@pytest.mark.parametrize("kind", list(OVERLAP_KINDS))
def test_overlapped_chunks_equal_ar_stop_where_it_stops_and_cost_one_queued_chunk(kind, monkeypatch):
    """device_overlap queues each next chunk (from the device's state) before the current one is read: the tokens
    stay AR's at every chunk size, at the token limit and at an EOS inside a chunk; a stop leaves exactly one
    chunk queued behind it (launched, never read), and the next request starts clean."""
    import specpilot.engines.device_loop as device_loop

    if kind.startswith("block"):  # a seed whose drafter gets whole chains accepted
        model = damped("mha_tied", 2)
        p = prompt(model.shape.vocab, 10, 2)
    else:  # its text repeats: lookups match
        model = damped("gqa", 2)
        p = prompt(model.shape.vocab, 12, 2) * 3
    want = ar(model, p, 45)
    drafter = None if kind == "ngram" else quick_drafter(model, 2, 40)
    launched, collected = [], []
    launch, collect = device_loop.DeviceLoop._launch, device_loop.DeviceLoop._collect
    monkeypatch.setattr(device_loop.DeviceLoop, "_launch", lambda self, seq, k, origin=0, **kw: launched.append(
        origin) or launch(self, seq, k, origin, **kw))
    monkeypatch.setattr(device_loop.DeviceLoop, "_collect", lambda self, chunk, *a: collected.append(
        chunk.steps) or collect(self, chunk, *a))
    for k in (1, 2, 4):
        for eos in (NO_EOS, frozenset({want[30]})):
            eng = build_engine(cfg(device_steps=k, device_overlap=True, **OVERLAP_KINDS[kind]), model, eos, "cpu",
                               block_drafter=drafter)
            eng.warm_up(p)  # a tree's static shape is calibrated here
            assert eng.device_loop.overlap and eng.device_loop.ready
            cut = want if not eos else want[:want.index(want[30]) + 1]
            for _ in range(2):  # the second request after a stop's queued chunk: the same tokens
                launched.clear(), collected.clear()
                r = eng.generate(p, 45)
                assert (r.tokens, r.stop_reason) == (cut, "eos" if eos else "max_tokens"), (kind, k, eos)
                assert sum(s.committed for s in r.steps) == len(r.tokens) - 1
                assert launched.count(0) < len(launched)  # chunks continued from the device's state
                if eos:  # the stop's chunk was read; the one queued behind it only ran
                    assert len(launched) == len(collected) + 1, (kind, k)
                else:  # the steps really accept drafts
                    device = [s for s in r.steps if s.draft_s == 0]
                    assert len(device) > len(r.steps) // 2 and sum(s.accepted for s in device) >= 5, kind


def test_overlap_hands_over_to_the_host_loop_where_queued_chunks_would_not_fit():
    model = damped("mha_tied", 2)
    drafter = quick_drafter(model, 2, 40)
    p = prompt(model.shape.vocab, 10, 2)
    eng = build_engine(cfg(device_steps=2, device_overlap=True, max_seq_len=64), model, NO_EOS, "cpu",
                       block_drafter=drafter)
    r = eng.generate(p, 52)
    want = build_engine(cfg(drafter="none", max_seq_len=64), model, NO_EOS, "cpu").generate(p, 52).tokens
    assert r.tokens == want
    host_full_depth = [s.draft_s > 0 and s.drafted == 3 for s in r.steps]
    assert not host_full_depth[0] and any(host_full_depth[-5:])


@pytest.mark.parametrize("over", [{"drafter": "none"}, {"verify": "two_level"}, {"drafter": "draft_model"},
                                  {"drafter": "ngram", "verify": "tree"}])
def test_device_overlap_needs_a_drafter_with_a_device_half(over):
    with pytest.raises(ConfigError, match="device_overlap"):
        cfg(device_overlap=True, **over)


@pytest.mark.parametrize("over", [{"verify": "chain"}, {"drafter": "ngram", "verify": "chain"},
                                  {"device_steps": 1}, {"compile": True}, {"observe_overlap": 1}])
def test_observe_overlap_needs_a_block_drafters_tree_on_the_device_loop(over):
    with pytest.raises(ConfigError, match="observe_overlap"):
        cfg(**{**TREE, "observe_overlap": True, **over})


@pytest.mark.parametrize("over", [{"ngram_prefix": False}, {"device_tree": "calibrated"}, {"device_steps": 1},
                                  {"compile": True}, {"lookup_overlap": 1}])
def test_lookup_overlap_needs_a_lookup_led_tree_grown_on_the_device_loop(over):
    with pytest.raises(ConfigError, match="lookup_overlap"):
        cfg(**{**PER_STEP, "ngram_prefix": True, "lookup_overlap": True, **over})


class RecordingSide(SideStream):
    """SideStream in stream order (the CPU), counting forks and joins."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.forks = self.joins = 0

    @contextlib.contextmanager
    def fork(self, *held):
        self.forks += 1
        with super().fork(*held):
            yield

    def join(self):
        self.joins += self.pending
        super().join()


@pytest.mark.parametrize("which", ["observe", "observe switched", "lookup", "both switched"])
def test_steps_beside_the_critical_path_draft_what_the_plain_loop_drafts(monkeypatch, which):
    """observe_overlap and lookup_overlap in stream order (the CPU). observe: each tree step forks its observe of
    every tree row once, inside the target's step, and joins it before the move, which gets the drafter's cache; the
    drafter's context rows end equal to the plain loop's (projected at the rows' tree slots and positions, then
    moved). lookup: each step forks its lookup before the block's draft and joins it before the grow, which gates
    the lead (some refused, some led). Either way every step accepts what the plain loop's step accepts, and the
    tokens are AR's. Switched: 8- and 16-row trees in 1-step chunks. (Seeds whose steps accept side branches, where a
    row's tree slot is not its position: 17 of 24 steps without the lookup.)"""
    import specpilot.engines.device_loop as device_loop

    lookup, observe = which.startswith(("lookup", "both")), which.startswith(("observe", "both"))
    model = damped("gqa", 1)
    p = prompt(model.shape.vocab, 12, 1) * (2 if lookup else 1)
    kw = dict(PER_STEP)
    if lookup:
        kw.update(ngram_prefix=True, lookup_agree_topk=1, lookup_doubt_prob=0.3)
    if "switched" in which:
        kw.update(tree_budget=15, narrow_tree_budget=7, wide_tree_after=3, device_steps=1, device_overlap=True,
                  token_tile=16)
    want = build_engine(cfg(drafter="none", position_ordered_attention=True, token_tile=kw.get("token_tile", 8)),
                        model, NO_EOS, "cpu").generate(p, 48).tokens
    drafter = quick_drafter(model, 1, 40)
    plain = engine(model, drafter, **kw)
    want_steps = plain.generate(p, 48).steps
    eng = engine(model, drafter, **kw, observe_overlap=observe, lookup_overlap=lookup)
    loop = eng.device_loop
    side = loop.side = RecordingSide()
    if observe:
        loop.observe = side
    if lookup:
        loop.drafter.side = side
    moves, grows, move_ref, grow_ref = [], [], device_loop.tree_move_ref, device_loop.grow_tree_ref

    def move(kv, path, accepted, next_state, state, features=None, drafter_cache=None):
        moves.append((side.pending, features is None, drafter_cache is loop.drafter.cache))
        return move_ref(kv, path, accepted, next_state, state, features, drafter_cache)

    def grow(tokens, probs, lead, lead_depths, width, block, ranked=None, gate=None):
        before = None if lead_depths is None else lead_depths.item()
        grow_ref(tokens, probs, lead, lead_depths, width, block, ranked, gate)
        grows.append((side.pending, gate is not None, before, None if lead_depths is None else lead_depths.item()))

    monkeypatch.setattr(device_loop, "tree_move_ref", move)
    monkeypatch.setattr(device_loop, "grow_tree_ref", grow)
    r = eng.generate(p, 48)
    assert r.tokens == want
    device = [s for s in r.steps if s.draft_s == 0]
    # (a chunk may run steps past the token limit: they count nothing)
    assert device and side.forks == side.joins == (observe + lookup) * len(moves) and len(moves) >= len(device)
    assert not side.pending and len(grows) == len(moves) and not any(pending for pending, *_ in grows)
    assert all(m == (False, observe, observe) for m in moves)
    if lookup:
        assert all(gated for _, gated, *_ in grows)
        assert any(b > 0 and a == 0 for *_, b, a in grows) and any(b == a > 0 for *_, b, a in grows)
    assert sum(s.accepted > 0 for s in device) > len(device) // 2
    assert [s.accepted for s in r.steps] == [s.accepted for s in want_steps]
    n = r.steps[-1].position  # every context slot the drafter observed
    assert loop.drafter.cache is not plain.device_loop.drafter.cache
    # Equal bits on the CI host; an H100 host's CPU (another BLAS kernel for these row counts, one thread too) rounded
    # the tree's rows and the path's apart by up to 7.2e-7 (session 59): rows at a wrong slot or position differ more.
    torch.testing.assert_close(loop.drafter.cache[..., :n, :], plain.device_loop.drafter.cache[..., :n, :],
                               rtol=1e-4, atol=1e-5)
    if "switched" in which:
        assert {s.verify_tokens for s in device} == {8, 16}


@pytest.mark.interpreter
def test_the_fused_forward_hands_over_the_features_before_the_layers_after_them():
    """fused_forward(on_features=): called once, when the last captured layer has written its rows (the features
    are the forward's) and before the next layer writes its keys/values (the device loop's observe starts there)."""
    from specpilot.engines.fused import fused_forward, rope_tables_for

    model = damped("gqa", 2)
    sh = model.shape
    tables = rope_tables_for(model, 64, "cpu")
    ids = torch.tensor(prompt(sh.vocab, 6, 2))
    pos = torch.arange(6)
    kv = torch.zeros(2, sh.layers, sh.kv_heads, 64, sh.head_dim)
    seen = []

    def on_features(captured):
        seen.append((captured.clone(), kv[:, 1, :, :6].abs().sum().item(), kv[:, 0, :, :6].abs().sum().item()))

    _, argmax, captured = fused_forward(model, tables, ids, pos, pos, torch.tensor([0]),
                                        torch.tril(torch.ones(6, 6, dtype=torch.bool)), kv[0], kv[1], capture=(0,),
                                        on_features=on_features)
    assert len(seen) == 1 and sh.layers == 2
    got, later_layer, captured_layer = seen[0]
    assert torch.equal(got, captured) and later_layer == 0 and captured_layer > 0


@pytest.mark.parametrize("bad", [0, 17, True, 2.0])
def test_device_steps_is_validated(bad):
    with pytest.raises(ConfigError, match="device_steps"):
        EngineConfig(device_steps=bad)


def test_device_tree_is_validated():
    assert EngineConfig(verify="tree", tree_budget=127).device_tree.value == "per_step"  # the default
    with pytest.raises(ConfigError, match="at most 127 nodes"):
        EngineConfig(verify="tree", tree_budget=128, device_steps=4)
    with pytest.raises(ConfigError, match="at most 127 nodes"):
        EngineConfig(verify="tree", tree_budget=128, device_overlap=True)
    with pytest.raises(ConfigError, match="device_tree='grown'"):
        EngineConfig(device_tree="grown")
    # no limit for the static shape, the host loop (device_steps 1), nor a two-level verify (no device loop)
    for ok in (dict(verify="tree", device_tree="calibrated", device_steps=4), dict(verify="tree", device_steps=1),
               dict(verify="two_level", device_steps=4)):
        assert EngineConfig(tree_budget=128, **ok).tree_budget == 128


@pytest.mark.interpreter
@pytest.mark.parametrize("glue", ["torch", "kernels"])
def test_device_steps_triton_kernels_equal_ar(glue, monkeypatch):
    """The fused forward's kernels, and (glue=kernels) the loop's own assemble / commit kernels, interpreted where
    the CPU loop would run their torch references."""
    if glue == "kernels":
        import specpilot.engines.device_loop as device_loop

        monkeypatch.setattr(device_loop, "assemble_ref", device_loop.assemble)
        monkeypatch.setattr(device_loop, "chain_commit_ref", device_loop.chain_commit)
    model = damped("mha_tied", 2)  # a seed whose drafter gets whole chains accepted
    drafter = quick_drafter(model, 2, 40)
    p = prompt(model.shape.vocab, 10, 2)
    want = build_engine(cfg(drafter="none", kernel_backend="triton"), model, NO_EOS, "cpu").generate(p, 16).tokens
    r = engine(model, drafter, device_steps=4, kernel_backend="triton").generate(p, 16)
    assert r.tokens == want and max(s.accepted for s in r.steps) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("kind", ["block chain", "block tree", "ngram", "prefix tree", "prefix chain overlap",
                                  "prefix tree overlap", "grown tree", "prefix grown tree overlap",
                                  "windowed prefix grown tree overlap", "deep periodic prefix grown tree overlap",
                                  "switched prefix grown tree overlap", "deep switched prefix grown tree overlap",
                                  "deeper switched prefix grown tree overlap",
                                  "observed beside, prefix grown tree overlap",
                                  "observed beside, windowed prefix grown tree overlap",
                                  "observed beside, deeper switched prefix grown tree overlap",
                                  "lookup beside, deeper switched prefix grown tree overlap",
                                  "both beside, deeper switched prefix grown tree overlap",
                                  "deeper switched prefix chain overlap",
                                  "both beside, deeper switched prefix chain overlap",
                                  "deepest switched prefix chain overlap"])
def test_device_steps_on_gpu_replay_captured_graphs_and_equal_ar(kind):
    """On an H200: the loop's graphs (the fused drafter step inside) are captured by warm_up and replayed (with
    overlap, the continuing graphs too); an EOS mid-stream stops where AR stops, and the graphs' conditional nodes
    skip the steps past it."""
    model = damped("gqa", 2).to(device="cuda", dtype=torch.bfloat16)
    p = prompt(model.shape.vocab, 12, 2) * 3
    over = {"block tree": TREE, "ngram": {"drafter": "ngram", "draft_len": 5},
            "prefix tree": {**TREE, "ngram_prefix": True}, "prefix chain overlap": {"ngram_prefix": True},
            "prefix tree overlap": {**TREE, "ngram_prefix": True}, "grown tree": PER_STEP,
            "prefix grown tree overlap": {**PER_STEP, "ngram_prefix": True},
            "windowed prefix grown tree overlap": {**PER_STEP, "ngram_prefix": True, "drafter_window": 8},
            "deep periodic prefix grown tree overlap": {**PER_STEP, "ngram_prefix": True, "lookup_depth": 7,
                                                        "lookup_periodic": True},
            "switched prefix grown tree overlap": {**PER_STEP, "tree_budget": 15, "narrow_tree_budget": 7,
                                                   "wide_tree_after": 2, "ngram_prefix": True, "lookup_depth": 15,
                                                   "lookup_periodic": True},
            "deep switched prefix grown tree overlap": {**PER_STEP, "tree_budget": 15, "narrow_tree_budget": 7,
                                                        "wide_tree_after": 2, "deep_tree_budget": 31,
                                                        "deep_tree_after": 6, "ngram_prefix": True,
                                                        "lookup_depth": 31, "lookup_periodic": True},
            "deeper switched prefix grown tree overlap": {**PER_STEP, "tree_budget": 15, "narrow_tree_budget": 7,
                                                          "wide_tree_after": 2, "deep_tree_budget": 127,
                                                          "deep_tree_after": 6, "ngram_prefix": True,
                                                          "lookup_depth": 127, "lookup_periodic": True,
                                                          "max_seq_len": 512}}
    # EngineConfig.deep_tree_chain: the 128-row deep step a chain, its attention in slot order (no block slots)
    over["deeper switched prefix chain overlap"] = {**over["deeper switched prefix grown tree overlap"],
                                                    "deep_tree_chain": True}
    over["deepest switched prefix chain overlap"] = {**over["deeper switched prefix chain overlap"],  # 256 rows
                                                     "deep_tree_budget": 255, "lookup_depth": 255, "max_seq_len": 1024}
    over = over.get(kind.split("beside, ")[-1], {})
    # EngineConfig.observe_overlap / lookup_overlap (behind a lookup gate): the observe / the lookup on a second stream
    beside = kind.split(" beside, ")[0] if " beside, " in kind else ""
    over = {**over, **({"observe_overlap": True} if beside in ("observed", "both") else {}),
            **({"lookup_overlap": True, "lookup_agree_topk": 2, "lookup_doubt_prob": 0.7}
               if beside in ("lookup", "both") else {})}
    overlap = kind.endswith("overlap")
    c = cfg(dtype="bfloat16", kernel_backend="triton", device_steps=1 if "switched" in kind else 4,
            device_overlap=overlap, **over)
    ar_cfg = c.replace(drafter="none", verify="chain", ngram_prefix=False, device_overlap=False,
                       observe_overlap=False, lookup_overlap=False, lookup_agree_topk=0,
                       device_tree="calibrated", lookup_depth=0, narrow_tree_budget=0, deep_tree_budget=0,
                       deep_tree_chain=False)
    want = build_engine(ar_cfg, model, NO_EOS, "cuda").generate(p, 60).tokens
    drafter = None if kind == "ngram" else quick_drafter(damped("gqa", 2), 2, 40)
    eng = build_engine(c, model, NO_EOS, "cuda", block_drafter=drafter)
    eng.warm_up(p, 2)
    # Fill the allocator's free small blocks with junk: a graph reading a tensor freed after its capture (session
    # 40: switched shapes' slots) then reads junk, not by chance the same values from a look-alike reallocation.
    junk = [torch.full((64,), 1 << 40, dtype=torch.long, device="cuda") for _ in range(512)]
    graphs = set(eng.device_loop._graphs)
    budgets = sorted(eng.device_loop._grown) or [0]  # grown trees' budgets (two when switched), else 0
    assert graphs == {(k, o, b) for k in (1, 2, 4) if k <= c.device_steps for o in ((0, 1, 2) if overlap else (0,))
                      for b in budgets}
    for _ in range(2):
        r = eng.generate(p, 60)
        assert r.tokens == want and set(eng.device_loop._graphs) == graphs
        assert sum(s.draft_s == 0 for s in r.steps) > len(r.steps) // 2
    if beside:  # a race on the drafter's cache or state would change what it drafts, not the tokens
        plain = build_engine(c.replace(observe_overlap=False, lookup_overlap=False), model, NO_EOS, "cuda",
                             block_drafter=drafter)
        plain.warm_up(p, 2)
        assert [s.accepted for s in plain.generate(p, 60).steps] == [s.accepted for s in r.steps]
    del junk
    eos = frozenset({want[40]})
    # With overlap in 1-step chunks, only the chunk queued behind the stop would run past it: it is skipped
    # (engines.graph_if), so the device state is the stop step's (its pending token's slot: base + accepted + 1).
    stopped = build_engine(c.replace(device_steps=1) if overlap else c, model, eos, "cuda", block_drafter=drafter)
    stopped.warm_up(p, 2)
    r = stopped.generate(p, 60)
    assert r.tokens == want[:want.index(want[40]) + 1]
    loop = stopped.device_loop
    assert loop.ctl[2].item() == 0
    if overlap:
        assert isinstance(loop._graphs[1, 1, loop.budget].graph, GuardedGraph) and r.steps[-1].draft_s == 0
        assert loop.state[1].item() == r.steps[-1].position + r.steps[-1].accepted


def test_guarded_graph_structs_match_the_cuda_headers():
    """The driver API structs graph_if builds by hand (cuda.h, CUDA 12.4+): CUgraphNodeParams is 256 bytes with its
    union at byte 16; CUDA_CONDITIONAL_NODE_PARAMS and CUDA_KERNEL_NODE_PARAMS_v2 field offsets."""
    import ctypes

    from specpilot.engines.graph_if import _ConditionalParams, _KernelParams, _NodeParams

    assert ctypes.sizeof(_NodeParams) == 256 and _NodeParams.conditional.offset == 16
    assert [getattr(_ConditionalParams, f).offset for f in ("handle", "type", "size", "graphs_out", "ctx")] == \
        [0, 8, 12, 16, 24]
    assert [getattr(_KernelParams, f).offset for f in ("func", "grid", "block", "shared_mem", "params", "extra",
                                                       "kern", "ctx")] == [0, 8, 20, 32, 40, 48, 56, 64]


def test_guarded_graphs_say_why_they_cannot_run_and_refuse_a_bad_flag():
    if not torch.cuda.is_available():
        assert unsupported_reason() == "no CUDA device"
    with pytest.raises(ValueError, match="one int64 on a CUDA device"):
        GuardedGraph(None, torch.ones(1, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
def test_a_guarded_graph_runs_only_while_its_flag_is_set():
    """A captured graph (torch and Triton kernels, PDL launches, a copy to pinned memory) inside a conditional node:
    each replay runs it only where the flag is nonzero at that point of the stream."""
    from specpilot.kernels._common import capture_graph
    from specpilot.kernels.attn import attention

    assert unsupported_reason() is None
    q, kv = torch.ones(2, 4, 64, device="cuda", dtype=torch.bfloat16), torch.ones(2, 32, 64, device="cuda",
                                                                                    dtype=torch.bfloat16)
    anc = torch.ones(2, 2, dtype=torch.bool, device="cuda")
    count, flag = torch.zeros(1, device="cuda"), torch.ones(1, dtype=torch.long, device="cuda")
    host = torch.zeros(1).pin_memory()

    def body():
        count.add_(attention(q, kv, kv, 8, anc).float().mean())  # values of ones: + 1 a run
        host.copy_(count, non_blocking=True)
    graph, _ = capture_graph(body, warmups=1, keep_graph=True)
    guarded = GuardedGraph(graph, flag)
    count.zero_()
    for f in (1, 0, 0, 1, 1, 0):
        flag.fill_(f)  # queued on the stream before the replay, as the loop's commits set it
        guarded.replay()
    torch.cuda.synchronize()
    assert count.item() == 3 and host.item() == 3
    with pytest.raises(ValueError, match="one int64"):
        GuardedGraph(graph, flag.int())


SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose", "unique_consecutive",
               "_unique2", "masked_select", "repeat_interleave",
               "lift_fresh"}  # a tensor from Python data: on CUDA a pageable copy, which graph capture refuses


@pytest.mark.parametrize("kind", ["block chain", "block tree", "ngram", "prefix tree", "prefix grown tree"])
def test_device_steps_read_nothing_back_to_the_host(kind):
    """What a CUDA graph of k steps captures must not sync: no aten op that reads a value to the host (.item(), a
    tensor's truth value), sizes an output from data (nonzero, masked_select) or makes a tensor from Python data.
    Counted on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in SYNCING_OPS:
                self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model = damped("gqa", 2)
    p = prompt(model.shape.vocab, 12, 2) * 3
    if kind == "ngram":
        eng = build_engine(cfg(drafter="ngram", draft_len=5), model, NO_EOS, "cpu")
    else:
        over = {"block tree": TREE, "prefix tree": {**TREE, "ngram_prefix": True},
                "prefix grown tree": {**PER_STEP, "ngram_prefix": True}}.get(kind, {})
        eng = engine(model, quick_drafter(model, 2, 40), device_steps=4, **over)
    eng.warm_up(p)
    loop = eng.device_loop
    assert loop.ready
    seq = p + eng.generate(p, 20).tokens  # leaves a request's state to step from
    if kind != "ngram" and kind.startswith("prefix"):  # the lookup's device copy of the sequence
        loop.drafter.lookup.begin(seq, len(seq) - 1)
    elif kind == "ngram":
        loop.drafter.begin(seq, len(seq) - 1)
    loop.state.copy_(torch.tensor([seq[-1], len(seq) - 1]))
    with Syncs() as mode:
        loop._steps(4)
    assert mode.seen == []
