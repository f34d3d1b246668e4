"""A block drafter's LM head restricted to the target's most generated tokens (EngineConfig.drafter_head_rows): the
ranking counted from saved training sequences, its file, the kept rows, the steps' mapped top-k, and engines
(host loop, device loop, batched) that draft with it and still give AR's tokens."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _tiny import prompt, tiny_model
from test_block_drafter import NO_EOS, QUICK, ar, cfg, damped, quick_drafter
from test_block_step import drafter_for

from specpilot.drafting.checkpoint import DrafterCheckpointError, load_drafter, save_drafter
from specpilot.drafting.data import DraftData, save_sequences
from specpilot.drafting.objective import LossHead, block_logits, block_loss, sample_batch
from specpilot.drafting.sources import TargetBundle
from specpilot.drafting.token_ranking import (RANKING_FILE, TokenRankingError, generated_counts, load_token_ranking,
                                              padded_counts, ranking_of, save_token_ranking)
from specpilot.drafting.train import TrainConfig, train_drafter
from specpilot.engines.batch.block_drafting import BatchBlockDrafter
from specpilot.engines.build import build_engine
from specpilot.engines.config import ConfigError
from specpilot.engines.drafters.block import head_tokens
from specpilot.engines.drafters.block_fused import FusedBlockStep
from specpilot.engines.drafters.block_step import BlockStep
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")


def sequences(tmp_path, rows: list[list[int]], prompt_lens: list[int]):
    T = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    data = DraftData(tokens, torch.zeros(len(rows), T, 1), torch.tensor(prompt_lens), torch.tensor(list(map(len, rows))))
    return save_sequences(data, tmp_path / "train.safetensors")


def test_counts_take_the_generated_tokens_only_and_rank_ties_by_id(tmp_path):
    f = sequences(tmp_path, [[9, 9, 9, 1, 5, 5], [7, 3, 3, 1]], [3, 1])  # prompts: 9 9 9 | 7
    counts = generated_counts([f], 10)
    assert counts.tolist() == [0, 2, 0, 2, 0, 2, 0, 0, 0, 0]
    assert ranking_of(counts) == [1, 3, 5]
    assert ranking_of(torch.tensor([0, 4, 4, 9, 0])) == [3, 1, 2]


def test_a_ranking_file_round_trips_and_bad_ones_are_refused(tmp_path):
    save_token_ranking(tmp_path, torch.tensor([0, 3, 1, 0, 2]), "test")
    assert load_token_ranking(tmp_path, 5).tolist() == [1, 4, 2]
    assert load_token_ranking(tmp_path / "missing", 5) is None
    with pytest.raises(TokenRankingError, match="5-token vocabulary, the target has 6"):
        load_token_ranking(tmp_path, 6)
    for body, match in (({"format": "specpilot-token-ranking/1", "vocab": 5, "ranking": [1, 1]}, "ranked twice"),
                        ({"format": "other", "vocab": 5, "ranking": [1]}, "not a specpilot-token-ranking"),
                        ({"format": "specpilot-token-ranking/1", "vocab": 5, "ranking": [7]}, "vocabulary")):
        (tmp_path / RANKING_FILE).write_text(json.dumps(body))
        with pytest.raises(TokenRankingError, match=match):
            load_token_ranking(tmp_path, 5)
    (tmp_path / RANKING_FILE).write_text("{")
    with pytest.raises(TokenRankingError, match="unreadable"):
        load_token_ranking(tmp_path, 5)


def test_a_saved_drafter_loads_with_its_ranking_and_a_bad_one_fails_the_load(tmp_path):
    target = tiny_model("gqa", 0, torch.float32)
    save_drafter(drafter_for(target, 0, 8), tmp_path, target)
    assert load_drafter(tmp_path, target).token_ranking is None
    counts = torch.zeros(target.shape.vocab, dtype=torch.long)
    counts[[5, 2, 9]] = torch.tensor([1, 3, 2])
    save_token_ranking(tmp_path, counts, "test")
    assert load_drafter(tmp_path, target).token_ranking.tolist() == [2, 9, 5]
    (tmp_path / RANKING_FILE).write_text("[]")
    with pytest.raises(DrafterCheckpointError, match="not a specpilot-token-ranking"):
        load_drafter(tmp_path, target)


def test_kept_rows_are_the_ranking_topped_up_with_the_lowest_ids_in_ascending_order():
    target = tiny_model("gqa", 0, torch.float32)
    model = drafter_for(target, 0, 8)
    assert head_tokens(model, 0) is None and head_tokens(model, target.shape.vocab) is None
    with pytest.raises(ValueError, match="needs the drafter's token ranking"):
        head_tokens(model, 16)
    model.token_ranking = torch.tensor([40, 3, 17, 2])
    assert head_tokens(model, 3).tolist() == [3, 17, 40]
    assert head_tokens(model, 6).tolist() == [0, 1, 2, 3, 17, 40]


def ranked(model, drafter, seed: int):
    """drafter with a ranking of the target's own greedy outputs (as training would count them)."""
    counts = torch.zeros(model.shape.vocab, dtype=torch.long)
    for i in range(4):
        counts += torch.bincount(torch.tensor(ar(model, prompt(model.shape.vocab, 8, 100 * seed + i), 40)),
                                 minlength=model.shape.vocab)
    drafter.token_ranking = torch.tensor(ranking_of(counts))
    return drafter


@pytest.mark.interpreter
@pytest.mark.parametrize("step", [BlockStep, FusedBlockStep])
def test_a_restricted_head_ranks_the_kept_rows_and_returns_their_token_ids(step):
    """The restricted step's candidates are the kept tokens in the order the whole head's logits rank them, their
    probabilities a softmax over the kept rows only (float32; the fused step under the interpreter)."""
    target = tiny_model("gqa", 3, torch.float32)
    model = drafter_for(target, 3, 8).eval()
    kept = torch.randperm(target.shape.vocab, generator=torch.Generator().manual_seed(1))[:40].sort().values
    head = target.lm_head.weight
    full = BlockStep(model, target.embed_tokens.weight, head, 64, 8, target.shape.vocab, triton_attention=True)
    part = step(model, target.embed_tokens.weight, head[kept], 64, 8, 5, token_map=kept)
    g = torch.Generator().manual_seed(3)
    features = torch.randn(9, model.config.feature_dim, generator=g)
    for s in (full, part):
        s.project(features, torch.arange(9))
    ints = torch.tensor([7, 9])
    (tok_f, p_f), (tok_p, p_p) = full.draft(ints), part.draft(ints)
    inside = torch.isin(tok_f, kept)
    want = torch.stack([row[keep][:5] for row, keep in zip(tok_f, inside)])
    mass = torch.stack([row[keep].sum() for row, keep in zip(p_f, inside)])
    want_p = torch.stack([row[keep][:5] for row, keep in zip(p_f, inside)]) / mass[:, None]
    assert torch.equal(tok_p, want) if step is BlockStep else torch.equal(tok_p[:, 0], want[:, 0])
    torch.testing.assert_close(p_p, want_p, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("kw", [dict(device_steps=1), dict(device_steps=4),
                                pytest.param(dict(device_steps=4, kernel_backend="triton"),
                                             marks=pytest.mark.interpreter),
                                dict(device_steps=4, verify="tree", tree_budget=7, level_one_keep=4, tree_width=2,
                                     ngram_prefix=True, position_ordered_attention=True)])
def test_engines_with_a_restricted_head_draft_kept_tokens_and_equal_ar(kw):
    seed = 1
    model = damped("gqa", seed)
    drafter = ranked(model, quick_drafter(model, seed, 40), seed)
    p = prompt(model.shape.vocab, 10, seed)
    rows, c = 24, cfg(drafter_head_rows=24, **kw)
    want = build_engine(c.ar_twin(), model, NO_EOS, "cpu").generate(p, 40).tokens
    eng = build_engine(c, model, NO_EOS, "cpu", block_drafter=drafter)
    r = eng.generate(p, 40)
    assert r.tokens == want
    kept = set(head_tokens(drafter, rows).tolist())
    block = [t for s in r.steps for row in s.topk_tokens for t in row]
    assert block and (set(block) <= kept or kw.get("ngram_prefix"))  # a lookup's lead is any context token
    assert sum(s.accepted for s in r.steps) > 5  # the kept rows still hold what the target says


def test_a_restricted_head_without_a_ranking_is_a_config_error():
    model = damped("gqa", 1)
    with pytest.raises(ConfigError, match="token ranking"):
        build_engine(cfg(drafter_head_rows=32), model, NO_EOS, "cpu", block_drafter=quick_drafter(model, 1))
    for bad in (-1, 8, 2.5):
        with pytest.raises(ConfigError, match="drafter_head_rows"):
            cfg(drafter_head_rows=bad)


@pytest.mark.parametrize("triton_head", [False, pytest.param(True, marks=pytest.mark.interpreter)])
def test_the_batched_drafter_chains_the_single_request_drafters_kept_top_1(triton_head):
    """Two requests' contexts in one batched cache: each row's chain with the restricted head equals the single-request
    drafter's top-1 chain with the same head rows (triton_head: the fused norm + head + argmax kernel)."""
    target = tiny_model("gqa", 0, torch.float32)
    drafter = drafter_for(target, 1, 5)
    drafter.token_ranking = torch.randperm(target.shape.vocab, generator=torch.Generator().manual_seed(4))[:50]
    g = torch.Generator().manual_seed(2)
    contexts = [torch.randn(n, drafter.config.feature_dim, generator=g) for n in (7, 12)]
    batched = BatchBlockDrafter(drafter, target, 2, 64, "cpu", cuda_graphs=False, triton_head=triton_head,
                                head_rows=20)
    rows = torch.tensor([0] * 7 + [1] * 12)
    batched.observe(torch.cat(contexts), None, rows, torch.cat([torch.arange(7), torch.arange(12)]))
    pending = [5, 9]
    chains = batched.draft([0, 1], pending, [7, 12])
    kept = set(head_tokens(drafter, 20).tolist())
    shape = TreeShape(tree=False, block_size=5, budget=4, width=1, depth=4)
    for ctx, tok, chain in zip(contexts, pending, chains):
        single = BlockTreeDrafter(drafter, target, shape, 64, "cpu", head_rows=20)
        single.observe(0, ctx)
        tokens, _ = single.candidates([1] * ctx.shape[0] + [tok], 4)
        assert chain == [t[0] for t in tokens] and set(chain) <= kept


@pytest.mark.interpreter
def test_rank_tokens_writes_the_ranking_beside_a_drafter(tmp_path, capsys):
    from specpilot.cli import main
    target = tiny_model("gqa", 0, torch.float32)
    save_drafter(drafter_for(target, 0, 8), tmp_path / "d", target)
    f = sequences(tmp_path, [[9, 9, 9, 1, 5, 5], [7, 3, 3, 1]], [3, 1])
    assert main(["drafter", "rank-tokens", "--drafter", str(tmp_path / "d"), str(f)]) == 0
    assert "3 distinct tokens ranked from 6 generated" in capsys.readouterr().out
    assert load_drafter(tmp_path / "d", target).token_ranking.tolist() == [1, 3, 5]
    assert main(["drafter", "rank-tokens", "--drafter", str(tmp_path / "none"), str(f)]) != 0
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.interpreter
def test_the_concurrency_bench_shares_one_drafter_with_its_variants_head_rows():
    """The batched bench's block variants share one drafter: it drafts with their drafter_head_rows (every request
    still equal to its single-request AR output), and variants that disagree on it are refused."""
    from test_batch import MICRO, block_model, ecfg, micro

    from specpilot.bench.batched import Arrival, BatchVariant, block_variants, run_concurrency_bench
    from specpilot.engines.batch import BatchConfig
    model, drafter = micro("mha", 0), block_model("mha", 1)
    drafter.token_ranking = torch.randperm(MICRO["mha"].vocab, generator=torch.Generator().manual_seed(3))
    prompts = [(f"p{i}", prompt(MICRO["mha"].vocab, 9, 40 + i)) for i in range(2)]
    block = block_variants(ecfg(), 5, BatchConfig(max_batch=2))[1]  # led by lookup
    rows = BatchVariant("block+lookup head24", block.engine.replace(drafter_head_rows=24), block.batch)
    report = run_concurrency_bench(model, NO_EOS, prompts, 6, [2], [Arrival.ALL],
                                   [BatchVariant("ar", ecfg(), block.batch), rows], "cpu", block_drafter=drafter,
                                   cost_repeats=1)
    assert report.all_match()
    ar = BatchVariant("ar", ecfg(), block.batch)
    with pytest.raises(ValueError, match="drafter_head_rows"):
        run_concurrency_bench(model, NO_EOS, prompts, 6, [2], [Arrival.ALL], [ar, block, rows], "cpu",
                              block_drafter=drafter)
    drafter.token_ranking = None  # the rows reach the shared drafter: without a ranking it cannot keep them
    with pytest.raises(ValueError, match="token ranking"):
        run_concurrency_bench(model, NO_EOS, prompts, 6, [2], [Arrival.ALL], [ar, rows], "cpu", block_drafter=drafter)


def test_the_loss_head_scores_the_kept_rows_and_drops_targets_outside_them():
    """LossHead at N rows: the drafter's restricted head (drafter_head), targets mapped to its rows, a target outside
    them weighted 0; block_loss over it is the cross-entropy of a softmax over those rows alone."""
    target = tiny_model("gqa", 2, torch.float32)
    model = drafter_for(target, 2, 4)
    model.token_ranking = torch.randperm(target.shape.vocab, generator=torch.Generator().manual_seed(5))
    whole = LossHead.of(model, target)
    assert whole.row_of is None and whole.head is target.lm_head.weight
    scored = LossHead.of(model, target, 30)
    kept = head_tokens(model, 30)
    assert torch.equal(scored.head, target.lm_head.weight[kept])
    g = torch.Generator().manual_seed(6)
    n, t, k = 2, 20, 3
    tokens = torch.randint(0, target.shape.vocab, (n, t), generator=g)
    data = DraftData(tokens, torch.randn(n, t, model.config.feature_dim, generator=g), torch.tensor([4, 6]),
                     torch.tensor([20, 17]))
    batch = sample_batch(data, torch.arange(n), k, model.config.block_size, g)
    assert whole.batch(batch) is batch
    mapped = scored.batch(batch)
    inside = torch.isin(batch.targets, kept)
    assert bool(inside.any()) and bool((~inside).any())
    assert torch.equal(kept[mapped.targets][inside], batch.targets[inside])
    assert torch.equal(mapped.weight, batch.weight * inside)
    m = block_loss(model, target.embed_tokens.weight, scored.head, mapped, 0.0)
    logits = block_logits(model, target.embed_tokens.weight, target.lm_head.weight, batch)[..., kept]
    ce = F.cross_entropy(logits.flatten(0, 2), mapped.targets.flatten(), reduction="none").view_as(mapped.weight)
    torch.testing.assert_close(m.loss, (ce * mapped.weight).sum() / mapped.weight.sum(), rtol=1e-5, atol=1e-6)
    soft = DraftData(tokens, data.features, data.prompt_len, data.length, torch.zeros(n, t, 2, dtype=torch.int32),
                     torch.zeros(n, t, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="soft labels over a restricted LM head"):
        scored.batch(sample_batch(soft, torch.arange(n), k, model.config.block_size, g))


def test_counts_of_padded_sequences_equal_the_saved_files(tmp_path):
    rows, plens = [[9, 9, 9, 1, 5, 5], [7, 3, 3, 1]], [3, 1]
    f = sequences(tmp_path, rows, plens)
    T = max(map(len, rows))
    tokens = torch.tensor([r + [4] * (T - len(r)) for r in rows])  # padding never counts
    assert torch.equal(padded_counts(tokens, torch.tensor(plens), torch.tensor([6, 4]), 10), generated_counts([f], 10))


def test_training_on_the_head_rows_ranks_its_data_and_drafts_from_them(tmp_path):
    """`head_rows`: the drafter trains and is judged on the rows of its data's most generated tokens, saves that
    ranking, and its report's engines draft with drafter_head_rows (equal to AR), accepting more than untrained."""
    model = damped("gqa", 0)
    c = TrainConfig(**{**QUICK, "steps": 300, "head_rows": 24})
    result = train_drafter(TargetBundle("tiny-gqa", model, None, NO_EOS), c, tmp_path / "out")
    rep = result.report
    before = {r["mode"]: r for r in rep["untrained"]["engine"]}
    for r in rep["trained"]["engine"]:
        assert r["equal_to_ar"] and r["committed_per_step"] > before[r["mode"]]["committed_per_step"] + 0.2, r
    saved = load_drafter(tmp_path / "out", model)
    assert torch.equal(saved.token_ranking, result.model.token_ranking)
    counts = generated_counts([tmp_path / "out" / "sequences" / "train.safetensors"], model.shape.vocab)
    assert saved.token_ranking.tolist() == ranking_of(counts)
    assert rep["trained"]["teacher_forced"]["accepted"] > rep["untrained"]["teacher_forced"]["accepted"] + 0.3


def test_head_rows_config_refusals(monkeypatch):
    for bad, match in (({"head_rows": 8}, "head_rows=8"), ({"head_rows": -16}, "head_rows=-16"),
                       ({"head_rows": 32, "soft_topk": 4}, "soft labels")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)
    import specpilot.drafting.train as train

    monkeypatch.setattr(train, "collect", lambda *a, **k: pytest.fail("generated data before refusing head_rows"))
    with pytest.raises(ValueError, match="below the target's vocabulary"):
        train_drafter(TargetBundle("tiny-gqa", damped("gqa", 0), None, NO_EOS),
                      TrainConfig(**{**QUICK, "steps": 1, "head_rows": 101}))
