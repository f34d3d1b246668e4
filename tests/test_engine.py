"""The engine is lossless: speculative output == the engine's own AR output, token for token."""
from __future__ import annotations

import pytest
import torch
from _tiny import SHAPES, prompt, tiny_model

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.engine import SpecEngine, greedy_accept
from specpilot.engines.runner import ModelRunner

NO_EOS: frozenset[int] = frozenset()


def cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "max_seq_len": 320, "token_tile": 8, **kw})


def ar_tokens(model, p, n, eos=NO_EOS, **kw):
    return build_engine(cfg(drafter=DrafterKind.NONE, **kw), model, eos, "cpu").generate(p, n).tokens


class OracleDrafter:
    """Proposes a known continuation (optionally corrupted), as a chain or as a tree with decoy siblings."""

    def __init__(self, prompt_len: int, reference: list[int], corrupt_from: int | None = None, decoys: bool = False,
                 vocab: int = 100, k: int = 5):
        self.prompt_len, self.ref, self.corrupt_from, self.decoys, self.vocab = prompt_len, reference, corrupt_from, decoys, vocab
        self.k = k

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        done = len(context) - self.prompt_len
        want = self.ref[done:done + min(self.k, max_depth)]
        toks = [(t + 1) % self.vocab if self.corrupt_from is not None and d >= self.corrupt_from else t
                for d, t in enumerate(want)]
        if not self.decoys:
            return DraftTree.chain(toks)
        tokens, parents, prev = [], [], -1
        for t in toks:  # a wrong sibling first, then the right token, each depth hanging off the right one
            tokens += [(t + 3) % self.vocab, t]
            parents += [prev, prev]
            prev = len(tokens) - 1
        return DraftTree(tokens, parents, [1.0] * len(tokens))


def oracle_engine(model, drafter, eos=NO_EOS, draft_len=5, tile=8):
    c = cfg(drafter=DrafterKind.NGRAM, draft_len=draft_len, token_tile=tile)
    runner = ModelRunner(model, c, "cpu", block_width=32)
    return SpecEngine(runner, drafter, eos)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_and_draft_model_equal_ar(shape, seed):
    model = tiny_model(shape, seed)
    p = prompt(model.shape.vocab, 24, seed)
    ref = ar_tokens(model, p, 64)
    assert len(set(ref)) > 5, "degenerate test model: output must vary"
    for kind, k in ((DrafterKind.NGRAM, 3), (DrafterKind.NGRAM, 7), (DrafterKind.DRAFT_MODEL, 4)):
        engine = build_engine(cfg(drafter=kind, draft_len=k), model, NO_EOS, "cpu", draft_model=tiny_model(shape, seed + 9))
        assert engine.generate(p, 64).tokens == ref, (kind, k)


def test_draft_model_equal_to_target_accepts_almost_everything():
    model = tiny_model("gqa", 3)
    p = prompt(model.shape.vocab, 16, 3)
    ref = ar_tokens(model, p, 60)
    r = build_engine(cfg(drafter=DrafterKind.DRAFT_MODEL, draft_len=4), model, NO_EOS, "cpu", draft_model=model).generate(p, 60)
    assert r.tokens == ref
    assert r.accepted_per_step > 3.0  # same weights, different shapes: only near-ties may differ


def test_bf16_spec_equals_ar_with_batch_invariant_shapes():
    model = tiny_model("gqa", 4, dtype=torch.bfloat16)
    p = prompt(model.shape.vocab, 20, 4)
    ref = ar_tokens(model, p, 64, dtype="bfloat16")
    for k in (2, 5):
        e = build_engine(cfg(drafter=DrafterKind.NGRAM, draft_len=k, dtype="bfloat16"), model, NO_EOS, "cpu")
        assert e.generate(p, 64).tokens == ref


def test_everything_accepted():
    model = tiny_model("gqa", 5)
    p = prompt(model.shape.vocab, 12, 5)
    ref = ar_tokens(model, p, 41)
    r = oracle_engine(model, OracleDrafter(len(p), ref), draft_len=5).generate(p, 41)
    assert r.tokens == ref
    assert [s.committed for s in r.steps] == [6] * 6 + [4]  # 1 (prefill) + 6 x (5 drafts + bonus) + 4 = 41
    assert all(s.accepted == s.drafted for s in r.steps)


def test_nothing_accepted():
    model = tiny_model("gqa", 6)
    p = prompt(model.shape.vocab, 12, 6)
    ref = ar_tokens(model, p, 30)
    r = oracle_engine(model, OracleDrafter(len(p), ref, corrupt_from=0, vocab=model.shape.vocab)).generate(p, 30)
    assert r.tokens == ref
    assert all(s.accepted == 0 and s.committed == 1 for s in r.steps)


def test_partial_acceptance_rejects_from_first_mismatch():
    model = tiny_model("gqa", 7)
    p = prompt(model.shape.vocab, 12, 7)
    ref = ar_tokens(model, p, 40)
    r = oracle_engine(model, OracleDrafter(len(p), ref, corrupt_from=2, vocab=model.shape.vocab)).generate(p, 40)
    assert r.tokens == ref
    assert all(s.accepted == min(2, s.drafted) for s in r.steps)


def test_eos_inside_an_accepted_block():
    model = tiny_model("mqa", 1)
    p = prompt(model.shape.vocab, 12, 1)
    free = ar_tokens(model, p, 60)
    j = next(i for i in range(8, 60) if free[i] not in free[:i])  # first occurrence of a fresh token
    eos = frozenset({free[j]})
    ref = ar_tokens(model, p, 60, eos=eos)
    assert ref == free[:j + 1]
    r = oracle_engine(model, OracleDrafter(len(p), free, k=7), eos=eos, draft_len=7).generate(p, 60)
    assert r.tokens == ref and r.stop_reason == "eos"
    assert any(s.accepted > 0 and free[j] in ref[-s.committed:] for s in r.steps[-1:])  # stopped inside a block


def test_max_tokens_reached_mid_block():
    model = tiny_model("gqa", 8)
    p = prompt(model.shape.vocab, 12, 8)
    ref = ar_tokens(model, p, 60)
    for n in (1, 2, 9, 10, 11, 13):
        r = oracle_engine(model, OracleDrafter(len(p), ref), draft_len=5).generate(p, n)
        assert r.tokens == ref[:n] and r.stop_reason == "max_tokens", n


def test_tree_with_decoy_siblings_commits_the_right_path():
    model = tiny_model("mha_tied", 0)
    p = prompt(model.shape.vocab, 12, 0)
    ref = ar_tokens(model, p, 50)
    drafter = OracleDrafter(len(p), ref, decoys=True, vocab=model.shape.vocab)
    r = oracle_engine(model, drafter, draft_len=5).generate(p, 50)
    assert r.tokens == ref  # decoys occupy the first slots: KV of the accepted path must be moved into place
    assert max(s.committed for s in r.steps) > 3


def test_greedy_accept_edge_cases():
    # block: root + nodes; parents index into the block
    assert greedy_accept([9, 1, 2], [-1, 0, 1], [5, 0, 0]).tokens == [5]  # nothing accepted: bonus only
    assert greedy_accept([9, 1, 2], [-1, 0, 1], [1, 2, 7]).tokens == [1, 2, 7]  # all + bonus
    acc = greedy_accept([9, 4, 1, 2, 3], [-1, 0, 0, 2, 2], [1, 0, 3, 0, 8])  # branch: 1 -> {2, 3}; target says 3
    assert acc.path == [0, 2, 4] and acc.tokens == [1, 3, 8]
    acc = greedy_accept([9, 1, 1], [-1, 0, 0], [1, 5, 6])  # duplicate siblings: earliest wins
    assert acc.path == [0, 1] and acc.tokens == [1, 5]


def test_ngram_drafter_proposes_most_recent_longest_match():
    d = NgramDrafter(draft_len=3, ngram_max=3, ngram_min=1)
    ctx = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    assert d.propose(ctx, 8).tokens == [5, 6, 7]  # "2 3" last seen before "5 6 7"
    assert d.propose(ctx + [5, 6], 8).tokens == [7, 2, 3]  # "3 5 6" -> "7 2 3"
    assert d.propose([1, 2, 3], 8).tokens == []  # no earlier occurrence
    assert d.propose(ctx, 2).tokens == [5, 6]  # depth limit


def test_fast_shapes_mode_runs_and_is_reported_separately():
    """batch_invariant=False runs each step at its own width (fastest AR); exactness is only claimed with it on."""
    model = tiny_model("gqa", 2)
    p = prompt(model.shape.vocab, 16, 2)
    r = build_engine(cfg(drafter=DrafterKind.NONE, batch_invariant=False), model, NO_EOS, "cpu").generate(p, 20)
    assert len(r.tokens) == 20


def test_bad_inputs_raise_clear_errors():
    model = tiny_model("gqa", 0)
    e = build_engine(cfg(drafter=DrafterKind.NONE), model, NO_EOS, "cpu")
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.generate([5, 6], 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        e.generate([5] * 300, 64)
    with pytest.raises(ValueError, match="draft_len"):
        EngineConfig(draft_len=0)
    runner = ModelRunner(model, cfg(drafter=DrafterKind.NONE), "cpu", block_width=16)
    with pytest.raises(ValueError, match="empty prompt"):
        runner.prefill([])
    max_len = runner.cfg.max_seq_len
    with pytest.raises(ValueError, match=f"prompt of {max_len} tokens does not fit max_seq_len={max_len}"):
        runner.prefill([5] * max_len)  # no slot left for the first generated token
    assert len(runner.prefill([5] * (max_len - 1)).argmax) == 1


@pytest.mark.parametrize("steps", [2, 4, 8])
def test_ar_steps_per_sync_change_no_token(steps):
    """AR with several steps per host round trip (ModelRunner.decode) commits the same tokens, stops at EOS inside
    a chained run and at the token limit mid-run, and keeps one trace per token."""
    model = tiny_model("gqa", 3)
    p = prompt(model.shape.vocab, 10, 3)
    c = cfg(drafter=DrafterKind.NONE)

    def run(k, n, eos=NO_EOS):
        return SpecEngine(ModelRunner(model, c, "cpu", block_width=16), None, eos, ar_steps=k).generate(p, n)
    one = run(1, 40)
    assert one.tokens == ar_tokens(model, p, 40)
    for n in (1, 2, 3, 5, 17, 40):
        r = run(steps, n)
        assert r.tokens == one.tokens[:n] and r.stop_reason == "max_tokens", n
        assert len(r.steps) == n - 1 and all(s.committed == 1 for s in r.steps)  # the first token is prefill's
    j = next(i for i in range(3, 40) if one.tokens[i] not in one.tokens[:i] and i % steps)  # EOS mid-run
    r = run(steps, 40, eos=frozenset({one.tokens[j]}))
    assert r.tokens == one.tokens[:j + 1] and r.stop_reason == "eos"


def chained_and_single_steps(runner, p, steps):
    """(ModelRunner.decode's tokens, the same steps as one-token verifies) from the same prefilled prompt."""
    runner.begin_request(len(p) + 20)
    first = runner.prefill(p).argmax[0]
    chained = runner.decode(len(p), first, steps)
    runner.prefill(p)
    tok, singles = first, []
    for i in range(steps):
        tok = runner.verify(len(p) + i, [tok], [0], [[True]]).argmax[0]
        singles.append(tok)
    return chained, singles


def test_decode_equals_one_token_verifies():
    model = tiny_model("mha_tied", 4)
    runner = ModelRunner(model, cfg(drafter=DrafterKind.NONE), "cpu", block_width=16)
    p = prompt(model.shape.vocab, 9, 4)
    chained, singles = chained_and_single_steps(runner, p, 6)
    assert chained == singles
    with pytest.raises(ValueError, match="steps=17"):
        runner.decode(len(p), singles[0], 17)


def test_ar_steps_is_an_engine_knob():
    """EngineConfig.ar_steps reaches the AR engine build_engine makes (same tokens at any value) and is validated."""
    from specpilot.engines.build import build_engine
    from specpilot.engines.config import ConfigError, EngineConfig

    model = tiny_model("gqa", 3)
    p = prompt(model.shape.vocab, 10, 3)
    outs = []
    for k in (1, 8):
        eng = build_engine(cfg(drafter=DrafterKind.NONE, ar_steps=k), model, NO_EOS, "cpu")
        assert eng.ar_steps == k
        outs.append(eng.generate(p, 21).tokens)
    assert outs[0] == outs[1]
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ConfigError, match="ar_steps"):
            EngineConfig(ar_steps=bad)


def test_decode_ends_at_a_stop_id():
    """With stop ids (the engine's EOS), a chained decode returns the tokens up to and including the first stop id:
    the steps after it, which the engine would drop, do not run."""
    model = tiny_model("mha_tied", 4)
    runner = ModelRunner(model, cfg(drafter=DrafterKind.NONE), "cpu", block_width=16)
    p = prompt(model.shape.vocab, 9, 4)
    _, singles = chained_and_single_steps(runner, p, 8)
    j = next(i for i in range(1, 7) if singles[i] not in singles[:i])
    runner.stop_decodes_on(frozenset({singles[j], -5}))
    chained, _ = chained_and_single_steps(runner, p, 8)
    assert chained == singles[:j + 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the chained-step graph)")
def test_decode_graph_equals_one_token_verifies_on_gpu():
    """The chained decode graph; with stop ids, its steps after a stop id are skipped on the device (a conditional
    node a step: engines.graph_if), their argmax slots left at -1."""
    from specpilot.engines.graph_if import GuardedChain

    model = tiny_model("gqa", 5, dtype=torch.bfloat16).to("cuda")
    c = cfg(drafter=DrafterKind.NONE, kernel_backend="triton", cuda_graphs=True)
    runner = ModelRunner(model, c, "cuda", block_width=16)
    p = prompt(model.shape.vocab, 9, 5)
    chained, singles = chained_and_single_steps(runner, p, 8)
    assert chained == singles
    j = next(i for i in range(1, 7) if singles[i] not in singles[:i])
    runner.stop_decodes_on(frozenset({singles[j]}))
    for _ in range(2):  # the second replay: stale tokens of the first are not read as this one's
        chained, _ = chained_and_single_steps(runner, p, 8)
        g = runner._graphs["decode", 8]
        assert isinstance(g.graph, GuardedChain) and chained == singles[:j + 1]
        assert g.host_argmax.tolist() == singles[:j + 1] + [-1] * (7 - j)
    runner.stop_decodes_on(frozenset({-7}))  # a stop id never produced: all 8 steps run
    assert chained_and_single_steps(runner, p, 8)[0] == singles


def test_warm_up_generates_and_captures_nothing_without_graphs():
    model = tiny_model("mha_tied", 4)
    eng = build_engine(cfg(drafter=DrafterKind.NONE), model, frozenset(), "cpu")
    p = prompt(model.shape.vocab, 9, 4)
    eng.warm_up(p, 3)
    assert eng.target.capture_all(decode_steps=4) == 0
    assert eng.generate(p, 12).tokens == build_engine(cfg(drafter=DrafterKind.NONE), model, frozenset(),
                                                      "cpu").generate(p, 12).tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
def test_warm_up_captures_every_graph_a_generation_replays():
    """After warm_up no generation captures a graph (nor compiles a kernel inside a timed step)."""
    model = tiny_model("gqa", 5, dtype=torch.bfloat16).to("cuda")
    for drafter in (DrafterKind.NONE, DrafterKind.NGRAM):
        eng = build_engine(cfg(drafter=drafter, kernel_backend="triton", cuda_graphs=True), model, frozenset(),
                           "cuda")
        p = prompt(model.shape.vocab, 9, 5) * 3
        eng.warm_up(p, 2)
        before = set(eng.target._graphs)
        eng.generate(p, 40)
        assert set(eng.target._graphs) == before, drafter


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_one_row_tiles_keep_speculative_output_equal_to_ar(shape):
    """A build whose kernel table puts every projection on one-row CUDA-core tiles (row_tile=1): its n-gram
    speculative output equals its own AR output token for token (the variant is invariant across T too)."""
    from specpilot.kernels.table import check_invariance
    from specpilot.stages.kernel_specs import projection_table

    model = tiny_model(shape, 6)
    sh = model.shape
    # 64-column tiles: a quarter of the interpreted programs of 16-column ones (this test took 258 + 184 s of CI
    # with 16 and 30 tokens); any block_n is one reduction tree per shape, what the test is about
    pairs = projection_table(sh, row_tile=1, block_n=64)
    assert len(pairs) == 5
    check_invariance(pairs)
    p = prompt(sh.vocab, 12, 6) * 3  # repeats: the n-gram drafter gets accepted blocks
    kw = {"kernel_backend": "triton", "kernel_table": pairs}
    ar = build_engine(cfg(drafter=DrafterKind.NONE, **kw), model, frozenset(), "cpu").generate(p, 16)
    spec = build_engine(cfg(drafter=DrafterKind.NGRAM, **kw), model, frozenset(), "cpu").generate(p, 16)
    assert spec.tokens == ar.tokens
    assert max(s.verify_tokens for s in spec.steps) > 1, "no verify block longer than one token ran"
