"""`specpilot bench` end to end on a small deployment: AR and drafters, same prompts, all tokens equal."""
from __future__ import annotations

import json
import math

import pytest

from specpilot.bench.cli import main as bench_main
from specpilot.cli import build_parser


@pytest.fixture(scope="module")
def tiny_deployment(tmp_path_factory):
    from specpilot.testbed import fetch_smollm2, make_random_model
    root = tmp_path_factory.mktemp("bench")
    tok = fetch_smollm2()  # real tokenizer + chat template (cached after the first fetch)
    target = make_random_model("tiny", root / "target", seed=1, dtype="float32", tokenizer_dir=tok)
    draft = make_random_model("tiny", root / "draft", seed=2, dtype="float32", tokenizer_dir=tok)
    yaml = root / "tiny.yaml"
    yaml.write_text(f"""
name: tiny-cpu
target: {{path: {target}}}
drafters:
  - kind: ngram
    engine: {{draft_len: 3}}
  - kind: draft_model
    model: {{path: {draft}}}
device: {{kind: cpu}}
workload: {{benchmarks: [gsm8k, mbpp], prompts_per_benchmark: 1, max_new_tokens: 24, seed: 0}}
engine: {{dtype: float32, cuda_graphs: false, max_seq_len: 2048, token_tile: 8}}
""")
    return yaml


def test_bench_runs_ar_and_every_drafter_with_equal_tokens(tiny_deployment, tmp_path, capsys):
    rc = bench_main(["bench", "--deployment", str(tiny_deployment), "--json", "--out", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    spec = {"ngram{draft_len=3}", f"draft_model:{tiny_deployment.parent / 'draft'}"}  # labels carry overrides
    assert set(out["summary"]) == {"ar", "ar_fast"} | spec
    assert all(out["summary"][v]["all_match_ar"] for v in spec)
    reqs = out["requests"]
    assert len(reqs) == 2 * 4  # 2 prompts (gsm8k, mbpp) x (AR, fastest AR, 2 drafters), interleaved per prompt
    assert [r["variant"] for r in reqs[:4]] == ["ar", "ar_fast", *sorted(spec, key=lambda v: not v.startswith("ngram"))]
    for r in reqs:
        if r["variant"] in spec:  # against the faster AR mode, never more than against the exact one's time
            ar_times = [x["decode_s"] for x in reqs if x["prompt_id"] == r["prompt_id"] and x["variant"] in ("ar", "ar_fast")]
            assert r["speedup"] == pytest.approx(min(ar_times) / r["decode_s"])
    assert all(sum(r["shape_hist"].values()) == r["steps"] for r in reqs)  # steps by verify rows: AR's are 1 row
    assert {k for r in reqs if r["variant"] == "ar" for k in r["shape_hist"]} == {"1"}
    assert json.loads((tmp_path / "bench.json").read_text())["deployment"] == "tiny-cpu"
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_table_and_mode_ar(tiny_deployment, capsys):
    assert bench_main(["bench", "--deployment", str(tiny_deployment), "--mode", "ar", "--benchmarks", "gsm8k"]) == 0
    text = capsys.readouterr().out
    assert "| ar |" in text and "ngram" not in text


def test_cli_reports_bad_deployment_clearly(capsys):
    from specpilot.cli import main
    assert main(["bench", "--deployment", "no-such-deployment"]) == 2
    assert "unknown deployment 'no-such-deployment'" in capsys.readouterr().err


def test_every_subcommand_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"bench", "testbed", "memory", "audit"} <= set(sub.choices)
    for name, p in sub.choices.items():
        assert p.format_help().strip(), name


def test_block_drafter_deployment_runs_lossless(tmp_path, capsys):
    """A deployment listing a block drafter checkpoint: the session loads it and bench verifies every token."""
    import torch
    from specpilot.drafting.checkpoint import save_drafter
    from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
    from specpilot.engines.loader import load_model
    from specpilot.testbed import fetch_smollm2, make_random_model
    target_dir = make_random_model("tiny", tmp_path / "target", seed=3, dtype="float32", tokenizer_dir=fetch_smollm2())
    target = load_model(target_dir, torch.float32, "cpu")
    drafter = BlockDrafterModel(BlockDrafterConfig.for_target(target.shape, layers=1, block_size=4))
    save_drafter(drafter, tmp_path / "drafter", target)
    yaml = tmp_path / "block.yaml"
    yaml.write_text(f"""
name: tiny-block
target: {{path: {target_dir}}}
drafters:
  - kind: block
    model: {{path: {tmp_path / 'drafter'}}}
    engine: {{block_size: 4, verify: tree, tree_budget: 6, level_one_keep: 4}}
  - kind: block
    model: {{path: {tmp_path / 'drafter'}}}
    engine: {{block_size: 4, verify: tree, tree_budget: 6, level_one_keep: 4, position_ordered_attention: true}}
device: {{kind: cpu}}
workload: {{benchmarks: [gsm8k], prompts_per_benchmark: 1, max_new_tokens: 16, seed: 0}}
engine: {{dtype: float32, cuda_graphs: false, max_seq_len: 2048, token_tile: 8}}
""")
    assert bench_main(["bench", "--deployment", str(yaml), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    label = f"block:{tmp_path / 'drafter'}" + "{block_size=4,level_one_keep=4,tree_budget=6,verify=tree}"
    assert out["summary"][label]["all_match_ar"]
    # position-ordered attention changes AR's own bits on the torch backend: that variant is held to the AR
    # that has it (run alongside), the other to the deployment's AR
    ordered = label.replace("keep=4,", "keep=4,position_ordered_attention=True,")
    assert out["summary"][ordered]["all_match_ar"]
    refs = {r["variant"]: r["reference"] for r in out["requests"]}
    assert refs[label] == "ar" and refs[ordered] == "ar{position_ordered_attention=True}"


def test_the_tuning_loop_keeps_stock_ar_as_every_variants_reference(tmp_path):
    """run_bench's default (the stages' use): one reference for all, so no build may differ from stock's AR."""
    from specpilot.bench.harness import AR_LABEL, Variant, run_bench
    from specpilot.bench.session import DeploymentSession
    from specpilot.deployments import load_deployment
    from specpilot.engines.config import DrafterKind, EngineConfig
    from specpilot.testbed import fetch_smollm2, make_random_model
    target = make_random_model("tiny", tmp_path / "target", seed=4, dtype="float32", tokenizer_dir=fetch_smollm2())
    yaml = tmp_path / "d.yaml"
    yaml.write_text(f"""
name: tiny-ref
target: {{path: {target}}}
drafters: [{{kind: ngram}}]
device: {{kind: cpu}}
workload: {{benchmarks: [gsm8k], prompts_per_benchmark: 1, max_new_tokens: 8, seed: 0}}
engine: {{dtype: float32, cuda_graphs: false, max_seq_len: 512, token_tile: 8}}
""")
    session = DeploymentSession(load_deployment(yaml), device="cpu")
    prompts = session.tokenize(session.deployment.workload.select().validate[:1])
    base = EngineConfig(dtype="float32", cuda_graphs=False, max_seq_len=512, token_tile=8)
    variants = [Variant(AR_LABEL, base.replace(drafter=DrafterKind.NONE)),
                Variant("ordered", base.replace(position_ordered_attention=True))]
    for own, want in ((False, "ar"), (True, "ar{position_ordered_attention=True}")):
        report, _, _ = run_bench(session, prompts, variants, 8, progress=False, warmup=False, own_ar=own)
        assert {r.reference for r in report.requests if r.variant == "ordered"} == {want}


def test_reference_label_names_only_numerics_knobs():
    from specpilot.bench.harness import reference_label
    from specpilot.engines.config import DrafterKind, EngineConfig
    ar = EngineConfig(drafter=DrafterKind.NONE, token_tile=8)
    assert reference_label(ar, EngineConfig(token_tile=8, draft_len=9, verify="chain")) == "ar"
    assert reference_label(ar, EngineConfig(drafter="block", verify="tree", token_tile=8)) == "ar"
    assert reference_label(ar, EngineConfig(token_tile=16, dtype="float32")) == "ar{dtype=float32,token_tile=16}"


def test_report_names_a_stalled_request():
    """A request whose decode ran mostly outside its timed steps (session 14: a collection inside one request on the
    H200, 11 ms a step) is named in the table's notes; one with the usual few ms between steps is not."""
    from specpilot.bench.harness import BenchReport, RequestResult, format_report

    def request(prompt_id: str, decode_s: float, outside_ms: float) -> RequestResult:
        return RequestResult(benchmark="mbpp", prompt_id=prompt_id, variant="spec", prompt_tokens=95, new_tokens=99,
                             decode_s=decode_s, prefill_s=0.01, steps=45, stop_reason="eos", tokens_per_step=2.2,
                             step_hist={2: 45}, matches_ar=True, first_divergence=None, speedup=1.5, draft_ms=0.0,
                             verify_ms=0.98, outside_ms=outside_ms)

    report = BenchReport("dep", "cuda", 2048, ["spec"], [request("485", 0.495, 451.0), request("48", 0.045, 1.2),
                                                         request("1", 0.030, 40.0)])  # 40 ms: under STALL_MS
    text = format_report(report)
    assert "spec mbpp/485: STALL, 451 ms of its 495 ms decode" in text
    assert "mbpp/48:" not in text and "mbpp/1:" not in text
    assert [r.stalled for r in report.requests] == [True, False, False]
    assert report.to_dict()["requests"][0]["outside_ms"] == 451.0


@pytest.mark.parametrize("variant, label", [
    ("block:/work/x/drafting/shipped/smollm2-135m{ngram_prefix=True,verify=chain}",
     "block:smollm2-135m\n{ngram_prefix=True,verify=chain}"),
    ("draft_model:/tmp/draft/", "draft_model:draft"),  # a trailing slash still names the folder
    ("ngram{draft_len=3}", "ngram\n{draft_len=3}"),
    ("draft_model:smollm2-135m-l6", "draft_model:smollm2-135m-l6"),  # a testbed name, no path
    ("ar", "ar"),
    ("block:d{device_overlap=True,device_steps=1,device_tree=per_step,drafter_window=256,wide_tree_after=8}",
     "block:d\n{device_overlap=True,device_steps=1,\ndevice_tree=per_step,drafter_window=256,\nwide_tree_after=8}"),
])
def test_the_picture_names_a_variant_by_its_model_folder(variant, label):
    from specpilot.bench.plot import short_label
    assert short_label(variant) == label


def _requests(variant: str, speedups: dict[str, list[float]]):
    from specpilot.bench.harness import RequestResult
    return [RequestResult(benchmark=b, prompt_id=str(i), variant=variant, prompt_tokens=50, new_tokens=200,
                          decode_s=0.1 / s, prefill_s=0.01, steps=80, stop_reason="eos", tokens_per_step=2.5,
                          step_hist={2: 40, 3: 40}, matches_ar=True, first_divergence=None, speedup=s)
            for b, xs in speedups.items() for i, s in enumerate(xs)]


def test_the_overall_interval_resamples_within_each_benchmark():
    """Hand-built reports: equal speedups give a point; resampled within benchmarks, each benchmark weighs the same in
    every resample, so when each one's requests are equal the interval is a point too (unless a benchmark has a
    single request: then all are pooled); spread widens it, it holds the geometric mean, stays inside the speedups
    seen, and is the same on every call (seeded)."""
    from specpilot.bench.harness import BenchReport
    point = BenchReport("dep", "cuda", 256, ["s"], _requests("s", {"gsm8k": [2.0] * 4, "mbpp": [2.0] * 3}))
    lo, hi = point.geomean_interval("s")
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    strata = BenchReport("dep", "cuda", 256, ["s"], _requests("s", {"gsm8k": [1.0] * 2, "mbpp": [16.0] * 2}))
    lo, hi = strata.geomean_interval("s")
    assert lo == pytest.approx(4.0) and hi == pytest.approx(4.0)  # (0 + 0 + log 16 + log 16) / 4, in every resample
    # a benchmark of one request cannot be resampled within itself: every request is pooled, and the mean varies
    pooled = BenchReport("dep", "cuda", 256, ["s"], _requests("s", {"gsm8k": [1.0] * 3, "mbpp": [16.0]}))
    lo, hi = pooled.geomean_interval("s")
    assert lo < 1.99 < pooled.geomean("s") < 2.01 < hi
    assert BenchReport("dep", "cuda", 256, ["s"], _requests("s", {"gsm8k": [3.0]})).geomean_interval("s") is None
    spread = {"gsm8k": [1.2, 1.4, 9.0, 1.3], "humaneval": [2.0, 11.0, 1.5, 1.8]}
    wide = BenchReport("dep", "cuda", 256, ["s"], _requests("s", spread))
    narrow = BenchReport("dep", "cuda", 256, ["s"], _requests("s", {b: [1.5 + x / 100 for x in xs]
                                                                     for b, xs in spread.items()}))
    lo, hi = wide.geomean_interval("s")
    assert 1.2 < lo < wide.geomean("s") < hi < 11.0
    assert wide.geomean_interval("s") == (lo, hi)
    assert hi / lo > 1.5 > (lambda a, b: b / a)(*narrow.geomean_interval("s"))
    with pytest.raises(ValueError, match="level"):
        wide.geomean_interval("s", level=1.0)


def test_the_report_splits_each_variant_by_how_its_requests_stopped():
    import dataclasses

    from specpilot.bench.harness import BenchReport, format_report
    short = _requests("spec", {"gsm8k": [2.0, 8.0], "mbpp": [4.0]})
    long = [dataclasses.replace(r, stop_reason="max_tokens", tokens_per_step=12.0)
            for r in _requests("spec", {"gsm8k": [10.0, 10.0]})]
    report = BenchReport("dep", "cuda", 256, ["spec"], short + long)
    groups = report.by_stop("spec")
    assert groups["eos"] == {"requests": 3, "geomean_speedup": pytest.approx(4.0), "tokens_per_step": 2.5}
    assert groups["max_tokens"]["requests"] == 2 and groups["max_tokens"]["geomean_speedup"] == pytest.approx(10.0)
    assert report.to_dict()["summary"]["spec"]["by_stop"] == groups
    assert ("spec by stop: eos 3 requests 4.00x, 2.50 tokens/step; max_tokens 2 requests 10.00x, 12.00 tokens/step"
            in format_report(report))
    one_group = BenchReport("dep", "cuda", 256, ["spec"], short)
    assert "by stop" not in format_report(one_group)


def test_the_table_and_the_picture_show_the_interval(tmp_path):
    """The table's overall cell carries the interval (a variant without requests gets dashes), the saved summary holds
    it, and the picture draws it, also
    from a report saved before intervals existed (no key: a zero-width bar)."""
    pytest.importorskip("matplotlib")
    from specpilot.bench.harness import AR_LABEL, BenchReport, format_report
    from specpilot.bench.plot import plot_speedups
    report = BenchReport("dep", "cuda", 256, [AR_LABEL, "spec"],
                         _requests("spec", {"gsm8k": [1.5, 3.0, 2.0], "mbpp": [2.5, 1.8]}))
    lo, hi = report.geomean_interval("spec")
    text = format_report(report)
    assert f"| {report.geomean('spec'):.2f}x [{lo:.2f}-{hi:.2f}] | 2.50 | 0.25 | - | - | yes |" in text
    assert f"| {AR_LABEL} | - | - | - | - | - | - | - | yes |" in text  # a variant without requests: dashes
    saved = report.to_dict()
    assert saved["summary"]["spec"]["geomean_interval"] == (lo, hi)
    assert saved["summary"][AR_LABEL]["geomean_interval"] is None
    assert plot_speedups(saved, tmp_path / "now.png").stat().st_size > 0
    for s in saved["summary"].values():
        del s["geomean_interval"], s["interval_level"]
    assert plot_speedups(saved, tmp_path / "before.png").stat().st_size > 0


def test_the_one_geometric_mean_every_summary_uses():
    from specpilot.stats import geomean, geomean_of_runs
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and geomean([3.0]) == pytest.approx(3.0)
    assert geomean([]) == 0.0 and math.isnan(geomean((), empty=float("nan")))
    with pytest.raises(ValueError):  # a zero speedup is a run that did not happen, not a value to average
        geomean([2.0, 0.0])
    assert geomean_of_runs([0.0, 2.0, 8.0]) == pytest.approx(4.0) and geomean_of_runs([0.0]) == 0.0


def test_the_report_prices_each_verify_shape_from_its_requests():
    """decode ms = 0.8 a 16-row step + 1.0 a 32-row step + 1.9 a 128-row one + 0.3 a request: the least squares over
    the requests' step counts by shape give those costs back; too few requests, or shapes that always come together,
    give None."""
    import dataclasses

    from specpilot.bench.harness import BenchReport, format_report
    counts = [(40, 0, 0), (30, 5, 0), (20, 10, 4), (10, 3, 9), (50, 1, 1), (25, 20, 2), (5, 2, 30)]
    rs = [dataclasses.replace(r, decode_s=(0.8 * a + 1.0 * b + 1.9 * c + 0.3) / 1e3,
                              shape_hist={k: n for k, n in ((16, a), (32, b), (128, c)) if n})
          for r, (a, b, c) in zip(_requests("spec", {"gsm8k": [2.0] * len(counts)}), counts)]
    report = BenchReport("dep", "cuda", 256, ["spec"], rs)
    assert report.step_ms_by_rows("spec") == pytest.approx({16: 0.8, 32: 1.0, 128: 1.9})
    assert report.to_dict()["summary"]["spec"]["step_ms_by_verify_rows"] == pytest.approx({16: 0.8, 32: 1.0, 128: 1.9})
    assert "spec ms a step by verify rows (least squares over its requests): 16: 0.800, 32: 1.000, 128: 1.900" in (
        format_report(report))
    assert BenchReport("dep", "cuda", 256, ["spec"], rs[:4]).step_ms_by_rows("spec") is None
    together = [dataclasses.replace(r, shape_hist={16: n, 32: n}) for r, n in zip(rs, range(1, 8))]
    assert BenchReport("dep", "cuda", 256, ["spec"], together).step_ms_by_rows("spec") is None
