"""The tuning loop on a batch-regime deployment, and the single regime kept apart from it.

micro-batch-cpu (a micro random-weight Llama served by the batched engine at concurrency 2 and 3, all requests at
once) runs recall -> profile -> attribute -> explore -> validate -> integrate in-process through the stage
framework, as the flow's tasks run them (no Prefect server). Memory starts with one batching mechanism proven on
another machine, so explore tries it first; the search turns the catalog's batching knobs; the quick bench
measures batched throughput next to batched AR and stock batched spec; validation checks every request's output
against its single-request AR output; integrate stores the winner's BatchConfig beside its EngineConfig and memory
records the batching delta. Single-request deployments never see a batching knob. On CPU the Triton kernels run
under the interpreter (tests/conftest.py); the micro target keeps a step near 0.1 s.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import optuna
import pyarrow.parquet as pq
import pytest

from specpilot.artifacts import read_manifest, store_from_uri  # noqa: E402
from specpilot.costmodel import DirectionName  # noqa: E402
from specpilot.deployments import RegimeKind, load_deployment  # noqa: E402
from specpilot.engines.batch import BatchConfig  # noqa: E402
from specpilot.memory import Evidence, Mechanism, MechanismCategory, Memory, Scope, Verdict  # noqa: E402
from specpilot.stages import catalog, search_params  # noqa: E402
from specpilot.stages.candidate import Candidate  # noqa: E402
from specpilot.stages.io import StageName, memory_scope, path_part  # noqa: E402
from _stage_chain import recall_to_explore, stage_runner  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEP, RUN, EARLIER = "micro-batch-cpu", "20260102T000000Z-batch1", "20250101T000000Z-seed01"
# Sized for two shared cores (a step of the interpreted batched engine takes ~0.1 s): 12 new tokens per request.
NEW = 12
PROFILE = {"prompts": 1, "max_new_tokens": NEW, "kernel_steps": 1, "cost_tokens": [1, 8, 16], "cost_repeats": 1}
EXPLORE = {"round": 1, "prompts": 2, "max_new_tokens": NEW, "trials": 2, "batch": 4, "keep": 1, "memory_candidates": 1}
RECALLED = {"drafter": "ngram", "batch": {"draft_length": "goodput", "max_draft_len": 8}}  # proven elsewhere


def seed_memory(path: str, scope: Scope) -> str:
    """A batching mechanism with passing evidence on the same model and regime on another machine."""
    name = "goodput_draft:batch.draft_length=goodput,batch.max_draft_len=8,drafter=ngram"
    with Memory.open(path) as memory, memory.transaction():
        memory.record_run(EARLIER, DEP, {"seeded": True})
        memory.record_mechanism(Mechanism(name, MechanismCategory.SCHEDULING, "goodput draft", RECALLED))
        elsewhere = Scope(scope.model_family, scope.model, scope.drafter, "NVIDIA H200", scope.regime)
        memory.record_evidence(Evidence(name, elsewhere, EARLIER, DEP, "c2-all", "speedup_vs_stock", 1.0, 1.3,
                                        Verdict.PASS))
    return name


def shallow(fn):
    """fn() in a fresh thread. Python 3.11 keeps frames in per-thread chunks; under pytest's deep stack the Triton
    interpreter's hot calls straddled a chunk boundary, mapping and unmapping a chunk on every call (measured: the
    stages ran 1.8x slower, 40% of it page faults). A new thread starts with a shallow stack."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-pipeline")
    return shallow(lambda: run_pipeline(root))


def run_pipeline(root: Path) -> dict:
    store, memory, out = str(root / "store"), str(root / "memory.duckdb"), root / "out"
    dep = load_deployment(DEP)
    stock = catalog.stock_candidate(dep)
    seeded = seed_memory(memory, memory_scope(dep, stock.drafter_label, "cpu"))

    stage = stage_runner(RUN, DEP, store, out)
    runs = {"store": store, "memory": memory, "stock": stock, "seeded": seeded,
            **recall_to_explore(stage, stock, memory, PROFILE, EXPLORE)}
    # Memory's candidate is owed a verdict (selected whenever it ran): the one validated here, to keep the time.
    chosen = [m["candidate"] for m in runs["explore"].meta["selected"] if m["candidate"]["source"] == "memory"]
    runs["validate"] = [stage(StageName.VALIDATE, ("round1", path_part(c["name"])), {
        "prompts": 1, "max_new_tokens": NEW, "stock": stock.to_dict(), "candidate": c}) for c in chosen]
    runs["integrate"] = stage(StageName.INTEGRATE, ("round1",), {
        "round": 1, "heldout_prompts": 2, "heldout_max_new_tokens": NEW, "memory": memory, "stock": stock.to_dict(),
        "current": stock.to_dict()},
        {"explore.0": runs["explore"].manifest_uri,
         **{f"validate.{i}": v.manifest_uri for i, v in enumerate(runs["validate"])}})
    return runs


def _batch_knobs(space: dict) -> dict[str, dict]:
    return {k["field"]: k for ms in space["mechanisms"].values() for m in ms for k in m["knobs"]
            if k.get("target") == "batch"}


@pytest.mark.interpreter
def test_explore_proposes_and_measures_batch_knobs(pipeline):
    out, meta = Path(pipeline["explore"].out_dir), pipeline["explore"].meta
    space = json.loads((out / "search_space.json").read_text())
    knobs = _batch_knobs(space)
    assert knobs, "the catalog offers the batching mechanisms to a batch-regime deployment"
    measured = json.loads((out / "measurements.json").read_text())
    first = measured[0]["candidate"]
    assert meta["memory_first"] == [first["name"]] and first["source"] == "memory"
    assert first["batch_config"]["draft_length"] == "goodput" and first["batch_config"]["max_draft_len"] == 8
    search = [m for m in measured if m["candidate"]["source"] == "search"]
    assert 1 <= len(search) <= EXPLORE["trials"]
    for m in search:  # every trial is a batched build, its batching knobs inside the catalog's ranges
        batch = m["candidate"]["batch_config"]
        assert batch is not None and batch["max_batch"] == 3
        for field, k in knobs.items():
            assert (k["low"] <= batch[field] <= k["high"]) if k["domain"] == "int" else batch[field] in k["choices"]
    turned = {name for m in search for name in m["candidate"]["mechanisms"]}
    assert turned & {"goodput_draft", "verify_budget", "overlap_draft"}, "the search turns a batching knob"
    assert all(m["matches_ar"] and m["status"] == "ok" for m in measured)  # the batched engine stays lossless
    rows = pq.read_table(out / "measurements.parquet").to_pylist()
    assert {r["concurrency"] for r in rows} == {2, 3}
    assert {r["variant"] for r in rows} >= {"ar", "stock", first["name"]}
    assert all(r["throughput"] > 0 and r["speedup_vs_stock"] > 0 for r in rows)
    assert meta["agent"]["status"] == "off_regime"


def _recalled(pipeline):
    """The validation of memory's candidate (owed a verdict: always validated when it ran)."""
    return next(v for v in pipeline["validate"] if v.meta["candidate"]["source"] == "memory")


@pytest.mark.interpreter
def test_validation_checks_every_request_against_single_request_ar(pipeline):
    first = _recalled(pipeline)
    assert first.meta["verdict"] == "pass"
    assert first.meta["regime"] == "batch2-3" and set(first.meta["per_benchmark"]) == {"c2-all", "c3-all"}
    verdict = json.loads((Path(first.out_dir) / "verdict.json").read_text())
    assert verdict["regime"] == "batch" and verdict["concurrency"] == [2, 3] and verdict["divergences"] == []
    assert verdict["batch_config"]["draft_length"] == "goodput" and len(verdict["speedup"]["first"]) == 2
    assert all(v.meta["verdict"] == "pass" for v in pipeline["validate"])


@pytest.mark.interpreter
def test_integrate_stores_the_batch_config_and_memory_records_the_delta(pipeline):
    meta = pipeline["integrate"].meta
    assert meta["speedup_vs_ar"][meta["final_label"]] >= meta["speedup_vs_ar"]["stock"]
    store = store_from_uri(pipeline["store"])
    build = read_manifest(store, meta["build"]["manifest_uri"])
    assert {o.name for o in build.outputs} == {"engine_config.json", "build_candidate.json", "batch_config.json"}
    batch_bytes = store.get_bytes(build.output("batch_config.json").uri)
    assert meta["build"]["batch_config_uri"].endswith(meta["build"]["batch_config_sha256"])  # content-addressed
    assert BatchConfig.from_dict(json.loads(batch_bytes)).to_dict() == meta["final_batch_config"]
    assert meta["final_batch_config"] == meta["final"]["batch_config"] and build.meta["regime"] == "batch2-3"
    recalled = _recalled(pipeline).meta
    with Memory.open(pipeline["memory"], read_only=True) as memory:
        evidence = memory.sql(
            "SELECT m.name, m.config_delta, s.regime, s.gpu, e.benchmark, e.verdict FROM evidence e JOIN mechanisms m "
            "ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id WHERE e.run_id = ?", params=[RUN]).rows
        failures = memory.sql("SELECT stage, reason, config_delta FROM failures WHERE run_id = ?", params=[RUN]).rows
    if recalled["speedup_vs_stock"] > 1.0:  # it carried over: evidence here, under its own name, on this scope
        mine = [r for r in evidence if r[0] == pipeline["seeded"]]
        assert mine and all(r[2] == "batch2-3" and r[3].startswith("cpu:") and r[5] == "pass" for r in mine)
        assert {r[4] for r in mine} >= {"c2-all", "c3-all"} and json.loads(mine[0][1])["batch"] == RECALLED["batch"]
    else:  # lossless but not faster here: a failure row holding the batching delta it was tried with
        assert any(json.loads(d or "{}").get("batch") == RECALLED["batch"] for _, _, d in failures)


@pytest.mark.interpreter
def test_a_lossy_batched_build_is_rejected(monkeypatch):
    """Every request is checked against its single-request AR output: a batched engine that corrupts one committed
    token of the candidate (and not stock) fails validation at that token."""
    from specpilot.engines.batch.engine import BatchEngine
    from specpilot.stages.batch_validate import validate_batched
    from specpilot.stages.devices import session_for
    from specpilot.stages.io import SplitName, select_prompts

    dep, session = load_deployment(DEP), session_for(DEP, "cpu")
    stock = catalog.stock_candidate(dep)
    lossy = Candidate("overlap", stock.config, batch_config=stock.batch_config.replace(overlap_draft=True))
    commit = BatchEngine._commit

    def corrupt(self, req, new, now):
        if self.batch.overlap_draft and len(req.out) <= 2 < len(req.out) + len(new):
            new = list(new)
            new[2 - len(req.out)] = (new[2 - len(req.out)] + 1) % 64
        return commit(self, req, new, now)

    monkeypatch.setattr(BatchEngine, "_commit", corrupt)
    prompts = session.tokenize(select_prompts(dep, SplitName.VALIDATE, 1))
    verdict = shallow(lambda: validate_batched(session, stock, lossy, prompts, 4, tie_epsilon=1e-5))
    assert verdict.kind.value == "fail" and verdict.divergences
    assert {(d.kind.value, d.index) for d in verdict.divergences} == {("free_running", 2)}
    assert all(d.prompt.startswith("candidate:") and not d.tie for d in verdict.divergences)


def test_batch_knobs_round_trip_combine_and_name():
    from specpilot.stages.integrate import ValidatedCandidate, combine
    from specpilot.stages.remember import mechanism_name, memory_delta
    from specpilot.stages.validate import VerdictKind

    dep = load_deployment(DEP)
    stock = catalog.stock_candidate(dep)
    space = catalog.search_space(dep, stock, DirectionName.TREE_SHAPE, min_settings=2)
    params = search_params.params_of(stock.config, stock.drafter_label, dep, stock, space, stock.batch_config)
    assert params["goodput_draft.draft_length"] == "fixed" and params["verify_budget.verify_budget"] == "off"
    trial = optuna.trial.FixedTrial({**params, "goodput_draft.max_draft_len": 5, "verify_budget.verify_budget_max": 32})
    config, label, batch = search_params.suggest(trial, dep, stock, space)
    assert batch.to_dict() == stock.batch_config.to_dict()  # unread knobs are pinned: stock, measured once

    def accepted(name: str, speedup: float, **fields) -> ValidatedCandidate:
        b = stock.batch_config.replace(**fields)
        c = Candidate(name, stock.config, mechanisms=catalog.mechanisms_in(stock, stock.config, "ngram", batch=b),
                      drafter_label="ngram", batch_config=b)
        return ValidatedCandidate(c, VerdictKind.PASS, speedup, {"c2-all": speedup}, (), "file:///v")

    goodput = accepted("a", 1.3, draft_length="goodput", max_draft_len=12)
    overlap = accepted("b", 1.2, overlap_draft=True)
    shorter = accepted("c", 1.1, draft_length="goodput", max_draft_len=4)
    assert goodput.candidate.mechanisms == ("goodput_draft",)
    combined, parts, notes = combine(dep, stock, [shorter, overlap, goodput], round_=1)
    assert [p.candidate.name for p in parts] == ["a", "b"] and combined.batch_config.overlap_draft
    assert (combined.batch_config.draft_length.value, combined.batch_config.max_draft_len) == ("goodput", 12)
    assert combined.mechanisms == ("goodput_draft", "overlap_draft") and combined.config == stock.config
    assert notes == ("c left out: sets ['batch.max_draft_len'] differently from a",)
    delta = memory_delta(stock, combined)
    batch = {"draft_length": "goodput", "max_draft_len": 12, "overlap_draft": True}
    assert delta == {"drafter": "ngram", "batch": batch}
    assert mechanism_name(combined, delta) == ("goodput_draft+overlap_draft:batch.draft_length=goodput,"
                                               "batch.max_draft_len=12,batch.overlap_draft=True,drafter=ngram")


@pytest.mark.parametrize("name", ["smollm2-135m-cpu", "smollm2-135m-h200", "qwen3-next-tiny-cpu"])
def test_a_single_request_deployment_never_gets_batch_knobs(name):
    from specpilot.stages.batch_catalog import apply_batch_delta
    from specpilot.stages.batch_quickbench import BatchQuickBench
    from specpilot.stages.explore import ExploreParams
    from specpilot.stages.proposers import ExploreContext, MemoryHit, MemoryProposer

    dep = load_deployment(name)
    stock = catalog.stock_candidate(dep)
    assert dep.regime.kind is RegimeKind.SINGLE and stock.batch_config is None
    for direction in DirectionName:
        for min_settings in (2, 10 ** 9):  # the direction's own mechanisms, and widened to every applicable one
            space = catalog.search_space(dep, stock, direction, min_settings)
            offered = [m for ms in space.mechanisms.values() for m in ms]
            assert not any(m.batched or RegimeKind.SINGLE not in m.regimes for m in offered)
            assert search_params.suggest(_defaults(space), dep, stock, space)[2] is None
    hits = (MemoryHit("goodput", "scheduling", "", RECALLED, 9, (), 1.3, {}, EARLIER),)
    space = catalog.search_space(dep, stock, DirectionName.TREE_SHAPE, 2)
    ctx = ExploreContext(dep, stock, None, space, hits, None, ExploreParams())
    assert MemoryProposer().propose(None, ctx, 5) == []  # a batching mechanism never reaches a single deployment
    with pytest.raises(ValueError, match="batch-regime deployments only"):
        apply_batch_delta(dep, None, RECALLED["batch"])
    with pytest.raises(ValueError, match="not in the batch regime"):
        BatchQuickBench(type("S", (), {"deployment": dep})(), [], 4, stock)
    with pytest.raises(ValueError, match="mean nothing to the single regime"):
        catalog.CatalogMechanism("bad", MechanismCategory.SCHEDULING, "", (catalog.Knob(
            "overlap_draft", catalog.KnobDomain.CHOICE, choices=(True,), target=catalog.KnobTarget.BATCH),),
                                 frozenset({DirectionName.OVERHEAD}))


def _defaults(space) -> optuna.trial.FixedTrial:
    """A trial of the first drafter with every knob of its mechanisms at its first value."""
    label = space.drafter_labels[0]
    params = {"drafter_label": label} if len(space.drafter_labels) > 1 else {}
    for m in space.mechanisms[label]:
        for k in m.knobs:
            params[f"{m.name}.{k.field}"] = k.low if k.domain.value == "int" else k.choices[0]
    return optuna.trial.FixedTrial(params)
