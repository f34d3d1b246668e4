"""drafting.replay: replaying lookup-led block drafts against a recorded greedy output gives the engine's own steps
(chain: host and device loop; the host loop's best-first tree), with and without the gate, on a tiny model."""
from __future__ import annotations

import math

import pytest
import torch
from _tiny import prompt
from test_block_drafter import NO_EOS, ar, cfg, damped, quick_drafter
from test_device_loop import TREE

from specpilot.drafting.replay import (LookupPolicy, Reference, anchor_candidates, cached_candidates, drafter_digest,
                                       replay, replay_all, replay_speedup)
from specpilot.engines.build import build_engine
from specpilot.engines.drafters.ngram_prefix import LeadGate

pytestmark = pytest.mark.usefixtures("one_thread")
GATE = {"lookup_agree_topk": 2, "lookup_doubt_prob": 0.14}  # the quick drafter's top-1: p 0.07-0.18


@pytest.fixture(scope="module")
def setup():
    model = damped("gqa", 2)
    drafter = quick_drafter(model, 2, 40, block_size=8)
    refs = []
    for seed in range(3):
        p = prompt(model.shape.vocab, 12, seed) * 2  # repeats: the lookup finds matches
        refs.append(Reference(f"r{seed}", "tiny", tuple(p), tuple(ar(model, p, 60))))
    return model, drafter, refs, [anchor_candidates(drafter, model, r, topk=4) for r in refs]


# a calibrated device loop verifies one static tree shape (not replayed); a tree replays the host loop's, which the
# device loop grows every step with device_tree=per_step
@pytest.mark.parametrize("shape,steps", [({}, 1), ({}, 4), (TREE, 1), ({**TREE, "device_tree": "per_step"}, 4)],
                         ids=["chain-host", "chain-device", "tree-host", "tree-device-grown"])
@pytest.mark.parametrize("engine_kw", [{"ngram_prefix": False}, {"ngram_prefix": True},
                                       {"ngram_prefix": True, **GATE}, {"ngram_prefix": True, "ngram_min": 2,
                                                                        "ngram_max": 8}],
                         ids=["block", "lookup", "gated", "lookup-2-8"])
def test_replay_takes_the_engines_steps(setup, engine_kw, shape, steps):
    model, drafter, refs, cands = setup
    c = cfg(block_size=8, device_steps=steps, **shape, **engine_kw)
    eng = build_engine(c, model, NO_EOS, "cpu", block_drafter=drafter)
    gate = LeadGate.from_config(c.lookup_agree_topk, c.lookup_doubt_prob)
    policy = LookupPolicy(lookup=c.ngram_prefix, gate=gate, tree_budget=c.tree_budget if shape else 0,
                          tree_width=c.tree_width, ngram_min=c.ngram_min, ngram_max=c.ngram_max)
    for ref, cand in zip(refs, cands):
        got = eng.generate(list(ref.prompt), len(ref.output))
        assert got.tokens == list(ref.output)
        assert [s.committed for s in got.steps] == replay(ref, cand, policy), (ref.key, policy.label)


@pytest.mark.parametrize("shape,steps", [({}, 1), ({**TREE, "device_tree": "per_step"}, 4)],
                         ids=["chain-host", "tree-device-grown"])
def test_replay_of_a_windowed_drafter_takes_the_engines_steps(setup, shape, steps, tmp_path):
    """drafter_window: the replay's candidates with the same context window give the windowed engine's steps, and
    are cached apart from the whole-context ones."""
    model, drafter, refs, cands = setup
    c = cfg(block_size=8, device_steps=steps, ngram_prefix=True, drafter_window=6, **shape)
    eng = build_engine(c, model, NO_EOS, "cpu", block_drafter=drafter)
    policy = LookupPolicy(tree_budget=c.tree_budget if shape else 0, tree_width=c.tree_width)
    windowed = cached_candidates(drafter, model, refs, tmp_path, topk=4, progress=False, window=6)
    assert not torch.equal(windowed[0].probs, cands[0].probs)
    assert [p.name for p in tmp_path.iterdir()] == [f"{drafter_digest(drafter)}-k4-w6"]
    for ref, cand in zip(refs, windowed):
        got = eng.generate(list(ref.prompt), len(ref.output))
        assert got.tokens == list(ref.output)
        assert [s.committed for s in got.steps] == replay(ref, cand, policy), ref.key


@pytest.mark.parametrize("steps", [1, 4], ids=["host", "device"])
@pytest.mark.parametrize("periodic", [False, True], ids=["plain", "periodic"])
def test_replay_of_a_lookup_deeper_than_the_block_takes_the_engines_steps(setup, steps, periodic):
    """lookup_depth (and lookup_periodic): the lookup leads the grown tree past the block's depth (7 here) in the
    replay as in the engine; a periodic lookup drafts a short loop (one output repeats a token) that deep."""
    model, drafter, refs, cands = setup
    c = cfg(block_size=8, device_steps=steps, ngram_prefix=True, ngram_min=2, lookup_depth=15,
            lookup_periodic=periodic, **{**TREE, "device_tree": "per_step", "tree_budget": 15})
    eng = build_engine(c, model, NO_EOS, "cpu", block_drafter=drafter)
    policy = LookupPolicy(tree_budget=15, tree_width=c.tree_width, ngram_min=2, lookup_depth=15, periodic=periodic)
    assert policy.label == "tree15 lookup n>=2 depth15" + " periodic" * periodic
    committed = []
    for ref, cand in zip(refs, cands):
        got = eng.generate(list(ref.prompt), len(ref.output))
        assert got.tokens == list(ref.output)
        committed += [s.committed for s in got.steps]
        assert [s.committed for s in got.steps] == replay(ref, cand, policy), ref.key
    assert (max(committed) > 8) == periodic  # past the block's 7 depths and the bonus


SWITCHED = dict(tree_budget=15, narrow_tree_budget=7, wide_tree_after=3, ngram_min=2, lookup_depth=15)
DEEP = dict(SWITCHED, deep_tree_budget=31, deep_tree_after=6, lookup_depth=31)
DEEP_CHAIN = dict(DEEP, deep_tree_chain=True)


@pytest.mark.parametrize("steps,overlap", [(1, False), (1, True)], ids=["host", "device-overlapped"])
@pytest.mark.parametrize("kw,label,want_rows", [
    (SWITCHED, "tree15 lookup n>=2 depth15 periodic narrow7>=3", {8, 16}),
    (DEEP, "tree15 lookup n>=2 depth31 periodic narrow7>=3 deep31>=6", {8, 16, 32}),
    (DEEP_CHAIN, "tree15 lookup n>=2 depth31 periodic narrow7>=3 deep31>=6 chain", {8, 16, 32})],
    ids=["switched", "deep", "deep-chain"])
def test_replay_of_switched_tree_budgets_takes_the_engines_steps(setup, steps, overlap, kw, label, want_rows):
    """narrow_tree_budget (and deep_tree_budget, deep_tree_chain): each step's tree budget follows the step two
    before it, in the replay as in the engine's host loop and its overlapped one-step device chunks; every budget
    is used."""
    model, drafter, refs, cands = setup
    c = cfg(block_size=8, device_steps=steps, ngram_prefix=True, lookup_periodic=True, token_tile=16,
            device_overlap=overlap, **{**TREE, "device_tree": "per_step", **kw})
    eng = build_engine(c, model, NO_EOS, "cpu", block_drafter=drafter)
    policy = LookupPolicy(tree_width=c.tree_width, periodic=True, **kw)
    assert policy.label == label
    rows = set()
    for ref, cand in zip(refs, cands):
        got = eng.generate(list(ref.prompt), len(ref.output))
        assert got.tokens == list(ref.output)
        assert [s.committed for s in got.steps] == replay(ref, cand, policy), ref.key
        rows |= {s.verify_tokens for s in got.steps}
    assert want_rows <= rows  # (fewer rows near the end, where the host loop drafts no deeper than what is left)


def test_replay_speedup_prices_each_step_by_its_budget(setup):
    """At one cost for every step and AR's the same, the speedup is the geometric mean of tokens a step; a switched
    tree pays its wide steps' price only where it ran them."""
    _, _, refs, cands = setup
    plain = LookupPolicy(tree_budget=15, tree_width=4)
    speedup, mean = replay_speedup(refs, cands, plain, 1.0, {15: 1.0})
    per = replay_all(refs, cands, [plain])[0]
    assert speedup == pytest.approx(per.overall()) and mean == pytest.approx(per.mean())
    switched = LookupPolicy(tree_budget=15, narrow_tree_budget=7, wide_tree_after=3, tree_width=4, lookup_depth=15)
    steps = [replay(r, c, switched) for r, c in zip(refs, cands)]
    wide = [sum(switched.budget_at(s, j) == 15 for j in range(len(s))) for s in steps]
    assert 0 < sum(wide) < sum(map(len, steps))  # both budgets run
    got, _ = replay_speedup(refs, cands, switched, 0.5, {7: 1.0, 15: 2.0})
    want = [sum(s) * 0.5 / (len(s) + w) for s, w in zip(steps, wide)]
    assert got == pytest.approx(math.exp(sum(map(math.log, want)) / len(want)))


def test_replay_all_ranks_policies_and_refuses_nonsense(setup):
    _, _, refs, cands = setup
    results = replay_all(refs, cands, [LookupPolicy(lookup=False), LookupPolicy()])
    block, lookup = (r.overall() for r in results)
    assert 1.0 < block < lookup  # the repeats pay the lookup
    assert set(results[1].by_benchmark(refs)) == {"tiny"}
    assert results[1].policy.label == "chain lookup" and results[0].policy.label == "chain block"
    with pytest.raises(ValueError, match="gate gates the lookup"):
        LookupPolicy(lookup=False, gate=LeadGate(1, 0.5))
    for bad in (dict(lookup_depth=15), dict(lookup_depth=15, tree_budget=15, lookup=False),
                dict(lookup_depth=-1, tree_budget=15)):
        with pytest.raises(ValueError, match="lookup_depth"):
            LookupPolicy(**bad)
    with pytest.raises(ValueError, match="periodic"):
        LookupPolicy(lookup=False, periodic=True)
    for bad in (dict(narrow_tree_budget=7), dict(narrow_tree_budget=15, tree_budget=15),
                dict(narrow_tree_budget=7, tree_budget=15, wide_tree_after=-1)):
        with pytest.raises(ValueError, match="narrow_tree_budget"):
            LookupPolicy(**bad)
    for bad in (dict(deep_tree_budget=15, tree_budget=15),
                dict(deep_tree_budget=31, tree_budget=15, deep_tree_after=-1)):
        with pytest.raises(ValueError, match="deep_tree_budget"):
            LookupPolicy(**bad)
    with pytest.raises(ValueError, match="needs a prompt and an output"):
        Reference("x", "tiny", (1, 2), ())
    one = Reference("one", "tiny", (1, 2), (3,))  # the prefill's token alone: no verify step to replay
    assert replay(one, cands[0], LookupPolicy()) == []
    assert "one" not in replay_all([one], cands[:1], [LookupPolicy()])[0].tokens_per_step


def test_candidates_are_kept_per_drafter_and_reference(setup, tmp_path, monkeypatch):
    import specpilot.drafting.replay as replay_mod

    model, drafter, refs, cands = setup
    got = cached_candidates(drafter, model, refs[:2], tmp_path, topk=4, progress=False)
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs) for a, b in zip(got, cands))
    computed = []
    monkeypatch.setattr(replay_mod, "anchor_candidates", lambda d, t, r, **kw: computed.append(r.key) or
                        anchor_candidates(d, t, r, **kw))
    again = cached_candidates(drafter, model, refs, tmp_path, topk=4, progress=False)
    assert computed == ["r2"] and all(torch.equal(a.probs, b.probs) for a, b in zip(again, cands))
    changed = Reference("r0", "tiny", refs[0].prompt, refs[0].output[:-1])  # another output: recomputed
    cached_candidates(drafter, model, [changed], tmp_path, topk=4, progress=False)
    other = quick_drafter(model, 3, 0, block_size=8)  # another drafter: its own folder
    assert drafter_digest(other) != drafter_digest(drafter)
    cached_candidates(other, model, refs[:1], tmp_path, topk=4, progress=False)
    assert computed == ["r2", "r0", "r0"] and len(list(tmp_path.iterdir())) == 2


def tiny_block_deployment(tmp_path):
    """A tiny random target (SmolLM2's tokenizer), a 1-layer drafter for it in tmp_path/drafter, and a deployment
    YAML of the two: (yaml path, target)."""
    import torch
    from specpilot.drafting.checkpoint import save_drafter
    from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
    from specpilot.engines.loader import load_model
    from specpilot.testbed import fetch_smollm2, make_random_model
    target_dir = make_random_model("tiny", tmp_path / "target", seed=3, dtype="float32", tokenizer_dir=fetch_smollm2())
    target = load_model(target_dir, torch.float32, "cpu")
    save_drafter(BlockDrafterModel(BlockDrafterConfig.for_target(target.shape, layers=1, block_size=4)).init_weights(0),
                 tmp_path / "drafter", target)
    yaml = tmp_path / "block.yaml"
    yaml.write_text(f"""
name: tiny-block
target: {{path: {target_dir}}}
drafters: [{{kind: block, model: {{path: {tmp_path / 'drafter'}}}, engine: {{block_size: 4}}}}]
device: {{kind: cpu}}
workload: {{benchmarks: [gsm8k, mbpp], prompts_per_benchmark: 1, max_new_tokens: 12, seed: 0}}
engine: {{dtype: float32, cuda_graphs: false, max_seq_len: 512, token_tile: 8}}
""")
    return yaml, target


def test_drafter_replay_command_records_references_once_and_writes_its_table(tmp_path, capsys):
    import json

    from specpilot.cli import main as cli_main
    yaml, _ = tiny_block_deployment(tmp_path)
    argv = ["drafter", "replay", "--deployment", str(yaml), "--out", str(tmp_path / "r"), "--gates", "2:0.5",
            "--tree-budgets", "0,6", "--ngram-maxes", "4,8", "--drafter-windows", "0,5", "--no-progress"]
    assert cli_main(argv) == 0
    table = capsys.readouterr().out
    refs = (tmp_path / "r" / "references.jsonl").read_text().splitlines()
    assert len(refs) == 2 and all(len(json.loads(r)["output"]) == 12 for r in refs)
    got = json.loads((tmp_path / "r" / "replay.json").read_text())
    labels = ["chain block", "chain lookup", "chain lookup gated top2|p<0.5", "chain lookup n<=8",
              "chain lookup gated top2|p<0.5 n<=8", "tree6 block", "tree6 lookup", "tree6 lookup gated top2|p<0.5",
              "tree6 lookup n<=8", "tree6 lookup gated top2|p<0.5 n<=8"]
    assert [p["policy"] for p in got["policies"]] == labels + ["w5 " + label for label in labels]
    assert all(1.0 <= p["tokens_per_step"] <= 4.0 for p in got["policies"]) and "chain lookup gated" in table
    # the block's accuracy by output position, per window: in the JSON, the printed table and a picture
    assert set(got["position_accuracy"]) == {"0", "5"} and got["position_accuracy"]["0"][0]["anchors"] == 2 * (12 - 3)
    assert "| whole context |" in table and (tmp_path / "r" / "replay_positions.png").is_file()
    # what the policy scripts read back (scripts/replay_*.py): the references and their cached candidates
    from specpilot.drafting.replay import saved_replay
    saved_refs, saved_cands = saved_replay(tmp_path / "r", topk=4)
    assert [r.output for r in saved_refs] == [tuple(json.loads(r)["output"]) for r in refs]
    # an anchor per output token but the last, block_size - 1 drafted depths, the top 4 at each
    assert all(c.tokens.shape == c.probs.shape == (11, 3, 4) for c in saved_cands)
    with pytest.raises(ValueError, match="0 caches of top-8"):
        saved_replay(tmp_path / "r", topk=8)
    before = (tmp_path / "r" / "references.jsonl").stat().st_mtime_ns
    assert cli_main(argv) == 0  # resumes: nothing left to record
    assert (tmp_path / "r" / "references.jsonl").stat().st_mtime_ns == before
    (tmp_path / "r" / "references.jsonl").write_text("{not json\n")
    assert cli_main(argv) != 0
    assert "references.jsonl:1: not a reference record" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's refusal
        cli_main(argv[:-3] + ["--drafter-windows", "0,-5", "--no-progress"])
    assert "integers >= 0" in capsys.readouterr().err


def test_drafter_replay_judges_a_checkpoint_given_by_path(tmp_path, capsys):
    """--drafter DIR: the deployment's target and references, another drafter's candidates (cached under its own
    digest); the deployment's own drafter given by path replays as the deployment does."""
    import json

    from specpilot.cli import main as cli_main
    from specpilot.drafting.checkpoint import save_drafter
    from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
    yaml, target = tiny_block_deployment(tmp_path)
    save_drafter(BlockDrafterModel(BlockDrafterConfig.for_target(target.shape, layers=1, block_size=4)).init_weights(7),
                 tmp_path / "other", target)
    base = ["drafter", "replay", "--deployment", str(yaml), "--gates", "2:0.5", "--tree-budgets", "0,6", "--no-progress"]
    got = {}
    for name, extra in (("deployed", []), ("same", ["--drafter", str(tmp_path / "drafter")]),
                        ("other", ["--drafter", str(tmp_path / "other")])):
        assert cli_main(base + ["--out", str(tmp_path / name)] + extra) == 0
        got[name] = json.loads((tmp_path / name / "replay.json").read_text())["policies"]
        got[name + " cache"] = [f.name for f in (tmp_path / name / "candidates").iterdir()]
    assert got["same"] == got["deployed"] and got["same cache"] == got["deployed cache"]
    assert got["other cache"] != got["deployed cache"]
    capsys.readouterr()
    assert cli_main(base + ["--out", str(tmp_path / "x"), "--drafter", str(tmp_path / "missing")]) != 0
    assert "no config.json" in capsys.readouterr().err


def test_position_accuracy_counts_hand_built_candidates(tmp_path):
    """Output 10..19 (10 tokens), depth 3: anchor a predicts output[a+1..a+3]. Anchors 0-3 draft the truth, anchors
    4-6 miss at depth 2 (a chain of 1), and anchor 6 also misses at depth 1; anchors 7-8 lie within depth of the
    end and are left out."""
    from specpilot.drafting.replay import AnchorCandidates
    from specpilot.drafting.replay_report import format_table, plot_position_accuracy, position_accuracy

    out = list(range(10, 20))
    ref = Reference("r", "tiny", (1, 2), tuple(out))
    tokens = torch.zeros(len(out) - 1, 3, 2, dtype=torch.long)
    for a in range(len(out) - 1):
        for d in range(3):
            tokens[a, d, 0] = out[a + 1 + d] if a + 1 + d < len(out) else 0
    tokens[4:7, 1, 0] = 99
    tokens[6, 0, 0] = 99
    cands = AnchorCandidates(tokens, torch.ones_like(tokens, dtype=torch.float))
    bins = position_accuracy([ref], [cands], bins=(0, 4))
    assert [(b.start, b.end, b.anchors) for b in bins] == [(0, 4, 4), (4, None, 3)]
    assert bins[0].depth1_accuracy == 1.0 and bins[0].chain_length == 3.0
    assert bins[1].depth1_accuracy == 2 / 3 and bins[1].chain_length == 2 / 3
    assert "| 2 | 1.000 / 3.00 | 0.667 / 0.67 |" in format_table({2: bins})
    assert plot_position_accuracy({0: bins, 2: bins}, tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(ValueError, match="bins"):
        position_accuracy([ref], [cands], bins=(4, 0))


def test_the_replay_commands_policies_cross_lookup_depths_and_periodic_with_trees_only():
    import argparse

    from specpilot.drafting.cli import replay_policies
    args = argparse.Namespace(tree_budgets=[0, 6], tree_width=4, ngram_maxes=[4], ngram_mins=[2], lookup_depths=[0, 6, 9],
                              periodic=True, gates=[(2, 0.5)])
    lookups = ["lookup n>=2", "lookup gated top2|p<0.5 n>=2"]
    assert [p.label for p in replay_policies(args)] == (
        ["chain block"] + [f"chain {p}{x}" for x in ("", " periodic") for p in lookups]
        + ["tree6 block"] + [f"tree6 {p}{x}" for x in ("", " periodic", " depth6", " depth6 periodic")
                             for p in lookups])
