"""A full tune on a hybrid recurrent target: the `tune` flow on qwen3-next-tiny-cpu (CPU, random Qwen3-Next layout)
runs profile (kernel traces and cost curve of the hybrid runner), attribution (HybridShape's op costs), explore
(hybrid knobs), validation by token forcing on the hybrid runner (top-2 per position) and integration; plus the
runner interface token forcing and profiling build on (`fresh_runner`), for either family."""
from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specpilot.artifacts import audit_run, read_manifest, run_prefix, store_from_uri
from specpilot.bench.session import DeploymentSession
from specpilot.deployments import load_deployment
from specpilot.engines.family import TargetFamily, shape_from_dict, shape_to_dict
from specpilot.engines.hybrid import HybridRunner
from specpilot.engines.hybrid.config import QWEN3_NEXT_TINY
from specpilot.engines.runner import ModelRunner, chain_anc
from specpilot.engines.shapes import SMOLLM2_135M, OpClass
from specpilot.engines.target_runner import fresh_runner
from specpilot.memory import Memory
from specpilot.stages import catalog
from specpilot.stages.lossy import lossy_candidates
from specpilot.stages.validate import forced_pass, forced_runner, read_verdict, validate

DEPLOYMENT = "qwen3-next-tiny-cpu"
OVERRIDES = {"explore": {"trials": 8}}  # the CPU defaults otherwise (TuneSettings.for_deployment)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def session():
    return DeploymentSession(load_deployment(DEPLOYMENT), device="cpu")


def test_the_hybrid_runner_serves_top2_like_model_runner(session):
    stock = catalog.stock_candidate(session.deployment)
    engine = session.engine(stock.config, stock.drafter_label)
    runner = fresh_runner(engine.target, topk=2)
    assert isinstance(runner, HybridRunner) and runner is not engine.target and runner.model is engine.target.model
    assert runner.block_width == engine.target.block_width and runner.cfg == engine.target.cfg
    prompt = list(session.tokenize(list(session.deployment.workload.select().validate))[0].ids)
    first = runner.prefill(prompt)
    assert len(first.argmax) == len(first.topk_tokens) == 1 and first.topk_tokens[0][0] == first.argmax[0]
    chunk = prompt[:12]
    out = runner.verify(len(prompt), chunk, list(range(len(chunk))), chain_anc(len(chunk)))
    assert [t[0] for t in out.topk_tokens] == out.argmax and len(out.margin) == len(chunk)
    assert all(p[0] >= p[1] > 0 for p in out.topk_probs) and bool((out.margin >= 0).all())
    # Another runner serving more tokens per row agrees on the first two and on the margin between them.
    wide = fresh_runner(engine.target, topk=4)
    wide.prefill(prompt)
    again = wide.verify(len(prompt), chunk, list(range(len(chunk))), chain_anc(len(chunk)))
    assert again.argmax == out.argmax and [t[:2] for t in again.topk_tokens] == out.topk_tokens
    assert torch.equal(again.margin, out.margin)
    plain = fresh_runner(engine.target)  # topk=0: argmax and margin only, as the engine's own runner serves
    plain.prefill(prompt)
    bare = plain.verify(len(prompt), chunk, list(range(len(chunk))), chain_anc(len(chunk)))
    assert bare.topk_tokens is None and bare.argmax == out.argmax and torch.equal(bare.margin, out.margin)


def test_forced_pass_on_the_hybrid_target_reproduces_its_output_and_flags_a_changed_token(session):
    stock = catalog.stock_candidate(session.deployment)
    engine = session.engine(stock.config, stock.drafter_label)
    prompt = list(session.tokenize(list(session.deployment.workload.select().validate))[1].ids)
    max_new = 40  # longer than one verify block: the forced pass commits recurrent state between blocks
    output = engine.generate(prompt, max_new).tokens
    assert len(output) > engine.target.block_width
    runner = forced_runner(engine)
    assert isinstance(runner, HybridRunner)
    forced = forced_pass(runner, prompt, output, max_new)
    assert list(forced.argmax) == output and len(forced.margin) == len(forced.runner_up) == len(output)
    assert all(r != a for r, a in zip(forced.runner_up, forced.argmax))
    assert engine.generate(prompt, max_new).tokens == output  # the engine's own state was never touched
    changed = list(output)
    changed[20] = forced.runner_up[20]  # feed another token at 20: the argmax there still names the real one
    bent = forced_pass(runner, prompt, changed, max_new)
    assert bent.argmax[:21] == forced.argmax[:21] and bent.argmax[20] != changed[20]


def test_fresh_runner_keeps_the_llama_runner_for_llama_targets():
    from specpilot.engines.build import build_engine
    from specpilot.engines.config import EngineConfig
    from specpilot.engines.loader import random_model
    from specpilot.engines.shapes import LlamaShape
    shape = LlamaShape(vocab=256, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=8, intermediate=64,
                       rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
    engine = build_engine(EngineConfig(dtype="float32", max_seq_len=128), random_model(shape, torch.float32, "cpu"),
                          frozenset(), "cpu")
    runner = fresh_runner(engine.target, block_width=64, topk=2)
    assert type(runner) is ModelRunner and runner.block_width == 64 and runner.topk == 2
    assert runner.model is engine.target.model and runner.kv.data_ptr() != engine.target.kv.data_ptr()


def test_shapes_of_either_family_round_trip_and_price_their_ops():
    for shape in (QWEN3_NEXT_TINY, SMOLLM2_135M):
        assert shape_from_dict(json.loads(json.dumps(shape_to_dict(shape)))) == shape
    assert shape_to_dict(QWEN3_NEXT_TINY)["family"] == TargetFamily.HYBRID.value
    legacy = {k: v for k, v in shape_to_dict(SMOLLM2_135M).items() if k != "family"}  # shape.json before hybrids
    assert shape_from_dict(legacy) == SMOLLM2_135M
    one, many = QWEN3_NEXT_TINY.op_costs(1, 64), QWEN3_NEXT_TINY.op_costs(16, 64)
    for op in (OpClass.QKV, OpClass.ATTN, OpClass.O_PROJ, OpClass.GATE_UP, OpClass.DOWN, OpClass.LM_HEAD):
        assert 0 < one[op][0] < many[op][0] and 0 < one[op][1] <= many[op][1]
    # 16 rows read more experts than one token does, and share the weights they read (fewer bytes than 16x).
    assert one[OpClass.GATE_UP][1] < many[OpClass.GATE_UP][1] < 16 * one[OpClass.GATE_UP][1]
    assert one[OpClass.ATTN][1] < many[OpClass.ATTN][1] < 16 * one[OpClass.ATTN][1]  # the state moves once


@pytest.mark.prefect
def test_a_full_tune_of_the_hybrid_deployment(prefect_harness, tmp_path_factory):
    from specpilot.flows.report import TuneReport
    from specpilot.flows.tune import tune

    root = tmp_path_factory.mktemp("hybrid-tune")
    store_uri, memory = str(root / "store"), str(root / "memory.duckdb")
    report = TuneReport.from_dict(tune(DEPLOYMENT, rounds=1, gpus=1, store=store_uri, memory=memory,
                                       work_dir=str(root / "work"), overrides=OVERRIDES))
    assert report.deployment == DEPLOYMENT and len(report.rounds) == 1
    r = report.rounds[0]
    for factor in (r.tau_gap, r.kernel, r.overhead, r.total_gap):
        assert math.isfinite(factor) and factor > 0
    assert r.tried >= 3 and r.validated + r.rejected >= 1 and report.final_vs_ar >= report.stock_vs_ar

    store = store_from_uri(store_uri)
    prefix = run_prefix(report.run_id)
    audit = audit_run(store, prefix)
    assert audit.ok and audit.outputs_verified > 20

    def manifest(*parts: str):
        return read_manifest(store, "/".join((prefix, *parts, "manifest.json")))

    profile = manifest("profile", "round0")
    shape = json.loads(store.get_bytes(profile.output("shape.json").uri))
    assert shape_from_dict(shape) == QWEN3_NEXT_TINY
    kernels, steps = (pq.read_table(pa.BufferReader(store.get_bytes(profile.output(name).uri)))
                      for name in ("kernels.parquet", "steps.parquet"))
    assert kernels.num_rows > 0 and sum(kernels.column("device_s").to_pylist()) > 0 and steps.num_rows > 0
    attribution = json.loads(store.get_bytes(manifest("attribute", "round1").output("attribution.json").uri))
    assert attribution["kernel"]["factor"] > 0
    explore = manifest("explore", "round1", "dev0")
    measured = json.loads(store.get_bytes(explore.output("measurements.json").uri))
    mechanisms = {n for m in measured for n in m["candidate"]["mechanisms"]}
    assert mechanisms & {"hybrid_tree_verify", "hybrid_state_checkpoints"}

    validations = sorted((root / "work" / "validate" / "round1").iterdir())
    assert validations
    for out in validations:
        verdict = read_verdict(out)
        assert verdict.forced_by == "HybridRunner" and verdict.kind.value == "pass" and verdict.forced_flips == 0
        for row, margins in zip(verdict.prompts, verdict.margins):  # a margin per output position, both builds
            assert len(margins.stock) == len(margins.candidate) == row.stock_tokens > 0
        stored = manifest("validate", "round1", out.name)
        assert {"verdict.json", "ties.jsonl", "margins.jsonl", "candidate.json"} <= {o.name for o in stored.outputs}

    integrate = manifest("integrate", "round1").meta["summary"]
    build = read_manifest(store, integrate["build"]["manifest_uri"])
    assert build.output("engine_config.json").sha256 == integrate["build"]["config_sha256"]
    with Memory.open(memory, read_only=True) as mem:
        runs = mem.sql("SELECT deployment, status FROM runs WHERE run_id = ?", params=[report.run_id]).rows
    assert list(runs) == [(DEPLOYMENT, "succeeded")]


def test_token_forcing_rejects_a_lossy_candidate_on_the_hybrid_target(session):
    stock = catalog.stock_candidate(session.deployment)
    lossy = next(c for c in lossy_candidates(stock.config, stock.drafter_label)
                 if c.mechanisms == ("accept_without_verifying",))
    prompts = session.tokenize(list(session.deployment.workload.select().validate))[:2]
    verdict = validate(session, stock, lossy, prompts, 32, tie_epsilon=0.0)
    assert verdict.kind.value == "fail" and verdict.forced_by == "HybridRunner"
    assert verdict.first_divergence is not None and verdict.first_divergence.kind.value == "free_running"


def test_weight_transforming_policies_are_refused_on_hybrids():
    """A policy that rewrites weights would run with stock weights on a hybrid target and pass validation without
    its mechanism: the build refuses it by name instead."""
    from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig
    from specpilot.engines.hybrid.build import build_hybrid_engine
    from specpilot.engines.hybrid.config import HybridConfig
    from specpilot.engines.hybrid.model import random_hybrid_model
    from specpilot.engines.policy import EnginePolicy

    class Rounded(EnginePolicy):
        def transform_weights(self, model):
            return model
    model = random_hybrid_model(QWEN3_NEXT_TINY, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="Rounded transforms weights"):
        build_hybrid_engine(EngineConfig(drafter=DrafterKind.NONE, dtype="float32", cuda_graphs=False),
                            HybridConfig(), model, frozenset(), "cpu", policy=Rounded())
