"""ngram_prefix: a block drafter (chain or tree) led by prompt lookup. Its per-depth candidates (host and device
halves) are the lookup's token then the block's; engines with it equal AR on the host and the device loop; configs
refuse it where it cannot apply."""
from __future__ import annotations

import pytest
import torch
from _tiny import prompt
from test_block_drafter import NO_EOS, ar, cfg, damped, quick_drafter
from test_device_loop import TREE

from specpilot.engines.build import build_engine
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.engines.device_drafters import NgramPrefixDeviceDrafter
from specpilot.engines.loop_kernels import lead_rows
from specpilot.engines.drafters.ngram_prefix import LeadGate, lead_with

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kw,match", [({"drafter": "ngram"}, "drafter=block"),
                                      ({"drafter": "block", "verify": "two_level"}, "verify=chain or tree"),
                                      ({"drafter": "block", "ngram_prefix": 1}, "must be a bool"),
                                      ({"drafter": "block", "ngram_prefix": False, "lookup_agree_topk": 2},
                                       "needs ngram_prefix=true"),
                                      ({"drafter": "block", "lookup_agree_topk": -1}, "lookup_agree_topk"),
                                      ({"drafter": "block", "lookup_agree_topk": True}, "lookup_agree_topk"),
                                      ({"drafter": "block", "lookup_doubt_prob": 1.5}, "lookup_doubt_prob")])
def test_config_refuses_ngram_prefix_where_it_cannot_apply(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{"ngram_prefix": True, **kw})


def test_lead_with_puts_the_lookup_first_and_drops_its_duplicate():
    assert lead_with(5, [7, 5, 9], [0.5, 0.3, 0.1]) == ([5, 7, 9], [1.0, 0.5, 0.1])
    assert lead_with(5, [7, 8, 9], [0.5, 0.3, 0.1]) == ([5, 7, 8], [1.0, 0.5, 0.3])
    assert lead_with(5, [5], [0.9]) == ([5], [1.0])


def test_the_device_rows_lead_as_the_host_does():
    tokens = [[7, 5, 9], [7, 8, 9], [5, 7, 9], [7, 9, 5], [4, 6, 2]]
    probs = [[0.5, 0.3, 0.1], [0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.4, 0.3, 0.2], [0.7, 0.1, 0.05]]
    lead = [5, 5, 5, 5, 3]
    use = [True, True, True, True, False]  # the last depth: past the lookup's match
    got_t, got_p = lead_rows(torch.tensor(tokens), torch.tensor(probs), torch.tensor(lead), torch.tensor(use))
    for d in range(5):
        want = lead_with(lead[d], tokens[d], probs[d]) if use[d] else (tokens[d], probs[d])
        assert got_t[d].tolist() == want[0]
        torch.testing.assert_close(got_p[d], torch.tensor(want[1]))
    assert got_t[:4].tolist() == [[5, 7, 9], [5, 7, 8], [5, 7, 9], [5, 7, 9]]


GATES = [{}, {"lookup_agree_topk": 2, "lookup_doubt_prob": 0.14}]  # the quick drafter: p(top-1) 0.07-0.18


def test_the_gate_reads_its_config():
    assert LeadGate.from_config(0, 0.5) is None
    gate = LeadGate.from_config(2, 0.1)
    assert gate.agree_topk == 2 and gate.doubt_prob == torch.tensor(0.1, dtype=torch.float32).item() != 0.1
    with pytest.raises(ValueError, match="agree_topk"):
        LeadGate(0, 0.5)


@pytest.mark.parametrize("gated", GATES, ids=["always", "gated"])
@pytest.mark.parametrize("shape", [{}, TREE], ids=["chain", "tree"])
def test_candidates_are_the_lookup_then_the_block_on_host_and_device(shape, gated):
    model = damped("gqa", 2)
    drafter = quick_drafter(model, 2, 40, block_size=8)
    eng = build_engine(cfg(block_size=8, ngram_prefix=True, device_steps=4, **shape, **gated), model, NO_EOS, "cpu",
                       block_drafter=drafter)
    host, device = eng.drafter, eng.device_loop.drafter
    assert isinstance(device, NgramPrefixDeviceDrafter) and (host.gate is None) == (not gated)
    g = torch.Generator().manual_seed(0)
    looked_up = refused = 0
    for trial in range(24):
        context = torch.randint(3, 9 if trial % 2 else model.shape.vocab, (20 + trial,), generator=g).tolist()
        eng.generate(context[:-1], 1)  # prefill: the block drafter has observed the context
        want = host.propose(context, 7)
        lookup = host.ngram.propose(context, 7).tokens
        block = host.block.propose(context, 7)
        if lookup and host.gate is not None and not host.gate.leads(lookup[0], block.topk_tokens[0],
                                                                     block.topk_probs[0]):
            lookup, refused = [], refused + 1
        rows = [lead_with(t, block.topk_tokens[d], block.topk_probs[d]) for d, t in enumerate(lookup)]
        assert want.topk_tokens == [r[0] for r in rows] + block.topk_tokens[len(lookup):]
        assert want.topk_probs == [r[1] for r in rows] + block.topk_probs[len(lookup):]
        if not shape:
            assert want.tokens == lookup + block.tokens[len(lookup):]
        else:  # the match is the tree's main path: the first child at every depth it covers
            path, node = [], -1
            while len(path) < len(lookup):
                node = next(i for i, p in enumerate(want.parents) if p == node)
                path.append(want.tokens[node])
            assert path == lookup
        seq = list(context)
        device.begin(seq, len(seq) - 1)
        draft = device.draft(torch.tensor([seq[-1], len(seq) - 1]))
        tokens, probs = lead_rows(draft.tokens, draft.probs, draft.lead, torch.arange(7) < draft.lead_depths)
        assert tokens[:7].tolist() == want.topk_tokens and int(draft.proposed) == 7
        assert probs[:7].tolist() == want.topk_probs
        looked_up += len(lookup) > 0
    assert 5 <= looked_up < 24  # contexts with and without a match
    assert (refused > 0) == bool(gated)  # and matches the gate refused


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("shape", [{}, TREE], ids=["chain", "tree"])
def test_engines_with_ngram_prefix_equal_ar_and_commit_more_on_repeats(shape, steps):
    model = damped("gqa", 2)
    drafter = quick_drafter(model, 2, 40, block_size=8)
    p = prompt(model.shape.vocab, 12, 2) * 3  # repeats: lookup matches where the drafter alone guesses
    want = ar(model, p, 60)
    variants = {"off": {"ngram_prefix": False}, "always": {"ngram_prefix": True},
                "gated": {"ngram_prefix": True, **GATES[1]}}
    runs = {name: build_engine(cfg(block_size=8, device_steps=steps, **shape, **kw), model, NO_EOS, "cpu",
                               block_drafter=drafter).generate(p, 60) for name, kw in variants.items()}
    assert all(r.tokens == want for r in runs.values())
    assert runs["always"].accepted_per_step > runs["off"].accepted_per_step
    assert runs["gated"].accepted_per_step > runs["off"].accepted_per_step


def test_a_lookup_led_static_tree_keeps_the_full_depth_main_path():
    model = damped("gqa", 2)
    eng = build_engine(cfg(block_size=6, ngram_prefix=True, device_steps=4, **TREE), model, NO_EOS, "cpu",
                       block_drafter=quick_drafter(model, 2, 40, block_size=6))  # depth 5, budget 7
    eng.warm_up(prompt(model.shape.vocab, 12, 2) * 3)
    tree = eng.device_loop.tree
    assert eng.device_loop.spine and tree is not None
    assert tree.parents[:5] == (-1, 0, 1, 2, 3) and tree.ranks[:5] == (0,) * 5  # the rank-0 path, full depth
    assert len(tree.parents) == 7 and tree.ranks[5] == 1  # then the best sibling (and its rank-0 child)
