"""The Prefect `tune` flow end to end under Prefect's test harness, the memory-first second tune, the nightly
plan, and the `specpilot tune` command's wiring."""
from __future__ import annotations

import json
import math

import pytest

from specpilot.artifacts import read_manifest, store_from_uri
from specpilot.memory import Memory

pytestmark = pytest.mark.prefect
# Small enough for two cores; two bench runs per batch keep one preempted request from deciding a trial.
OVERRIDES = {"explore": {"max_new_tokens": 32, "trials": 3, "batch": 3, "repeats": 2}}


@pytest.fixture(scope="module")
def tuned(prefect_harness, tiny_deployment, tiny_deployment_b, tmp_path_factory):
    """tiny-a tuned from an empty memory, then tiny-b (another model) tuned with what tiny-a proved.

    The engine-code part of deployment fingerprints is pinned for this module: engines/ and kernels/ are edited
    in this working tree while tests run, and the nightly test needs "unchanged" to mean unchanged."""
    import specpilot.deployments
    from specpilot.flows.report import TuneReport
    from specpilot.flows.tune import tune

    code = specpilot.deployments.engine_code_version()
    root = tmp_path_factory.mktemp("flow")
    kwargs = {"rounds": 1, "gpus": 1, "store": str(root / "store"), "memory": str(root / "memory.duckdb"),
              "work_dir": str(root / "work"), "overrides": OVERRIDES}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specpilot.deployments, "engine_code_version", lambda: code)
        first = TuneReport.from_dict(tune(str(tiny_deployment), **kwargs))
        second = TuneReport.from_dict(tune(str(tiny_deployment_b), **kwargs))
        yield {"first": first, "second": second, **kwargs}


def test_tune_reports_three_factors_and_never_loses_to_stock(tuned):
    report = tuned["first"]
    assert report.deployment == "tiny-a" and len(report.rounds) == 1
    r = report.rounds[0]
    for factor in (r.tau_gap, r.kernel, r.overhead, r.total_gap):
        assert math.isfinite(factor) and factor > 0
    assert r.total_gap == pytest.approx(r.tau_gap * r.kernel * r.overhead)
    assert r.tried >= 3 and r.memory_first == () and r.validated + r.rejected >= 1
    assert report.final_vs_ar >= report.stock_vs_ar  # the held-out comparison that chose the final build
    assert report.final_is_stock == (report.final_build == "stock")
    table = report.table()
    for column in ("tau gap (1/tau)", "kernel factor", "overhead factor", "vs stock", "vs AR", "Held-out"):
        assert column in table
    if report.final_is_stock:  # the interval of a build over itself says nothing
        assert report.final_vs_stock_interval is None and "paired interval" not in table
    elif report.final_vs_stock_interval is not None:  # None: a single held-out request
        lo, hi = report.final_vs_stock_interval
        assert lo <= report.final_vs_stock <= hi and f"paired interval {lo:.3f}-{hi:.3f}x" in table


def test_memory_holds_a_validated_mechanism_with_scope_and_evidence(tuned):
    with Memory.open(tuned["memory"], read_only=True) as memory:
        rows = memory.sql(
            "SELECT m.name, m.config_delta, s.model, s.drafter, s.gpu, e.metric, e.after, e.verdict, e.artifact_uris "
            "FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id "
            "WHERE e.verdict = 'pass' AND e.run_id = ?", params=[tuned["first"].run_id]).rows
        runs = memory.sql("SELECT deployment, status FROM runs ORDER BY started").rows
    assert rows, "tiny-a's longer n-gram drafts must be proven and recorded"
    assert all(row[2] == "model-a" and row[3] == "ngram" and row[4].startswith("cpu:") for row in rows)
    assert any(json.loads(row[1]).get("draft_len", 0) > 5 for row in rows)
    store = store_from_uri(tuned["store"])
    for row in rows:  # evidence points at the stage manifests that measured it
        assert all(store.exists(uri) for uri in json.loads(row[8]))
    assert list(runs) == [("tiny-a", "succeeded"), ("tiny-b", "succeeded")]


def test_second_deployment_starts_from_memory(tuned):
    second = tuned["second"]
    assert second.rounds[0].memory_first, "tiny-b's explore must try tiny-a's proven mechanisms first"
    assert "memory-r1-d0-0" in second.table()
    store = store_from_uri(tuned["store"])
    explore = read_manifest(store, f"runs/{second.run_id}/explore/round1/dev0/manifest.json")
    measured = json.loads(store.get_bytes(explore.output("measurements.json").uri))
    sources = [m["candidate"]["source"] for m in measured]
    assert sources[:len(second.rounds[0].memory_first)] == ["memory"] * len(second.rounds[0].memory_first)
    assert measured[0]["batch"] == 0


def test_prefect_artifacts_describe_the_run(tuned):
    from prefect.artifacts import Artifact

    summary = Artifact.get("tiny-a-tune-summary")
    assert summary is not None and "kernel factor" in summary.data
    attribution = Artifact.get("tiny-a-attribution-r1")
    assert attribution is not None and "attribution.png" in attribution.data and "file://" in attribution.data
    assert Artifact.get("tiny-a-candidates-r1") is not None
    assert Artifact.get("tiny-a-integrate-round1").data.endswith("/integrate/round1/manifest.json)")  # a link


def test_explore_tasks_are_pinned_one_per_device_and_timed(tuned):
    from datetime import datetime

    from prefect.artifacts import Artifact
    from specpilot.deployments import load_deployment
    from specpilot.flows.tune import devices_for

    assert devices_for(load_deployment("smollm2-135m-h200"), 2) == ["cuda:0", "cuda:1"]  # one task per GPU
    store = store_from_uri(tuned["store"])
    explore = read_manifest(store, f"runs/{tuned['first'].run_id}/explore/round1/dev0/manifest.json")
    timing = explore.meta["timing"]
    assert timing["device"] == explore.meta["request"]["device"] == "cpu"
    assert datetime.fromisoformat(timing["started"]) <= datetime.fromisoformat(timing["finished"]) <= explore.created
    timeline = Artifact.get("tiny-a-explore-timeline-r1")
    assert timeline is not None and "explore-round1-dev0" in timeline.data and timing["started"] in timeline.data


def test_nightly_skips_unchanged_and_retunes_changed(tuned, tiny_root):
    from conftest import write_deployment
    from specpilot.flows.nightly import plan_nightly

    (tiny_root / "changed").mkdir(exist_ok=True)
    changed = write_deployment(tiny_root / "changed", "tiny-a", tiny_root / "model-a", max_new_tokens=24)
    plan = plan_nightly([str(tiny_root / "tiny-a.yaml"), str(changed)], tuned["memory"])
    assert [(d.name, d.retune) for d in plan] == [("tiny-a", False), ("tiny-a", True)]
    assert "unchanged" in plan[0].reason and "fingerprint changed" in plan[1].reason


def test_tune_command_is_registered_with_its_options():
    from specpilot.stages.cli import register_cli
    import argparse

    parser = argparse.ArgumentParser(prog="specpilot")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tune", "--deployment", "smollm2-135m-cpu", "--rounds", "2", "--gpus", "1",
                              "--store", "/tmp/s", "--memory", "/tmp/m.duckdb", "--set", "explore.trials=4"])
    assert (args.deployment, args.rounds, args.gpus, args.store, args.memory, args.set) == (
        "smollm2-135m-cpu", 2, 1, "/tmp/s", "/tmp/m.duckdb", ["explore.trials=4"])
    stage = parser.parse_args(["stage", "explore", "--in", "r.json", "--out", "d"])
    assert (stage.name, stage.request, stage.out) == ("explore", "r.json", "d")


def test_tune_command_refuses_bad_arguments_before_the_flow_starts(monkeypatch, capsys, tmp_path):
    import specpilot.flows.tune as flows_tune
    from specpilot.cli import main

    def started(**kwargs):
        raise AssertionError("the flow started")
    monkeypatch.setattr(flows_tune, "tune", started)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {testbed: smollm2-135m}\n")
    cases = [(["--deployment", "nope"], "unknown deployment 'nope'"),
             (["--deployment", str(bad)], "drafters: missing"),
             (["--deployment", "smollm2-135m-cpu", "--rounds", "0"], "rounds=0"),
             (["--deployment", "smollm2-135m-cpu", "--gpus", "2"], "runs on cpu"),
             (["--deployment", "smollm2-135m-cpu", "--set", "explore.nosuch=1"], "unknown explore setting"),
             (["--deployment", "smollm2-135m-cpu", "--store", "ftp://host/x"], "ftp"),
             (["--deployment", "smollm2-135m-cpu", "--store", "s3://runs/p?endpoint=http://127.0.0.1:9"],
              "cannot reach S3 endpoint http://127.0.0.1:9")]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    for argv, message in cases:
        assert main(["tune", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("specpilot: error: ") and message in err, (argv, err)
