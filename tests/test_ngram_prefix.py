"""ngram_prefix: a block drafter's chain led by prompt lookup. Its proposals (host and device halves) are the lookup's
tokens then the block's; engines with it equal AR on the host and the device loop; configs refuse it where it
cannot apply."""
from __future__ import annotations

import pytest
import torch
from _tiny import prompt
from test_block_drafter import NO_EOS, ar, cfg, damped, quick_drafter

from specpilot.engines.build import build_engine
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.engines.device_drafters import NgramPrefixDeviceDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kw,match", [({"drafter": "ngram"}, "drafter=block"),
                                      ({"drafter": "block", "verify": "tree"}, "verify=chain"),
                                      ({"drafter": "block", "ngram_prefix": 1}, "must be a bool")])
def test_config_refuses_ngram_prefix_where_it_cannot_apply(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{"ngram_prefix": True, **kw})


def test_proposals_are_the_lookup_then_the_block_on_host_and_device():
    model = damped("gqa", 2)
    drafter = quick_drafter(model, 2, 40, block_size=8)
    eng = build_engine(cfg(block_size=8, ngram_prefix=True, device_steps=4), model, NO_EOS, "cpu",
                       block_drafter=drafter)
    host, device = eng.drafter, eng.device_loop.drafter
    assert isinstance(device, NgramPrefixDeviceDrafter)
    g = torch.Generator().manual_seed(0)
    looked_up = 0
    for trial in range(24):
        context = torch.randint(3, 9 if trial % 2 else model.shape.vocab, (20 + trial,), generator=g).tolist()
        eng.generate(context[:-1], 1)  # prefill: the block drafter has observed the context
        want = host.propose(context, 7)
        lookup = host.ngram.propose(context, 7).tokens
        block = host.block.propose(context, 7).tokens
        assert want.tokens == lookup + block[len(lookup):]
        seq = list(context)
        device.begin(seq, len(seq) - 1)
        tokens, probs, proposed = device.draft(torch.tensor([seq[-1], len(seq) - 1]))
        assert tokens[:, 0].tolist() == want.tokens and int(proposed) == 7
        assert probs[:len(lookup), 0].tolist() == [1.0] * len(lookup)
        looked_up += len(lookup) > 0
    assert 5 <= looked_up < 24  # contexts with and without a match


@pytest.mark.parametrize("steps", [1, 4])
def test_engines_with_ngram_prefix_equal_ar_and_commit_more_on_repeats(steps):
    model = damped("gqa", 2)
    drafter = quick_drafter(model, 2, 40, block_size=8)
    p = prompt(model.shape.vocab, 12, 2) * 3  # repeats: lookup matches where the drafter alone guesses
    want = ar(model, p, 60)
    runs = {on: build_engine(cfg(block_size=8, ngram_prefix=on, device_steps=steps), model, NO_EOS, "cpu",
                             block_drafter=drafter).generate(p, 60) for on in (False, True)}
    assert runs[True].tokens == runs[False].tokens == want
    assert runs[True].accepted_per_step > runs[False].accepted_per_step
