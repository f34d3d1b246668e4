"""The agent proposer end to end against recorded Messages API responses (tests/data/agent_*), with real quick
benchmarks, real token forcing and the real sandbox on tiny models; and memory transfer between deployments.
No network: the anthropic client's HTTP transport (httpx2, which anthropic 2.x uses) replays the recordings."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import specpilot
from _replay import DATA, Replay
from _tiny import prompt, tiny_model
from specpilot.agents import (AgentBudget, AgentProposer, AgentSettings, AgentStatus, EngineTrial, Isolation,
                              SandboxedPolicyRunner, SandboxLimits, SandboxStatus, SandboxTrial, StopReason, TargetSpec,
                              TraceSummary, Workbench, plain_delta, plan_proposers, validate_sandboxed)
from specpilot.agents.sandbox import docker_argv
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.costmodel import Ceilings, Direction, DirectionName, attribute, ideal_op_times
from specpilot.deployments import load_deployment
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, DType, EngineConfig
from specpilot.engines.loader import load_model, save_model
from specpilot.engines.policy import STOCK as STOCK_POLICY
from specpilot.engines.traces import KernelTrace
from specpilot.memory import Evidence, Mechanism, MechanismCategory, Memory, Scope, Verdict
from specpilot.memory.transfer import record_transfer, transfer_candidates, transfer_history
from specpilot.stages import catalog
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.explore import ExploreParams
from specpilot.stages.io import SplitName, select_prompts
from specpilot.stages.proposers import ExploreContext, MemoryProposer, SearchProposer
from specpilot.stages.quickbench import QuickBench
from specpilot.stages.validate import DivergenceKind, VerdictKind, validate
from specpilot.workload import Benchmark, Prompt

MAX_NEW, EPS = 24, 1e-6
BASE = EngineConfig(dtype=DType.FP32, cuda_graphs=False, max_seq_len=256)
STOCK = Candidate("stock", BASE, source=CandidateSource.STOCK)
CEILINGS = Ceilings(peak_flops=1e12, peak_bandwidth=1e11)


class TinyFactory:
    """Engines over one shared target loaded from the same directory the sandbox's child reads."""

    def __init__(self, model_dir: Path):
        self.target, self._engines = load_model(model_dir, torch.float32, "cpu"), {}

    def engine(self, cfg: EngineConfig, drafter_label=None, policy=STOCK_POLICY):
        key = (cfg.digest(), id(policy))
        if key not in self._engines:
            self._engines[key] = (build_engine(cfg, self.target, frozenset(), "cpu", policy=policy), policy)
        return self._engines[key][0]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    model_dir = save_model(tiny_model("gqa", seed=0), root / "model")
    prompts = [TokenizedPrompt(Prompt(Benchmark.GSM8K, str(i), f"p{i}"), tuple(prompt(101, 40, i))) for i in range(5)]
    runner = SandboxedPolicyRunner(TargetSpec(str(model_dir), DType.FP32, "cpu"), root / "sandbox", threads=1)
    return {"root": root, "factory": TinyFactory(model_dir), "tune": prompts[:2], "held": prompts[2:], "runner": runner}


def workbench(world) -> Workbench:
    f, ar = world["factory"], BASE.replace(drafter=DrafterKind.NONE)
    steps = [s for p in world["tune"] for s in f.engine(BASE).generate(list(p.ids), MAX_NEW, p.key).steps]
    return Workbench(STOCK, None, TraceSummary.from_steps(steps), EngineTrial(f, ar, world["tune"], MAX_NEW),
                     plain_delta(STOCK), world["runner"], SandboxTrial(world["runner"], f, ar, world["tune"], MAX_NEW),
                     "agent-test")


def agent(replay: Replay, tmp_path: Path, **budget) -> AgentProposer:
    return AgentProposer(replay.client, "claude-sonnet-4-6", AgentBudget(**budget), tmp_path)


@dataclass(frozen=True)
class Explore:
    ctx: ExploreContext
    held_out: list[TokenizedPrompt]


@pytest.fixture(scope="module")
def explore(tiny_deployment) -> Explore:
    """explore's real context on the tiny cycle-model deployment: QuickBench, search space, a real attribution
    (the build's own step traces; kernel traces at 2x their roofline ideal)."""
    dep = load_deployment(tiny_deployment)
    session = DeploymentSession(dep)
    tune, held = (session.tokenize(select_prompts(dep, split, 2)) for split in (SplitName.TUNE, SplitName.VALIDATE))
    base = catalog.stock_candidate(dep)
    engine = session.engine(base.config, base.drafter_label)
    steps = [s for p in tune for s in engine.generate(list(p.ids), MAX_NEW, p.key).steps]
    ideals = ideal_op_times(session.target.shape, 16, 64, CEILINGS)
    kernels = [KernelTrace(f"k_{op.value}", op.value, 10, 20 * i.ideal_s, 10, 16) for op, i in ideals.items()]
    attribution = attribute(steps, kernels, session.target.shape, CEILINGS, lambda n: 1 + 0.05 * n, tokens=16)
    params = ExploreParams(prompts=2, max_new_tokens=MAX_NEW)
    space = catalog.search_space(dep, base, DirectionName.TREE_SHAPE, min_settings=2 * params.trials)
    return Explore(ExploreContext(dep, base, attribution, space, (), QuickBench(session, tune, MAX_NEW, base), params),
                   held)


def tree_direction(ctx):
    return next(d for d in ctx.attribution.directions if d.name is DirectionName.TREE_SHAPE)


def test_agent_reads_tries_and_submits_a_config_delta_that_passes_token_forcing(explore, tmp_path):
    ctx, replay = explore.ctx, Replay("agent_config")
    proposer = agent(replay, tmp_path, max_turns=6)
    candidates = proposer.propose(tree_direction(ctx), ctx, 2)
    session = proposer.sessions[-1]
    assert session.stop is StopReason.SUBMITTED and session.turns == len(replay.requests) == 3
    (cand,) = candidates
    assert cand.source is CandidateSource.AGENT and cand.policy is None and cand.config.draft_len == 12
    assert cand.config == ctx.base.config.replace(draft_len=12) and "ngram_draft_length" in cand.mechanisms
    reads = replay.tool_results(1)  # what the agent read: the real attribution, traces and schema
    attribution, traces, knobs = (reads[i][0] for i in ("toolu_01A7fGx2Qm9RkT3vLp8sWcYd",
                                                        "toolu_01B4hNy6Rt2VwK8mQz5xJeUa", "toolu_01C9dPk3Ls7XbM2nGv6yHtRf"))
    assert attribution["available"] and {d["name"] for d in attribution["directions"]} == {d.value for d in DirectionName}
    assert traces["steps"] > 0 and sum(traces["accepted_hist"].values()) == traces["steps"]
    assert {k["name"] for k in knobs["knobs"]} >= {"draft_len", "tree_budget"} and knobs["current"]["draft_len"] == 5
    tried, err = replay.tool_results(2)["toolu_01D2eQm8Nu4YcL7pHw3zKvSg"]
    assert not err and tried["tokens_match_ar"] and tried["speedup_vs_ar"] > 0
    assert tried["tokens_per_step"] > traces["tokens_per_step"]  # deeper drafts commit more of the cycle per step
    assert any(m.candidate.name == cand.name and m.matches_ar for m in ctx.evaluate.log)  # explore's log has it
    verdict = validate(ctx.evaluate.session, ctx.base, cand, explore.held_out, MAX_NEW, EPS)
    assert verdict.kind is VerdictKind.PASS, verdict.reasons
    files = sorted(p.name for p in Path(session.transcript).iterdir())
    assert files == [f"{t:03d}-{k}.json" for t in range(3) for k in ("request", "response", "tools")] + ["session.json"]
    saved = json.loads((Path(session.transcript) / "001-response.json").read_text())
    assert saved["id"] == "msg_01Jr5mWuX9n3dK0yMsB5qXcO" and saved["usage"]["input_tokens"] == 4388
    assert session.cost_usd == pytest.approx((1912 + 4388 + 4816) * 3e-6 + (131 + 164 + 142) * 15e-6)


def test_lossy_agent_code_runs_in_the_sandbox_and_token_forcing_rejects_it(world, tmp_path):
    replay = Replay("agent_lossy")
    session = agent(replay, tmp_path).run(tree_direction_stub(), workbench(world), 2)
    assert session.stop is StopReason.SUBMITTED and len(replay.requests) == 2
    (cand,) = session.candidates
    assert cand.policy.endswith("policy.py:TrustDrafts") and cand.policy.startswith(str(world["runner"].root))
    (trial,) = session.trials  # tried once; the submission reused the measurement
    assert trial.sandbox.status is SandboxStatus.OK and not trial.tokens_match and trial.speedup == 0.0
    assert {"landlock-fs", "landlock-read", "audit-hook"} <= set(trial.sandbox.layers)
    told, _ = replay.tool_results(1)["toolu_01F3gSo0Pw6AeN9rKy5bMxUi"]
    assert told["tokens_match_ar"] is False and told["sandbox"]["status"] == "ok"
    result = validate_sandboxed(world["factory"], STOCK, cand, world["held"], MAX_NEW, EPS, world["runner"])
    assert result.kind is VerdictKind.FAIL and not result.rejected and result.verdict is not None
    first = result.verdict.first_divergence
    assert first.kind is DivergenceKind.FREE_RUNNING and first.stock_token != first.candidate_token
    assert result.verdict.forced_flips == 0  # its target is stock's: only its acceptance lies
    assert [o.status for o in result.outcomes] == [SandboxStatus.OK, SandboxStatus.OK]  # free-running, then forced


def tree_direction_stub() -> Direction:
    return Direction(DirectionName.TREE_SHAPE, 1.8, 0.8, "best-first tree accepts more tokens per step")


def test_agent_code_reaching_the_network_or_writing_outside_is_stopped(world, tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-orchestrator-secret")  # what the code goes looking for
    replay = Replay("agent_escape")
    session = agent(replay, tmp_path).run(tree_direction_stub(), workbench(world), 2)
    assert session.stop is StopReason.END_TURN and len(replay.requests) == 3 and session.candidates == ()
    (trial,) = session.trials
    out = trial.sandbox
    assert out.status is SandboxStatus.VIOLATION and out.error.startswith("PermissionError")
    blocked = {v.event for v in out.violations}
    assert {"urllib.Request", "socket.create_connection", "subprocess.Popen", "open"} <= blocked
    # it could read neither the orchestrator's environment (/proc/<parent>/environ) nor inherit it
    (sent,) = [v.detail for v in out.violations if v.event == "urllib.Request"]
    assert "unreadable%3APermissionError%7Cno-key-in-env" in sent and "secret" not in json.dumps(trial.to_dict())
    assert not (world["root"] / "escaped.txt").exists()
    assert not (Path(specpilot.__file__).parent / "agent_cache.py").exists()
    ((name, reason),) = session.rejected
    assert name.endswith("phone-home") and "stopped by the sandbox" in reason and "network access is disabled" in reason
    told, _ = replay.tool_results(2)["toolu_01J1jVr3Sz9DhQ2uNb8ePaXm"]
    assert told["submitted"][0]["accepted"] is False
    # Validation of the same code stops at the free-running run, with the reason.
    cand = Candidate("escape", BASE, policy=world["runner"].write_policy(
        "escape", json.loads((DATA / "agent_escape/01.json").read_text())["content"][1]["input"]["policy"]["code"],
        "PhoneHome"))
    verdict = validate_sandboxed(world["factory"], STOCK, cand, world["held"], MAX_NEW, EPS, world["runner"])
    assert verdict.kind is VerdictKind.FAIL and verdict.verdict is None and len(verdict.outcomes) == 1
    assert "network access is disabled" in verdict.rejected and "writing outside" in verdict.rejected


def test_turn_budget_stops_the_loop(world, tmp_path):
    replay = Replay("agent_turns")
    session = agent(replay, tmp_path, max_turns=2).run(tree_direction_stub(), workbench(world), 1)
    assert session.stop is StopReason.MAX_TURNS and session.turns == len(replay.requests) == 2
    assert (Path(session.transcript) / "001-tools.json").is_file()
    assert json.loads((Path(session.transcript) / "session.json").read_text())["stop"] == "max_turns"


def test_cost_budget_stops_the_loop_before_a_call_could_exceed_it(world, tmp_path):
    replay = Replay("agent_cost")
    session = agent(replay, tmp_path, max_cost_usd=0.5, max_output_tokens=4096).run(
        tree_direction_stub(), workbench(world), 1)
    # spent 100k x $3/M + 2k x $15/M = $0.33; the next call costs >= $0.30 + up to $0.06: not made
    assert session.stop is StopReason.MAX_COST and len(replay.requests) == 1
    assert session.cost_usd == pytest.approx(0.33)


def test_without_an_api_key_search_and_memory_run_alone(explore, tmp_path, monkeypatch):
    explore_ctx = explore.ctx
    monkeypatch.delenv("SPECPILOT_TEST_ANTHROPIC_KEY", raising=False)
    settings, session = AgentSettings(key_env="SPECPILOT_TEST_ANTHROPIC_KEY"), explore_ctx.evaluate.session
    plan = plan_proposers(session, tmp_path, settings)
    assert [type(p) for p in plan.proposers] == [MemoryProposer, SearchProposer] and plan.status is AgentStatus.NO_KEY
    assert "SPECPILOT_TEST_ANTHROPIC_KEY is not set" in plan.note and "search and memory proposers only" in plan.note
    assert plan_proposers(session, tmp_path, AgentSettings(key_env="")).status is AgentStatus.DISABLED
    assert not AgentProposer(None).available() and AgentProposer(None).propose(tree_direction_stub(), explore_ctx, 2) == []
    monkeypatch.setenv("SPECPILOT_TEST_ANTHROPIC_KEY", "sk-test")
    plan = plan_proposers(session, tmp_path, settings)
    assert isinstance(plan.proposers[-1], AgentProposer) and plan.proposers[-1].available()
    assert plan.status is AgentStatus.ON and plan.note.startswith("agent proposer on")


def test_sandbox_limits_memory_and_wall_clock(world):
    hog = "from specpilot.engines.policy import EnginePolicy\nclass Hog(EnginePolicy):\n" \
          "    def begin_request(self, prompt, max_new_tokens):\n        self.buf = bytearray(64 << 30)\n"
    runner = world["runner"]
    out = runner.generate(Candidate("hog", BASE, policy=runner.write_policy("hog", hog, "Hog")), world["tune"][:1], 4)
    assert out.status is SandboxStatus.MEMORY_LIMIT and "MemoryError" in out.error
    slow = SandboxedPolicyRunner(runner.target, runner.root, SandboxLimits(wall_s=1.0), threads=1)
    out = slow.generate(Candidate("slow", BASE, policy=runner.write_policy("hog", hog, "Hog")), world["tune"][:1], 4)
    assert out.status is SandboxStatus.TIMEOUT and out.wall_s < 10


def test_container_isolation_argv(world, tmp_path):
    limits = SandboxLimits(container_image="specpilot-cpu:latest", memory_bytes=1 << 30)
    argv = docker_argv(limits, tmp_path, world["runner"].target, 2, tmp_path / ".cache")
    joined = " ".join(argv)
    for flag in ("--network none", "--read-only", "--cap-drop ALL", "--memory 1073741824",
                 "--security-opt no-new-privileges"):
        assert flag in joined
    model = world["runner"].target.model_dir
    assert f"{tmp_path}:{tmp_path}:rw" in argv and f"{model}:{model}:ro" in argv
    assert argv[-6:-2] == ["specpilot-cpu:latest", "python", "-I", "-B"] and Isolation.CONTAINER.value == "container"


def test_memory_transfer_tries_similar_scopes_first_and_records_whether_they_carried_over(tiny_deployment_b,
                                                                                           tmp_path):
    dep = load_deployment(tiny_deployment_b)
    session = DeploymentSession(dep)
    here = Scope("llama", "model-b", "ngram", "cpu", "batch1")
    near, far = Scope("llama", "model-a", "ngram", "cpu", "batch1"), Scope("qwen3", "q8b", "draft", "h200", "batch16")
    with Memory.open(tmp_path / "memory.duckdb") as memory:
        memory.record_run("run-a", "tiny-a", {"device": "cpu"})
        for name, delta, scope, gain in (("ngram_draft_length", {"draft_len": 12}, near, 1.3),
                                         ("token_tile", {"token_tile": 8}, far, 1.8)):
            memory.record_mechanism(Mechanism(name, MechanismCategory.ALGORITHM, config_delta=delta))
            memory.record_evidence(Evidence(name, scope, "run-a", "tiny-a", "all", "speedup", 1.0, gain, Verdict.PASS))
        plan = transfer_candidates(memory, here)  # the similar scope first, despite its smaller gain
        assert [(r.mechanism.name, r.proven_on) for r in plan] == [("ngram_draft_length", near), ("token_tile", far)]
        memory.record_run("run-b", dep.name, {"device": "cpu"})
        tune, held = (session.tokenize(select_prompts(dep, split, 2)) for split in (SplitName.TUNE, SplitName.VALIDATE))
        stock, trial = catalog.stock_candidate(dep), EngineTrial(session, dep.ar_config(), tune, MAX_NEW)
        before = trial(stock).tokens_per_step
        for r in plan:  # tried on B: measured (tokens per step, deterministic) and token-forced
            config, label = catalog.apply_delta(dep, stock, r.mechanism.config_delta, None)
            cand = Candidate(f"transfer-{r.mechanism.name}", config, drafter_label=label)
            verdict = validate(session, stock, cand, held, MAX_NEW, EPS)
            record_transfer(memory, r.mechanism.name, r.proven_on, here, Verdict(verdict.kind.value), before,
                            trial(cand).tokens_per_step, run_id="run-b", deployment=dep.name, metric="tokens_per_step")
        done = {t.mechanism: t for t in transfer_history(memory, here)}
        assert done["ngram_draft_length"].carried_over and done["ngram_draft_length"].from_scope == near
        assert done["ngram_draft_length"].gain > 1.5 and done["ngram_draft_length"].verdict is Verdict.PASS
        assert not done["token_tile"].carried_over and done["token_tile"].from_scope == far  # no gain on B
        assert memory.sql("SELECT mechanism, stage FROM failures").rows == (("token_tile", "transfer"),)
        rows = memory.sql("SELECT count(*) FROM evidence e JOIN scopes s ON s.id = e.scope_id "
                          "WHERE s.model = 'model-b' AND e.run_id = 'run-b'").rows
        assert rows == ((2,),) and transfer_candidates(memory, here) == []  # proven here, or failed here
        best = memory.retrieve(here)[0]
        assert best.mechanism.name == "ngram_draft_length" and best.proven_on == here
