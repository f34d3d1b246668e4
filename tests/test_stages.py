"""The tuning-loop stages run for real on a tiny deployment: profile -> attribute -> explore -> validate ->
integrate through the stage framework (store + sha256 manifests), the stage CLI, the catalog and the proposers."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import optuna
import pyarrow.parquet as pq
import pytest

from specpilot.artifacts import audit_run, read_manifest, run_prefix, store_from_uri
from specpilot.costmodel import Attribution, DirectionName
from specpilot.deployments import load_deployment
from specpilot.engines.config import EngineConfig
from specpilot.engines.shapes import OpClass
from specpilot.memory import Memory
from specpilot.stages import catalog, search_params
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.cli import main as stage_main
from specpilot.stages.explore import ExploreParams
from specpilot.stages.proposers import ExploreContext, MemoryHit, MemoryProposer
from specpilot.stages.quickbench import QuickBench
from specpilot.stages.devices import session_for
from specpilot.stages.io import StageName, path_part
from specpilot.stages.lossy import lossy_candidates
from _stage_chain import recall_to_explore, stage_runner

RUN = "20260101T000000Z-abc123"
PROFILE = {"prompts": 2, "kernel_steps": 2, "cost_tokens": [1, 8, 16, 32], "cost_repeats": 2}
EXPLORE = {"round": 1, "prompts": 2, "max_new_tokens": 32, "trials": 4, "batch": 2, "repeats": 2, "keep": 2,
           "memory_candidates": 2}


@pytest.fixture(scope="module")
def pipeline(tiny_deployment, tmp_path_factory):
    """One round of every stage on tiny-a, in-process, exactly as the flow runs them."""
    root = tmp_path_factory.mktemp("pipeline")
    store, memory, out = str(root / "store"), str(root / "memory.duckdb"), root / "out"
    dep = load_deployment(tiny_deployment)
    stock = catalog.stock_candidate(dep)

    stage = stage_runner(RUN, str(tiny_deployment), store, out)
    runs = {"store": store, "memory": memory, "out": out, "stock": stock,
            **recall_to_explore(stage, stock, memory, PROFILE, EXPLORE)}
    # The cycle model's drafts are always right, so the lossy policy must corrupt accepted tokens themselves.
    lossy = next(c for c in lossy_candidates(stock.config, stock.drafter_label) if c.mechanisms == ("drop_accepted_token",))
    chosen = [json.loads(json.dumps(m["candidate"])) for m in runs["explore"].meta["selected"]] + [lossy.to_dict()]
    runs["validate"] = [stage(StageName.VALIDATE, ("round1", path_part(c["name"])), {
        "prompts": 2, "stock": stock.to_dict(), "candidate": c}) for c in chosen]
    runs["integrate"] = stage(StageName.INTEGRATE, ("round1",), {
        "round": 1, "heldout_prompts": 2, "memory": memory, "stock": stock.to_dict(), "current": stock.to_dict()},
        {"explore.0": runs["explore"].manifest_uri,
         **{f"validate.{i}": v.manifest_uri for i, v in enumerate(runs["validate"])}})
    return runs


def test_every_stage_output_is_in_the_store_with_its_sha256(pipeline):
    store = store_from_uri(pipeline["store"])
    for key in ("recall", "profile", "attribute", "explore", "integrate"):
        outcome = pipeline[key]
        manifest = read_manifest(store, outcome.manifest_uri)
        local = {p.name for p in Path(outcome.out_dir).iterdir()} - {"manifest.json"}
        assert {o.name for o in manifest.outputs} == local and "request.json" in local
        for entry in manifest.outputs:
            data = store.get_bytes(entry.uri)
            assert hashlib.sha256(data).hexdigest() == entry.sha256 == hashlib.sha256(
                (Path(outcome.out_dir) / entry.name).read_bytes()).hexdigest()
    report = audit_run(store, run_prefix(RUN))
    assert report.ok and report.outputs_verified > 20


def test_profile_traces_kernels_cost_curve_and_ceilings(pipeline):
    out = Path(pipeline["profile"].out_dir)
    outputs = json.loads((out / "outputs.json").read_text())
    assert set(outputs) == {"ar", "build"} and outputs["ar"] == outputs["build"]  # lossless on the tune prompts
    steps = pq.read_table(out / "steps.parquet").to_pylist()
    assert steps and all(s["target_tokens"] for s in steps) and max(s["accepted"] for s in steps) >= 3
    requests = pq.read_table(out / "requests.parquet").to_pylist()
    assert {r["mode"] for r in requests} == {"ar", "spec"} and len(requests) == 4
    kernels = pq.read_table(out / "kernels.parquet").to_pylist()
    assert {k["op"] for k in kernels} <= {op.value for op in OpClass} and any(k["name"] == "aten::mm" for k in kernels)
    assert all(k["steps"] == 2 and k["device_s"] > 0 for k in kernels)
    curve = json.loads((out / "cost_curve.json").read_text())["points"]
    assert sorted(map(int, curve)) == [1, 8, 16, 32] and all(v > 0 for v in curve.values())
    assert [curve[k] for k in ("1", "8", "16", "32")] == sorted(curve.values())  # never cheaper when wider
    ceilings = json.loads((out / "ceilings.json").read_text())
    assert ceilings["peak_flops"] > 1e8 and ceilings["peak_bandwidth"] > 1e8 and 0 < ceilings["launch_latency_s"] < 1e-3
    summary = pipeline["profile"].meta
    assert summary["all_match_ar"] and summary["speedup_vs_ar"] > 0 and summary["tokens_per_step"] > 1.5
    assert summary["weight_bytes"] == summary["element_bytes"] in (2, 4)  # a native build reads its dtype


def test_the_cost_model_counts_the_bytes_a_weight_format_reads(pipeline):
    """The ideal times use the bytes the build's kernels read a weight (a W12 build's profile writes ~1.5, its
    layouts' bytes, not the dtype's 2: its gaps against its own floor); a profile written before the
    element_bytes field (weight_bytes = the dtype's bytes) still reads."""
    from specpilot.stages.attribute import ProfileTraces, attribute_profile
    out = Path(pipeline["profile"].out_dir)
    shape, ceilings, curve = (json.loads((out / f"{name}.json").read_text()) for name in ("shape", "ceilings",
                                                                                          "cost_curve"))
    ceilings = {**ceilings, "peak_flops": 1e18}  # every op bound by its bytes (a slow CPU matmul made some compute-bound)
    arts = [pq.read_table(out / "steps.parquet"), pq.read_table(out / "kernels.parquet"), shape, ceilings, curve]
    summary = json.loads((out / "summary.json").read_text())
    elem = summary["element_bytes"]
    old = {k: v for k, v in summary.items() if k != "element_bytes"}
    w12 = {**summary, "weight_bytes": 0.76 * elem}
    native, legacy, packed = (ProfileTraces.from_artifacts(*arts, s) for s in (summary, old, w12))
    assert (legacy.element_bytes, legacy.weight_bytes) == (native.element_bytes, native.weight_bytes) == (elem, elem)
    assert (packed.element_bytes, packed.weight_bytes) == (elem, 0.76 * elem)
    a, b = attribute_profile(native), attribute_profile(packed)
    assert b.kernel.ideal_s < a.kernel.ideal_s and b.kernel.factor > a.kernel.factor
    assert b.kernel.measured_s == a.kernel.measured_s


def test_attribution_has_three_factors_report_and_plot(pipeline):
    out, f = Path(pipeline["attribute"].out_dir), pipeline["attribute"].meta
    attr = Attribution.from_dict(json.loads((out / "attribution.json").read_text()))
    assert attr.total_gap == pytest.approx(attr.tau.gap * attr.kernel.factor * attr.overhead.factor)
    assert f["direction"] == attr.directions[0].name.value and DirectionName(f["direction"])
    assert {f["tau_gap"], f["kernel"], f["overhead"]} == {attr.tau.gap, attr.kernel.factor, attr.overhead.factor}
    report = (out / "report.md").read_text()
    assert "tau (tree shape)" in report and "| kernel |" in report and "| overhead |" in report
    assert "![factors and per-op-class time](attribution.png)" in report
    assert (out / "attribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_later_attribution_can_be_judged_by_an_earlier_profiles_ceilings(pipeline, tiny_deployment):
    """Before/after comparisons (kernel tuning, later rounds) share one yardstick: the ceilings measured at profile
    time move between runs, and every ideal time with them."""
    stage = stage_runner(RUN, str(tiny_deployment), pipeline["store"], pipeline["out"])
    again = stage(StageName.PROFILE, ("again",), {**PROFILE, "build": pipeline["stock"].to_dict()})
    first = json.loads((Path(pipeline["profile"].out_dir) / "ceilings.json").read_text())
    mine = json.loads((Path(again.out_dir) / "ceilings.json").read_text())
    own = stage(StageName.ATTRIBUTE, ("again", "own"), {}, {"profile": again.manifest_uri})
    shared = stage(StageName.ATTRIBUTE, ("again", "shared"), {}, {"profile": again.manifest_uri,
                                                                   "ceilings": pipeline["profile"].manifest_uri})
    for run, c in ((own, mine), (shared, first)):
        report = (Path(run.out_dir) / "report.md").read_text()
        assert f"{c['peak_bandwidth'] / 1e9:.1f} GB/s (copy" in report and f"{c['peak_flops'] / 1e9:.1f} GFLOP/s" in report
    assert pipeline["profile"].manifest_uri in read_manifest(store_from_uri(pipeline["store"]), shared.manifest_uri).inputs


def test_explore_measures_trials_and_selects_what_beats_the_build(pipeline):
    out, meta = Path(pipeline["explore"].out_dir), pipeline["explore"].meta
    measured = json.loads((out / "measurements.json").read_text())
    search = [m for m in measured if m["candidate"]["source"] == "search"]
    assert 1 <= len(search) <= EXPLORE["trials"] and meta["tried"] == len(measured) and meta["memory_first"] == []
    assert len({m["batch"] for m in measured}) == -(-len(search) // EXPLORE["batch"])  # one bench run per batch
    space = json.loads((out / "search_space.json").read_text())
    knobs = {k["field"]: k for ms in space["mechanisms"].values() for m in ms for k in m["knobs"]}
    for m in search:  # every trial stays inside the catalog's ranges
        config = m["candidate"]["config"]
        for field, k in knobs.items():
            assert (k["low"] <= config[field] <= k["high"]) if k["domain"] == "int" else config[field] in k["choices"]
    assert meta["selected"], "the cycle model's outputs reward drafts longer than stock's 5"
    for m in meta["selected"]:
        assert m["matches_ar"] and m["objective"] > m["baseline"]  # beat the build in the same bench run
        assert m["candidate"]["config"]["draft_len"] > 5
    rows = pq.read_table(out / "measurements.parquet").to_pylist()
    assert {r["variant"] for r in rows} >= {"ar", "baseline"} | {m["candidate"]["name"] for m in search}
    assert {r["repeat"] for r in rows} == {0, 1}


def test_validation_passes_real_candidates_and_rejects_a_lossy_one(pipeline):
    *real, lossy = pipeline["validate"]
    assert lossy.meta["verdict"] == "fail" and lossy.meta["candidate"]["source"] == CandidateSource.LOSSY_SUITE.value
    assert all(v.meta["verdict"] == "pass" for v in real)
    for v in pipeline["validate"]:
        files = {p.name for p in Path(v.out_dir).iterdir()}
        assert {"verdict.json", "ties.jsonl", "margins.jsonl", "candidate.json"} <= files


def test_integrate_builds_content_addressed_and_never_loses_to_stock(pipeline):
    meta = pipeline["integrate"].meta
    assert meta["speedup_vs_ar"][meta["final_label"]] >= meta["speedup_vs_ar"]["stock"]
    assert meta["final_is_stock"] == (meta["final_label"] == "stock")
    store = store_from_uri(pipeline["store"])
    build = read_manifest(store, meta["build"]["manifest_uri"])
    config_bytes = store.get_bytes(build.output("engine_config.json").uri)
    assert hashlib.sha256(config_bytes).hexdigest() == meta["build"]["config_sha256"]
    assert meta["build"]["config_sha256"] == build.output("engine_config.json").sha256
    assert meta["build"]["config_uri"].endswith(meta["build"]["config_sha256"])  # content-addressed
    assert EngineConfig.from_dict(json.loads(config_bytes)).to_dict() == meta["final"]["config"]
    assert build.meta["code_version"]["sources_sha256"] and build.meta["fingerprint"]


def test_integrate_writes_run_mechanisms_scope_evidence_and_failures(pipeline):
    with Memory.open(pipeline["memory"], read_only=True) as memory:
        runs = memory.sql("SELECT status, report_uri FROM runs WHERE run_id = ?", params=[RUN]).rows
        evidence = memory.sql(
            "SELECT m.name, m.category, m.config_delta, s.model_family, s.model, s.drafter, s.gpu, s.regime, "
            "e.benchmark, e.metric, e.before, e.after, e.verdict, e.artifact_uris FROM evidence e "
            "JOIN mechanisms m ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id").rows
        failures = memory.sql("SELECT stage, reason FROM failures WHERE run_id = ?", params=[RUN]).rows
    assert list(runs) == [("succeeded", pipeline["integrate"].manifest_uri)]
    validated = [v for v in pipeline["validate"][:-1] if v.meta["speedup_vs_stock"] > 1.0]
    assert bool(evidence) == bool(validated)
    for row in evidence:
        assert row[1] == "algorithm" and json.loads(row[2])["drafter"] == "ngram" and "draft_len" in json.loads(row[2])
        assert row[3:6] == ("llama", "model-a", "ngram") and row[6].startswith("cpu:") and row[7] == "batch1"
        assert row[8] in {"gsm8k", "humaneval"} and row[12] == "pass" and json.loads(row[13])
    assert any(stage == "validate" and reason.startswith("lossy:drop_accepted_token: token forcing fail")
               for stage, reason in failures)


def test_stage_cli_reruns_a_stage_from_its_request(pipeline, tmp_path, capsys):
    request = Path(pipeline["attribute"].out_dir) / "request.json"
    assert stage_main(["stage", "attribute", "--in", str(request), "--out", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["summary"]["direction"] == pipeline["attribute"].meta["direction"]
    assert (tmp_path / "manifest.json").is_file() and (tmp_path / "attribution.png").is_file()
    with pytest.raises(ValueError, match="is a attribute request, not profile"):
        stage_main(["stage", "profile", "--in", str(request), "--out", str(tmp_path / "x")])


def test_search_space_by_device_direction_and_widening():
    cpu, gpu = load_deployment("smollm2-135m-cpu"), load_deployment("smollm2-135m-h200")
    space = catalog.search_space(cpu, catalog.stock_candidate(cpu), DirectionName.TREE_SHAPE, min_settings=2)
    names = {label: {m.name for m in ms} for label, ms in space.mechanisms.items()}
    assert space.drafter_labels == ("ngram", "draft_model:smollm2-135m-l6") and not space.widened
    assert names == {"ngram": {"ngram_draft_length", "ngram_window"}, "draft_model:smollm2-135m-l6": {"draft_model_length"}}
    kernels = catalog.search_space(cpu, catalog.stock_candidate(cpu), DirectionName.KERNELS, min_settings=40)
    assert kernels.widened and "token_tile" in {m.name for m in kernels.mechanisms["ngram"]}
    assert not {"cuda_graphs", "torch_compile", "triton_kernels"} & {m.name for m in kernels.mechanisms["ngram"]}
    overhead = catalog.search_space(gpu, catalog.stock_candidate(gpu), DirectionName.OVERHEAD, min_settings=2)
    gpu_names = {m.name for m in overhead.mechanisms["ngram"]}
    assert {"cuda_graphs", "torch_compile", "token_tile", "ngram_draft_length"} <= gpu_names


def test_the_drafter_window_is_a_tree_shape_knob_of_block_drafters_only():
    dep = load_deployment("smollm2-135m-block-cpu")
    space = catalog.search_space(dep, catalog.stock_candidate(dep), DirectionName.TREE_SHAPE, min_settings=2)
    assert space.mechanisms and all("drafter_window" in {m.name for m in ms} for ms in space.mechanisms.values())
    window = catalog.BY_NAME["drafter_window"]
    for value in window.knobs[0].choices:  # every setting is a valid engine
        EngineConfig(drafter="block", drafter_window=value)
    cpu = load_deployment("smollm2-135m-cpu")  # n-gram and draft-model drafters have no context window
    space = catalog.search_space(cpu, catalog.stock_candidate(cpu), DirectionName.TREE_SHAPE, min_settings=2)
    assert not any("drafter_window" in {m.name for m in ms} for ms in space.mechanisms.values())


def test_the_drafter_head_rows_are_a_knob_of_block_drafters_only():
    """Every setting is a valid engine; a drafter without a token ranking fails its build with a ConfigError, which
    the quick bench records as not buildable."""
    dep = load_deployment("smollm2-135m-block-cpu")
    space = catalog.search_space(dep, catalog.stock_candidate(dep), DirectionName.KERNELS, min_settings=2)
    assert all("drafter_head_rows" in {m.name for m in ms} for ms in space.mechanisms.values())
    for value in catalog.BY_NAME["drafter_head_rows"].knobs[0].choices:
        EngineConfig(drafter="block", drafter_head_rows=value)
    cpu = load_deployment("smollm2-135m-cpu")
    space = catalog.search_space(cpu, catalog.stock_candidate(cpu), DirectionName.KERNELS, min_settings=2)
    assert not any("drafter_head_rows" in {m.name for m in ms} for ms in space.mechanisms.values())


def test_w12_weights_are_a_kernel_knob_of_triton_bf16_builds_on_gpus():
    """The loop can choose the 12-bit weights where they pay (issue #6): a KERNELS mechanism of a CUDA build that
    runs the Triton kernels in bf16 (W12 decodes inside them, to bf16), offered by the search, turned by its delta."""
    from specpilot.deployments import DeviceKind, RegimeKind
    from specpilot.engines.config import WeightFormat

    gpu = load_deployment("smollm2-135m-h200")
    stock = catalog.stock_candidate(gpu)
    w12 = catalog.BY_NAME["w12_weights"]
    triton = Candidate("t", stock.config.replace(kernel_backend="triton"), mechanisms=("triton_kernels",),
                       drafter_label=stock.drafter_label)
    assert w12.applies(triton.config, DeviceKind.CUDA) and not w12.applies(triton.config, DeviceKind.CPU)
    assert not w12.applies(stock.config.replace(kernel_backend="torch"), DeviceKind.CUDA)
    assert not w12.applies(triton.config.replace(dtype="float16"), DeviceKind.CUDA)
    space = catalog.search_space(gpu, triton, DirectionName.KERNELS, min_settings=2)
    assert "w12_weights" in {m.name for m in space.mechanisms[triton.drafter_label]}
    config, label = catalog.apply_delta(gpu, triton, {"weight_format": "w12"}, None)
    assert config.weight_format is WeightFormat.W12 and label == triton.drafter_label
    assert catalog.mechanisms_in(triton, config, label) == ("w12_weights",)
    # a table tuned on bf16 weights: the W12 trial keeps its numerics (the bits), not its projections' launch shapes
    table = (("attention@576x192@T1", '{"tile_rows": 16}'),
             ("qkv@960x576@T1", '{"block_k": 256, "block_n": 64, "num_warps": 8, "producer_stat": true}'))
    tuned = dataclasses.replace(triton, config=triton.config.replace(kernel_table=table))
    config, _ = catalog.apply_delta(gpu, tuned, {"weight_format": "w12"}, None)
    assert dict(config.kernel_table) == {"attention@576x192@T1": '{"tile_rows": 16}',
                                         "qkv@960x576@T1": '{"block_k": 256, "producer_stat": true}'}
    assert catalog.apply_delta(gpu, tuned, {"draft_len": 7}, None)[0].kernel_table == table  # same weights: as is
    assert w12.applies(triton.config, DeviceKind.CUDA, regime=RegimeKind.BATCH)  # the batched engine reads it too


def test_the_side_stream_is_a_block_drafters_overhead_knob_on_gpus():
    """observe_overlap / lookup_overlap (engines.side_stream): a CUDA mechanism of block drafters; on smollm2-135m-h200's
    switched line (1-step chunks, grown trees led by a gated lookup) every setting is a valid engine, turned by its
    delta."""
    from specpilot.deployments import DeviceKind

    gpu = load_deployment("smollm2-135m-h200")
    side = catalog.BY_NAME["side_stream"]
    config = next(d for d in gpu.drafters if dict(d.engine).get("narrow_tree_budget")).engine_config(gpu.engine)
    assert side.applies(config, DeviceKind.CUDA) and not side.applies(config, DeviceKind.CPU)
    assert not side.applies(EngineConfig(drafter="ngram"), DeviceKind.CUDA)
    for observe in side.knobs[0].choices:
        for lookup in side.knobs[1].choices:
            assert config.replace(observe_overlap=observe, lookup_overlap=lookup).lookup_overlap == lookup


def test_trial_parameters_reproduce_configs_and_deltas_merge():
    dep = load_deployment("smollm2-135m-cpu")
    stock = catalog.stock_candidate(dep)
    space = catalog.search_space(dep, stock, DirectionName.TREE_SHAPE, min_settings=2)
    params = search_params.params_of(stock.config, stock.drafter_label, dep, stock, space)
    assert params == {"drafter_label": "ngram", "ngram_draft_length.draft_len": 5, "ngram_window.ngram_max": 4,
                      "ngram_window.ngram_min": 1}
    trial = optuna.trial.FixedTrial({**params, "ngram_draft_length.draft_len": 9, "ngram_window.ngram_min": 4,
                                     "ngram_window.ngram_max": 2})
    config, label, batch = search_params.suggest(trial, dep, stock, space)
    assert (config.draft_len, config.ngram_max, config.ngram_min, label) == (9, 2, 2, "ngram")  # min pulled <= max
    assert batch is None  # a single-regime deployment has no BatchConfig to turn
    assert catalog.mechanisms_in(stock, config, label) == ("ngram_draft_length", "ngram_window")
    draft, draft_label, _ = search_params.suggest(optuna.trial.FixedTrial(
        {"drafter_label": "draft_model:smollm2-135m-l6", "draft_model_length.draft_len": 3}), dep, stock, space)
    assert draft.drafter.value == "draft_model" and draft.draft_len == 3 and draft.dtype == stock.config.dtype
    assert search_params.params_of(stock.config.replace(draft_len=30), "ngram", dep, stock, space) is None  # out of range
    merged, used = catalog.merge_deltas([{"draft_len": 8}, {"draft_len": 6}, {"ngram_max": 6}])
    assert merged == {"draft_len": 8, "ngram_max": 6} and used == [0, 2]


def test_memory_proposer_applies_deltas_to_the_new_deployment(tiny_deployment_b):
    dep = load_deployment(tiny_deployment_b)
    stock = catalog.stock_candidate(dep)
    hits = (MemoryHit("ngram_draft_length:draft_len=11", "algorithm", "", {"drafter": "ngram", "draft_len": 11}, 15,
                      ("model_family",), 1.4, {}, RUN),
            MemoryHit("needs-a-draft-model", "algorithm", "", {"drafter": "draft_model", "draft_len": 3}, 15, (), 1.2,
                      {}, RUN),
            MemoryHit("stock-again", "algorithm", "", {"drafter": "ngram", "draft_len": 5}, 15, (), 1.1, {}, RUN))
    space = catalog.search_space(dep, stock, DirectionName.TREE_SHAPE, min_settings=2)
    ctx = ExploreContext(dep, stock, None, space, hits, QuickBench(session_for(str(tiny_deployment_b), "cpu"), [], 8, stock),
                         ExploreParams(round=2, device_index=1))
    proposed = MemoryProposer().propose(None, ctx, 5)
    assert [(c.name, c.config.draft_len, c.source, c.mechanisms) for c in proposed] == [
        ("memory-r2-d1-0", 11, CandidateSource.MEMORY, ("ngram_draft_length:draft_len=11",))]
    assert dataclasses.replace(proposed[0].config, draft_len=5) == stock.config


def test_combine_applies_compatible_deltas_and_names_conflicts():
    from specpilot.stages.integrate import ValidatedCandidate, combine
    from specpilot.stages.validate import VerdictKind

    dep = load_deployment("smollm2-135m-cpu")
    stock = catalog.stock_candidate(dep)

    def accepted(name: str, speedup: float, **delta) -> ValidatedCandidate:
        config = stock.config.replace(**delta)
        c = Candidate(name, config, mechanisms=catalog.mechanisms_in(stock, config, "ngram"), drafter_label="ngram")
        return ValidatedCandidate(c, VerdictKind.PASS, speedup, {"gsm8k": speedup}, (), "file:///v")

    longer, tile, shorter = accepted("a", 1.3, draft_len=9), accepted("b", 1.2, token_tile=8), accepted("c", 1.1, draft_len=3)
    combined, parts, notes = combine(dep, stock, [shorter, tile, longer], round_=2)
    assert [p.candidate.name for p in parts] == ["a", "b"] and combined.name == "integrated-r2"
    assert (combined.config.draft_len, combined.config.token_tile) == (9, 8)
    assert combined.mechanisms == ("ngram_draft_length", "token_tile") and combined.source is CandidateSource.INTEGRATED
    assert notes == ("c left out: sets ['draft_len'] differently from a",)
    single, parts, notes = combine(dep, stock, [shorter], round_=2)
    assert single is shorter.candidate and notes == ()


def test_kernel_tables_apply_to_triton_builds_only():
    from specpilot.flows.tune import kernel_tuned
    from specpilot.stages.io import StageOutcome

    dep = load_deployment("smollm2-135m-h200")
    stock = catalog.stock_candidate(dep)
    triton = Candidate("t", stock.config.replace(kernel_backend="triton", kernel_table=(("qkv@960x576@T16", "{}"),)),
                               mechanisms=("triton_kernels",), drafter_label="ngram")
    pairs = [["qkv@960x576@T16", '{"BLOCK_N": 64}'], ["down@576x1536@T16", '{"BLOCK_N": 32}']]
    tuned = StageOutcome(StageName.TUNE_KERNELS, ("round1",), "file:///m", "/tmp", {"kernel_table": pairs})
    [out] = kernel_tuned([stock, triton], tuned)
    assert out.name == "t+kernels" and out.mechanisms == ("triton_kernels", "kernel_table")
    assert out.config.kernel_table == (("down@576x1536@T16", '{"BLOCK_N": 32}'), ("qkv@960x576@T16", '{"BLOCK_N": 64}'))
    assert catalog.mechanisms_in(triton, out.config, "ngram") == ("kernel_table",)
    assert kernel_tuned([triton], dataclasses.replace(tuned, meta={"kernel_table": []})) == []


def test_a_combination_is_decoded_again_and_token_forced(pipeline, tiny_deployment, tmp_path):
    from specpilot.stages.integrate import IntegrateParams, _prove_combination
    from specpilot.stages.io import SplitName, select_prompts

    dep = load_deployment(tiny_deployment)
    session, stock = session_for(str(tiny_deployment), "cpu"), pipeline["stock"]
    best = Candidate("best", stock.config.replace(draft_len=12), drafter_label="ngram")
    combined = Candidate("combined", stock.config.replace(draft_len=12, ngram_max=6), drafter_label="ngram")
    tune = session.tokenize(select_prompts(dep, SplitName.TUNE, 2))
    heldout = session.tokenize(select_prompts(dep, SplitName.VALIDATE, 2))
    why = _prove_combination(session, stock, best, combined, tune, heldout, IntegrateParams(), tmp_path)
    record = json.loads((tmp_path / "combination.json").read_text())
    assert record["recheck"]["summary"]["combined"]["all_match_ar"]
    if why:  # decoded again, the combination was not faster than the best single candidate
        assert why.startswith("slower") and record["verdict"] is None
    else:
        assert record["verdict"]["kind"] == "pass"


def test_quick_bench_measures_policy_candidates_and_refuses_agent_code(pipeline, tiny_deployment):
    """Our own policy code is decoded next to AR (a lossy one then fails the token check); agent code is refused
    in-process (it runs only in the sandbox)."""
    from specpilot.stages.candidate import CandidateSource
    from specpilot.stages.io import SplitName, select_prompts

    dep = load_deployment(tiny_deployment)
    session, stock = session_for(str(tiny_deployment), "cpu"), pipeline["stock"]
    prompts = session.tokenize(select_prompts(dep, SplitName.TUNE, 1))
    lossy = Candidate("truncate", stock.config, policy="specpilot.stages.lossy:TruncateOutput",
                      drafter_label="ngram", source=CandidateSource.LOSSY_SUITE)
    agent = Candidate("agent-code", stock.config, policy="/tmp/never-imported.py:Policy", drafter_label="ngram",
                      source=CandidateSource.AGENT)
    lossy_m, agent_m = QuickBench(session, prompts, 16, stock)([lossy, agent])
    assert not lossy_m.matches_ar and lossy_m.objective == 0.0 and not lossy_m.error.startswith("ValueError")
    assert agent_m.error.startswith("PermissionError")


def _held(speeds: dict[str, dict[tuple[str, str], float]]):
    """A held-out comparison built by hand: per build its speed on each (benchmark, prompt); speedups vs AR taken
    as the geometric mean of those speeds (AR's speed 1 on every request)."""
    import math
    from specpilot.stages.heldout import Heldout
    gm = {label: math.exp(sum(math.log(x) for x in s.values()) / len(s)) for label, s in speeds.items()}
    return Heldout(gm, {label: {} for label in speeds}, {label: True for label in speeds},
                   {label: gm[label] / gm["stock"] for label in speeds}, 8, 64, {}, speeds)


def test_a_candidate_leading_within_the_noise_keeps_the_runner_up():
    """Integrate's rule, on hand-built held-out numbers: a candidate faster on every request becomes the final build;
    one whose lead comes from a single request of eight (the others slower) does not, and the decision says why;
    with one held-out request nothing can be resampled and the lead decides."""
    from specpilot.stages.integrate import _credibly_faster
    units = [(b, str(i)) for b in ("gsm8k", "mbpp") for i in range(4)]
    stock = {u: 1.0 for u in units}
    steady = {u: 1.2 + 0.01 * i for i, u in enumerate(units)}
    lucky = {u: (3.0 if i == 0 else 0.97) for i, u in enumerate(units)}
    for candidate, final in ((steady, "candidate"), (lucky, "current")):
        held = _held({"stock": stock, "current": {u: 1.01 for u in units}, "candidate": candidate})
        assert held.speedup_vs_ar["candidate"] > held.speedup_vs_ar["current"] > held.speedup_vs_ar["stock"]
        decisions = []
        assert _credibly_faster(held, ["stock", "current", "candidate"], held.speedup_vs_ar, decisions) == final
        lo, hi = held.ratio_interval("candidate", "current")
        assert (lo > 1.0) == (final == "candidate") and hi > 1.0
        assert bool(decisions) == (final != "candidate")
    assert "not credibly faster, current stays" in decisions[0] and "interval over current" in decisions[0]
    one = _held({"stock": {units[0]: 1.0}, "candidate": {units[0]: 1.05}})
    assert one.ratio_interval("candidate", "stock") is None
    assert _credibly_faster(one, ["stock", "candidate"], one.speedup_vs_ar, []) == "candidate"


def test_the_final_builds_interval_over_stock():
    """IntegrateResult.final_vs_stock_interval: the held-out paired interval of the final build over stock, None when
    the final build is stock."""
    from specpilot.stages.integrate import IntegrateResult
    units = [(b, str(i)) for b in ("gsm8k", "mbpp") for i in range(3)]
    held = _held({"stock": {u: 1.0 for u in units}, "candidate": {u: 1.3 + 0.02 * i for i, u in enumerate(units)}})
    result = lambda label: IntegrateResult(None, label, (), None, (), held, 1.0, held.speedup_vs_ar)  # noqa: E731
    lo, hi = result("candidate").final_vs_stock_interval
    assert 1.3 <= lo < held.final_vs_stock["candidate"] < hi <= 1.4
    assert result("stock").final_vs_stock_interval is None
