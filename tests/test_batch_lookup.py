"""Prompt lookup on the device inside the batched step (BatchConfig.device_draft, engines/batch/ngram_drafting.py):
its proposals are the host drafter's, row by row, and every output equals single-request AR."""
from __future__ import annotations

import random

import pytest
import torch
from test_batch import CURVE, MAX_SEQ, NO_EOS, ecfg, micro, scenario

from specpilot.engines.batch import (BatchConfig, BatchEngine, BatchNgramDrafter, BatchRunner, DevicePolicy,
                                     build_batch_engine)
from specpilot.engines.batch.drafting import NgramChainDrafter
from specpilot.engines.batch.ngram_drafting import batch_ngram_lookup, extrapolate_rows
from specpilot.engines.batch.runner import StepEntry
from specpilot.engines.config import ConfigError


def contexts(seed: int, rows: int, width: int, vocab: int = 5):
    """Random low-vocabulary contexts (many repeats) of different lengths in one [rows, width] buffer, junk
    past each row's last token."""
    rng = random.Random(seed)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, width - 12))] for _ in range(rows)]
    buf = torch.randint(0, vocab, (rows, width), generator=torch.Generator().manual_seed(seed))
    for r, seq in enumerate(seqs):
        buf[r, :len(seq)] = torch.tensor(seq)
    return seqs, buf


@pytest.mark.interpreter
@pytest.mark.parametrize("nmin,nmax,k", [(1, 4, 5), (2, 3, 8), (1, 1, 3), (2, 8, 6)])
def test_batch_lookup_equals_the_host_drafter_row_by_row(nmin, nmax, k):
    """Kernel (interpreted) and torch reference: each row's proposal equals NgramChainDrafter's over that row's
    context alone, whatever the junk after it; a context of one token or with no match proposes nothing."""
    seqs, buf = contexts(nmax * 10 + k, 7, 48)
    seqs[0] = buf[0, :1].tolist()  # one token: nothing to match
    positions = torch.tensor([len(s) - 1 for s in seqs])
    for kernel in (False, True):
        drafts, proposed, first = batch_ngram_lookup(buf, positions, nmin, nmax, k, kernel=kernel)
        for r, seq in enumerate(seqs):
            want = NgramChainDrafter(k, nmax, nmin).propose(seq, k)
            assert drafts[r, :proposed[r]].tolist() == want, (kernel, r)
            # where the continuation starts: the proposal is the context from there (the length without a match)
            assert buf[r, first[r]:first[r] + proposed[r]].tolist() == want and first[r] + proposed[r] <= len(seq)
            assert proposed[r] > 0 or first[r] == len(seq)
    assert proposed[0] == 0 and (proposed > 0).any()
    with pytest.raises(ValueError, match="positions"):
        batch_ngram_lookup(buf, positions[:3], nmin, nmax, k)
    with pytest.raises(ValueError, match="ngram_min"):
        batch_ngram_lookup(buf, positions, 3, 2, k)


def test_batch_ngram_drafter_observes_steps_and_drafts_from_the_pending_token():
    """Two rows fed as the runner feeds them (a prompt chunk; a verify block whose last draft was rejected, its
    slot then rewritten by the pending token), a row outside the step (-1) and padding: each active row's chain
    is the host drafter's over its committed sequence + pending token; the outside row proposes nothing."""
    d = BatchNgramDrafter(rows=3, capacity=32, depth=4, ngram_min=1, ngram_max=3, device="cpu")
    a = [1, 2, 3, 1, 2, 3, 1]  # row 0: prompt of 7
    b = [5, 6, 5, 6]  # row 2: 4 committed, then a verify block [5, 6, 9] whose 9 is rejected
    ids = torch.tensor(a + b + [7, 7])
    rows = torch.tensor([0] * 7 + [2] * 4 + [-1, -1])
    pos = torch.tensor(list(range(7)) + list(range(4)) + [0, 0])
    d.observe(None, ids, rows, pos)
    d.observe(None, torch.tensor([5, 6, 9]), torch.tensor([2, 2, 2]), torch.tensor([4, 5, 6]))
    # the target accepted 5 6 and answered 5: row 2's pending token 5 at position 6 (over the rejected 9)
    out = d.draft_on_device(torch.tensor([2, 0, 5]), torch.tensor([7, -1, 6]))
    assert out.shape == (3, 5)
    chains = [d.chain(row) for row in out.tolist()]
    assert chains[0] == NgramChainDrafter(4, 3, 1).propose(a + [2], 4) == [3, 1, 2]
    assert chains[2] == NgramChainDrafter(4, 3, 1).propose(b + [5, 6, 5], 4) == [6, 5]
    assert chains[1] == []
    with pytest.raises(ValueError, match="pending"):
        d.draft_on_device(torch.tensor([1]), torch.tensor([1]))


@pytest.mark.interpreter
@pytest.mark.parametrize("mechanisms", [("device_draft",), ("device_draft", "extrapolate"), ("all",)])
def test_device_lookup_outputs_equal_single_request_ar(mechanisms):
    """The batched engine drafting by device lookup alone, and with every mechanism ("all": goodput lengths,
    verify budget, both chosen on the device), graph buckets emulated: every output equals single-request AR; the
    lookup proposed drafts, with no host drafter, and each step's draft equals the host drafter's proposal for that
    request's sequence (cut to the length the mechanisms chose)."""
    specs, refs, eos, want = scenario("g2", 0)
    specs = [s.__class__(s.id, tuple(list(s.prompt) * 2), s.max_new_tokens, s.arrival_s) for s in specs]  # repeats
    want = {s.id: r for s, r in zip(specs, _ar(specs))}
    cfg = ecfg(drafter="ngram", draft_len=4)
    batch = BatchConfig.with_mechanisms(*mechanisms, max_batch=3, prefill_chunk=16, graph_max_tokens=32,
                                        max_draft_len=6, cost_curve=CURVE)
    engine = build_batch_engine(micro("g2", 0), cfg, batch, NO_EOS, "cpu", emulate_graphs=True)
    seen = []
    plan = engine._draft

    def recorded(decode, prefill_tokens):
        assert all(r.drafter is None for r in decode)  # nothing drafts on the host
        assert all((r.estimate is None) == (engine.policy is not None) for r in decode)  # nor estimates, with a policy
        drafts = plan(decode, prefill_tokens)
        seen.extend((list(r.seq), d) for r, d in zip(decode, drafts))
        return drafts

    engine._draft = recorded
    res = engine.run(specs)
    assert {r.id: r.tokens for r in res.requests} == want
    assert engine.device is engine.runner.drafters[0] and sum(r.accepted for r in res.requests) > 0
    assert (engine.policy is not None) == (mechanisms == ("all",))
    if engine.policy is not None:  # the device's estimates saw the drafts accepted
        assert engine.policy.successes.sum() > 0
    k = engine.k_max
    for seq, draft in seen:  # (a host drafter per sequence: it indexes one growing sequence)
        host = NgramChainDrafter(k, cfg.ngram_max, cfg.ngram_min, batch.extrapolate, engine.runner.vocab)
        assert draft == host.propose(seq, k)[:len(draft)]
    assert any(k_ for k_ in engine.runner._graphs if k_[1])  # the drafting variant of the graphs ran


@pytest.mark.interpreter
def test_extrapolating_host_lookup_outputs_equal_single_request_ar():
    """extrapolate with the lookup on the host (goodput lengths too): every output equals single-request AR."""
    specs, refs, eos, want = scenario("g2", 0)
    cfg = ecfg(drafter="ngram", draft_len=4)
    batch = BatchConfig.with_mechanisms("goodput_draft", "extrapolate", max_batch=3, prefill_chunk=16, max_draft_len=6,
                                        cost_curve=CURVE)
    engine = build_batch_engine(micro("g2", 0), cfg, batch, eos, "cpu")
    res = engine.run(specs)
    assert {r.id: r.tokens for r in res.requests} == want
    with pytest.raises(ConfigError, match="extrapolate"):
        build_batch_engine(micro("g2", 0), ecfg(drafter="none"), batch, NO_EOS, "cpu")


def _ar(specs):
    from test_batch import single_ar
    return [single_ar("g2", 0, s.prompt, s.max_new_tokens) for s in specs]


@pytest.mark.interpreter
def test_device_lookup_rejects_what_it_cannot_serve():
    model = micro("g2", 0)
    with pytest.raises(ConfigError, match="drafter=ngram"):
        build_batch_engine(model, ecfg(drafter="none"), BatchConfig(max_batch=2, device_draft=True), NO_EOS, "cpu")
    runner = BatchRunner(model, ecfg(drafter="ngram"), BatchConfig(max_batch=2), "cpu", max_block=6)
    with pytest.raises(ConfigError, match="one BatchNgramDrafter without a policy, not extrapolating; it has 0"):
        BatchEngine(runner, ecfg(drafter="ngram"), BatchConfig(max_batch=2, device_draft=True), NO_EOS)
    plain = BatchRunner(model, ecfg(drafter="ngram"), BatchConfig(max_batch=2), "cpu", max_block=6,
                        drafters=[BatchNgramDrafter(2, MAX_SEQ, 5, 1, 4, "cpu")])
    with pytest.raises(ConfigError, match="with a DevicePolicy"):  # goodput on the device needs the policy
        BatchEngine(plain, ecfg(drafter="ngram", draft_len=5), BatchConfig.with_mechanisms(
            "goodput_draft", "device_draft", max_batch=2, max_draft_len=5, cost_curve=CURVE), NO_EOS)
    with pytest.raises(ValueError, match="the policy has 2 rows x 4 tokens"):
        BatchNgramDrafter(2, MAX_SEQ, 5, 1, 4, "cpu", policy=DevicePolicy(2, 4, "cpu"))
    lookup = BatchNgramDrafter(2, MAX_SEQ, 5, 2, 4, "cpu")
    runner = BatchRunner(model, ecfg(drafter="ngram"), BatchConfig(max_batch=2), "cpu", max_block=6,
                         drafters=[lookup])
    with pytest.raises(ConfigError, match="not this engine's"):
        BatchEngine(runner, ecfg(drafter="ngram"), BatchConfig(max_batch=2, device_draft=True), NO_EOS)
    with pytest.raises(ValueError, match="rows"):
        BatchRunner(model, ecfg(drafter="ngram"), BatchConfig(max_batch=3), "cpu", max_block=6, drafters=[lookup])
    with pytest.raises(ValueError, match="ngram_min"):
        BatchNgramDrafter(2, MAX_SEQ, 5, 3, 2, "cpu")
    two = BatchRunner(model, ecfg(drafter="ngram"), BatchConfig(max_batch=2), "cpu", max_block=6,
                      drafters=[lookup, BatchNgramDrafter(2, MAX_SEQ, 5, 1, 4, "cpu")])
    with pytest.raises(ValueError, match="one drafter; it has 2"):
        two.launch([StepEntry(0, [1], 0)], draft=True)


DIGIT = 10  # token id of "0" in these tests: digits are consecutive ids, as in SmolLM2's vocabulary


def counting(start: int, step: int, periods: int, tail: int) -> list[int]:
    """`if n == <number>: return` periods with a count that goes up by `step`: 100 101 d d d 102 103 ..., then the
    first `tail` tokens of the next period."""
    out: list[int] = []
    for i in range(periods + 1):
        digits = [DIGIT + int(c) for c in f"{start + i * step:03d}"]
        out += [100, 101, *digits, 102, 103]
    return out[:len(out) - 7 + tail]


def test_extrapolate_period_continues_a_count():
    """The lookup copies the last period (the old number); extrapolated, the proposal counts on, and a proposal of
    the whole period goes on repeating it, counting, up to the draft length; text whose last two periods mostly
    differ stays a copy, and a step past the vocabulary stays the old token."""
    seq = counting(214, 2, 2, 2)  # ... 100 101 2 1 6 102 103 | 100 101 -> the lookup's match: "if n ==" 2 1 6
    plain = NgramChainDrafter(8, 4, 1).propose(seq, 8)
    ext = NgramChainDrafter(8, 4, 1, extrapolate=True, vocab=200).propose(seq, 8)
    assert plain == [DIGIT + 2, DIGIT + 1, DIGIT + 6, 102, 103, 100, 101]  # one period: the lookup stops there
    assert ext == [DIGIT + 2, DIGIT + 1, DIGIT + 8, 102, 103, 100, 101, DIGIT + 2]  # 216 -> 218, then "2" of 220
    # 18 >= vocab: the old digit, still repeated
    assert NgramChainDrafter(8, 4, 1, extrapolate=True, vocab=DIGIT + 7).propose(seq, 8) == plain + [DIGIT + 2]
    # no carry: 211 212 | 100 101 -> 2 1 3 ... 2 1 4 ... 2 1 5, three periods ahead, cut at the draft length
    seq = counting(211, 1, 2, 2)
    want = [t for n in (213, 214, 215) for t in [DIGIT + 2, DIGIT + 1, DIGIT + n % 10, 102, 103, 100, 101]]
    assert NgramChainDrafter(32, 4, 1, extrapolate=True, vocab=200).propose(seq, 19) == want[:19]
    assert NgramChainDrafter(32, 4, 1, extrapolate=True, vocab=200).propose(seq, 5) == want[:5]  # within the period
    noisy = [100, 101, 1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9, 10, 11, 12, 100, 101]  # periods agree on 2 of 8
    assert NgramChainDrafter(8, 4, 1, extrapolate=True, vocab=200).propose(noisy, 8) == \
        NgramChainDrafter(8, 4, 1).propose(noisy, 8)
    with pytest.raises(ValueError, match="vocabulary"):
        NgramChainDrafter(8, 4, 1, extrapolate=True)


@pytest.mark.interpreter
def test_extrapolated_rows_equal_the_host_drafter():
    """extrapolate_rows on the device lookup's output (interpreted kernel and torch reference) equals the host
    drafter's extrapolated proposal row by row: counting text of several steps and periods, and random text."""
    rng = random.Random(3)
    seqs = [counting(rng.randrange(100, 800), rng.choice([1, 2, 3, -1]), rng.randrange(1, 5), rng.randrange(0, 7))
            for _ in range(6)] + contexts(5, 3, 60)[0]
    width = 80
    buf = torch.zeros(len(seqs), width, dtype=torch.int64)
    for r, s in enumerate(seqs):
        buf[r, :len(s)] = torch.tensor(s)
    positions = torch.tensor([len(s) - 1 for s in seqs])
    for kernel in (False, True):
        drafts, proposed, first = batch_ngram_lookup(buf, positions, 1, 4, 8, kernel=kernel)
        ext, count = extrapolate_rows(buf, positions + 1, first, drafts, proposed, 200)
        for r, s in enumerate(seqs):
            want = NgramChainDrafter(8, 4, 1, extrapolate=True, vocab=200).propose(s, 8)
            assert ext[r, :count[r]].tolist() == want, (kernel, r)
    assert not torch.equal(ext, drafts)  # some count went on
    assert (count > proposed).any()  # some loop was repeated past its period
