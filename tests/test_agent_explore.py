"""The agent proposer inside the explore stage, and memory transfer between two deployments, through the real
stages (profile -> attribute -> explore -> validate -> integrate) on the tiny echo deployments, not Prefect.

Deployment A (tiny-a) explores with the agent on, its client replaying tests/data/agent_explore: a config delta
(longer drafts) that passes token forcing and is integrated; policy code that stops once the output repeats,
which matches AR on the short quick bench but is lossy on the longer held-out generations, so token forcing
(candidate in the sandbox) rejects it; and code that reaches for the network, stopped by the sandbox. Agent code
is never imported in this process. Deployment B (tiny-b, another model of the same family) then explores
without a key: memory's mechanisms come first, one proven on A (longer drafts) and one recorded on a similar
third scope (one-token drafts, a loss on this repetitive model); validation and integrate record whether each
carried over, and the documented SQL shows it from the command line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import specpilot
from _replay import Replay
from specpilot.cli import main as specpilot_main
from specpilot.deployments import load_deployment
from specpilot.memory import Evidence, Mechanism, MechanismCategory, Memory, Scope, Verdict
from specpilot.memory.transfer import TRANSFER_SQL, transfer_history
from specpilot.stages import catalog, explore
from specpilot.stages.devices import device_name
from specpilot.stages.io import (REQUEST_NAME, StageName, StageOutcome, StageRequest, StageRun, memory_scope, path_part,
                                 publish, run_stage)

RUN_A, RUN_B = "20260102T000000Z-aaa111", "20260103T000000Z-bbb222"
PROFILE = {"prompts": 2, "kernel_steps": 2, "cost_tokens": [1, 8, 16, 32], "cost_repeats": 2}
# 16 new tokens in the quick bench, 32 (the workload's) in validation: the cycle of 16 tokens repeats from 24 on.
EXPLORE = {"round": 1, "prompts": 2, "max_new_tokens": 16, "batch": 2, "repeats": 2, "keep": 2,
           "direction": "tree_shape", "agent_key_env": "SPECPILOT_TEST_NO_KEY"}
SHORT_DRAFTS = "ngram_draft_length:draft_len=1,drafter=ngram"


def pipeline(dep_path: Path, run_id: str, root: Path, explore_params: dict, client_factory=None) -> dict:
    """One round of every stage, in-process as the flow runs them; explore gets `client_factory` (the stage
    function's own argument), everything else goes through run_stage."""
    store, memory, out = str(root / "store"), str(root / "memory.duckdb"), root / run_id
    stock = catalog.stock_candidate(load_deployment(dep_path))

    def request(name: StageName, qualifiers: tuple[str, ...], params: dict, inputs: dict | None = None):
        return StageRequest(name, run_id, str(dep_path), store, inputs or {}, params, qualifiers)

    def stage(name: StageName, qualifiers: tuple[str, ...], params: dict, inputs: dict | None = None):
        return run_stage(request(name, qualifiers, params, inputs), out.joinpath(name.value, *qualifiers))

    runs = {"stock": stock, "memory": memory, "deployment": load_deployment(dep_path)}
    runs["recall"] = stage(StageName.RECALL, (), {"build": stock.to_dict(), "memory": memory})
    runs["profile"] = stage(StageName.PROFILE, ("round0",), {**PROFILE, "build": stock.to_dict()})
    runs["attribute"] = stage(StageName.ATTRIBUTE, ("round1",), {}, {"profile": runs["profile"].manifest_uri})
    req = request(StageName.EXPLORE, ("round1", "dev0"), explore_params, {
        "profile": runs["profile"].manifest_uri, "attribute": runs["attribute"].manifest_uri,
        "recall": runs["recall"].manifest_uri})
    explore_dir = out.joinpath("explore", "round1", "dev0")
    explore_dir.mkdir(parents=True)
    req.save(explore_dir / REQUEST_NAME)
    meta = explore.run(StageRun(req, explore_dir), client_factory=client_factory)
    runs["explore"] = StageOutcome(req.stage, req.qualifiers, publish(req, explore_dir, meta), str(explore_dir), meta)
    runs["validate"] = {m["candidate"]["name"]: stage(StageName.VALIDATE, ("round1", path_part(m["candidate"]["name"])), {
        "prompts": 2, "stock": stock.to_dict(), "candidate": m["candidate"]}) for m in meta["selected"]}
    runs["integrate"] = stage(StageName.INTEGRATE, ("round1",), {
        "round": 1, "heldout_prompts": 2, "memory": memory, "stock": stock.to_dict(), "current": stock.to_dict()},
        {"explore.0": runs["explore"].manifest_uri,
         **{f"validate.{i}": v.manifest_uri for i, v in enumerate(runs["validate"].values())}})
    return runs


@pytest.fixture(scope="module")
def tuned(tiny_deployment, tiny_deployment_b, tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-explore")
    replay = Replay("agent_explore")
    a = pipeline(tiny_deployment, RUN_A, root, {**EXPLORE, "trials": 2}, replay.client)
    with Memory.open(a["memory"]) as memory:  # a third, similar scope where one-token drafts won
        memory.record_run("20260101T000000Z-ccc333", "tiny-c", {"device": "cpu"})
        memory.record_mechanism(Mechanism(SHORT_DRAFTS, MechanismCategory.ALGORITHM, "n-gram lookup: one draft token",
                                          {"drafter": "ngram", "draft_len": 1}))
        memory.record_evidence(Evidence(SHORT_DRAFTS, Scope("llama", "model-c", "ngram", device_name("cpu"), "batch1"),
                                        "20260101T000000Z-ccc333", "tiny-c", "all", "speedup_vs_stock", 1.0, 1.25,
                                        Verdict.PASS))
    b = pipeline(tiny_deployment_b, RUN_B, root, {**EXPLORE, "trials": 0, "memory_candidates": 4})
    return {"a": a, "b": b, "replay": replay, "root": root}


def agent_name(short: str) -> str:
    return f"agent-r1-d0-{short}"


def test_agent_runs_beside_search_and_memory_within_its_budget(tuned):
    meta, replay = tuned["a"]["explore"].meta, tuned["replay"]
    agent = meta["agent"]
    assert agent["status"] == "on" and "sandbox" in agent["note"] and "search and memory proposers run too" in agent["note"]
    (session,) = agent["sessions"]
    assert session["stop"] == "end_turn" and session["turns"] == len(replay.requests) == 4
    assert session["submitted"] == [agent_name("longer-drafts"), agent_name("stop-on-repeat")]
    ((rejected, why),) = [(r["name"], r["reason"]) for r in session["rejected"]]
    assert rejected == agent_name("phone-home") and "stopped by the sandbox" in why
    out = Path(tuned["a"]["explore"].out_dir)
    files = {p.name for p in out.iterdir()}
    stem = "agent-r1-d0-tree_shape-00-"
    transcript = sorted(f for f in files if f.startswith(stem))  # request and response per turn, tools but the last
    assert transcript == sorted([f"{stem}{t:03d}-{k}.json" for t in range(4) for k in ("request", "response")]
                                + [f"{stem}{t:03d}-tools.json" for t in range(3)] + [f"{stem}session.json"])
    assert set(agent["files"]) <= files
    assert {"policy-agent-r1-d0-stop-on-repeat.py", "policy-agent-r1-d0-phone-home.py"} <= files
    traces, _ = replay.tool_results(1)["toolu_01L3lXt5Ub1FjS4wPd0gRzCo"]  # the profile's own step traces
    assert traces["steps"] == len(pq.read_table(Path(tuned["a"]["profile"].out_dir) / "steps.parquet"))
    tried = replay.tool_results(2)
    assert tried["toolu_01N5nZv7Wd3HlU6yRf2iTbEq"][0]["tokens_match_ar"]
    assert tried["toolu_01O6oAw8Xe4ImV7zSg3jUcFr"][0]["sandbox"]["status"] == "ok"
    assert tried["toolu_01P7pBx9Yf5JnW8aTh4kVdGs"][0]["sandbox"]["status"] == "violation"
    measured = {m["candidate"]["name"]: m for m in json.loads((out / "measurements.json").read_text())}
    assert {m["candidate"]["source"] for m in measured.values()} >= {"search", "agent"}
    assert measured[agent_name("longer-drafts")]["status"] == "ok"
    assert measured[agent_name("stop-on-repeat")]["status"] == "ok"  # 16 tokens: it never saw a repeat
    assert measured[agent_name("phone-home")]["status"] == "stopped" and meta["stopped"] == [agent_name("phone-home")]
    selected = {m["candidate"]["name"] for m in meta["selected"]}
    assert {agent_name("longer-drafts"), agent_name("stop-on-repeat")} <= selected
    assert agent_name("phone-home") not in selected and set(meta["owed_a_verdict"]) == {
        agent_name("longer-drafts"), agent_name("stop-on-repeat")}


def test_config_delta_passes_lossy_policy_fails_token_forcing_in_the_sandbox(tuned):
    validated = tuned["a"]["validate"]
    longer, looped = validated[agent_name("longer-drafts")], validated[agent_name("stop-on-repeat")]
    assert longer.meta["verdict"] == "pass" and not longer.meta["sandboxed"]
    assert looped.meta["verdict"] == "fail" and looped.meta["sandboxed"]
    out = Path(looped.out_dir)
    sandboxed = json.loads((out / "sandbox_verdict.json").read_text())
    assert {o["status"] for o in sandboxed["sandbox"]} == {"ok"} and not sandboxed["rejected"]
    first = json.loads((out / "verdict.json").read_text())["first_divergence"]
    assert first["kind"] == "free_running" and first["candidate_token"] is None  # it stopped early
    assert 24 <= first["index"] < 32


def test_integrate_takes_the_config_delta_and_records_the_rejections(tuned):
    a = tuned["a"]
    decisions = a["integrate"].meta["decisions"]
    assert any(d.startswith(agent_name("stop-on-repeat") + ": rejected, token forcing fail") for d in decisions)
    with Memory.open(a["memory"], read_only=True) as memory:
        failures = memory.sql("SELECT stage, reason FROM failures WHERE run_id = ?", params=[RUN_A]).rows
        evidence = memory.sql("SELECT m.name, m.code_ref FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id "
                              "WHERE e.run_id = ? AND e.verdict = 'pass'", params=[RUN_A]).rows
    assert any(s == "validate" and r.startswith(agent_name("stop-on-repeat") + ": token forcing fail") for s, r in failures)
    assert any(s == "explore" and r.startswith(agent_name("phone-home") + ": sandbox violation") for s, r in failures)
    # Lossless for sure; faster than stock on the held-out prompts as measured (two shared cores): then in memory.
    faster = a["validate"][agent_name("longer-drafts")].meta["speedup_vs_stock"] > 1.0
    assert (("ngram_draft_length:draft_len=12,drafter=ngram", None) in set(evidence)) == faster
    assert faster or any(r.startswith(agent_name("longer-drafts") + ": lossless but") for _, r in failures)


def test_agent_code_never_ran_in_this_process_nor_escaped(tuned):
    scratch = str(tuned["root"])
    loaded = [m for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(scratch)]
    assert loaded == [] and not any(name.startswith("specpilot_policy_") for name in sys.modules)
    assert not list(tuned["root"].rglob("escaped.txt"))
    assert not (Path(specpilot.__file__).parent / "agent_cache.py").exists()


def test_without_a_key_the_stage_records_the_agent_is_off(tuned):
    agent = tuned["b"]["explore"].meta["agent"]
    assert agent["status"] == "off_no_key" and agent["sessions"] == []
    assert "$SPECPILOT_TEST_NO_KEY is not set" in agent["note"] and "search and memory proposers only" in agent["note"]
    assert json.loads((Path(tuned["b"]["explore"].out_dir) / "agent.json").read_text())["status"] == "off_no_key"


def proven_on_a(memory: Memory) -> set[str]:
    return {r[0] for r in memory.sql("SELECT DISTINCT m.name FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id "
                                     "WHERE e.run_id = ? AND e.verdict = 'pass'", params=[RUN_A]).rows}


def test_memory_transfer_b_tries_a_first_and_records_what_carried_over(tuned, capsys):
    b = tuned["b"]
    meta = b["explore"].meta
    tried = {t["hit"]["name"]: t for t in meta["transfers"]}
    here = memory_scope(b["deployment"], "ngram", "cpu")
    with Memory.open(b["memory"], read_only=True) as memory:
        from_a = proven_on_a(memory)
        done = {t.mechanism: t for t in transfer_history(memory, here)}
        rows = memory.sql(TRANSFER_SQL).rows
        failures = memory.sql("SELECT mechanism FROM failures WHERE stage = 'transfer' AND run_id = ?",
                              params=[RUN_B]).rows
    # A proved the agent's longer drafts (and maybe search's); each was tried first on B, as was C's mechanism.
    assert from_a and set(tried) == from_a | {SHORT_DRAFTS} and set(meta["memory_first"]) == {
        t["candidate"] for t in tried.values()} and set(done) == set(tried)
    for name in from_a:  # lossless on B; carried over exactly when faster than B's stock on B's held-out prompts
        t = done[name]
        assert tried[name]["hit"]["proven_on"]["model"] == t.from_scope.model == "model-a"
        assert t.to_scope.model == "model-b" and t.verdict is Verdict.PASS and t.before == 1.0
        assert t.carried_over == (t.after > 1.0) and ((name,) in set(failures)) != t.carried_over
    short = done[SHORT_DRAFTS]
    assert not short.carried_over and short.verdict is Verdict.PASS and short.after < 1.0  # lossless, but slower
    assert short.from_scope.model == "model-c" and (SHORT_DRAFTS,) in set(failures)
    by_name = {r[0]: r for r in rows}
    assert by_name[SHORT_DRAFTS][1:5] == ("model-c", "model-b", RUN_B, "pass") and by_name[SHORT_DRAFTS][7] is False
    assert all(by_name[name][1] == "model-a" and by_name[name][7] is done[name].carried_over for name in from_a)
    # The same query from the command line, read-only.
    assert specpilot_main(["memory", "sql", TRANSFER_SQL, "--db", b["memory"]]) == 0
    printed = capsys.readouterr().out
    assert "model-c" in printed and "model-a" in printed and SHORT_DRAFTS in printed


def test_a_failed_transfer_is_not_recalled_for_that_scope_again(tuned, tmp_path):
    b = tuned["b"]
    request = StageRequest.load(Path(b["recall"].out_dir) / REQUEST_NAME)
    again = run_stage(StageRequest(**{**request.__dict__, "run_id": "20260104T000000Z-ddd444"}), tmp_path / "recall")
    with Memory.open(b["memory"], read_only=True) as memory:
        carried = {t.mechanism: t.carried_over for t in transfer_history(memory)}
        from_a = proven_on_a(memory)
    assert carried[SHORT_DRAFTS] is False and SHORT_DRAFTS not in again.meta["hits"]
    for name in from_a:  # carried over: recalled (now proven on B too); not carried over: left out
        assert (name in again.meta["hits"]) == carried[name]


def test_agent_code_that_passes_is_recorded_but_never_built_in(tuned, tiny_deployment, tmp_path):
    """A build is decoded in-process (profile, bench, serving), so passing agent code is left for review: integrate
    keeps it out of the build, and memory points at the code explore published, not at the sandbox's scratch."""
    from specpilot.stages.candidate import Candidate, CandidateSource
    from specpilot.stages.integrate import IntegrateParams, ValidatedCandidate, integrate
    from specpilot.stages.devices import session_for
    from specpilot.stages.io import SplitName, select_prompts
    from specpilot.stages.remember import Explored
    from specpilot.stages.validate import VerdictKind

    stock, dep = tuned["a"]["stock"], tuned["a"]["deployment"]
    session = session_for(str(tiny_deployment), "cpu")
    code = Candidate(agent_name("deeper"), stock.config, "/scratch/sandbox/deeper-0a1b/policy.py:Deeper",
                     ("agent_policy:Deeper",), CandidateSource.AGENT, stock.drafter_label)
    passed = ValidatedCandidate(code, VerdictKind.PASS, 1.3, {"gsm8k": 1.3}, (), "file:///validate/manifest.json")
    tune, held = (session.tokenize(select_prompts(dep, split, 1)) for split in (SplitName.TUNE, SplitName.VALIDATE))
    result = integrate(session, stock, stock, [passed], tune, held, IntegrateParams(), tmp_path)
    assert passed.accepted and result.candidate is None and result.final_is_stock
    assert any(d.startswith(agent_name("deeper") + ": passed token forcing in the sandbox") for d in result.decisions)
    explored = Explored((), (), {"policy-agent-r1-d0-deeper.py": "file:///store/runs/x/policy-agent-r1-d0-deeper.py"})
    assert explored.code_ref(code) == "file:///store/runs/x/policy-agent-r1-d0-deeper.py:Deeper"
    assert explored.code_ref(stock) is None
