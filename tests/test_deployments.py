"""Deployments: the shipped YAML files load, bad files give errors naming the file and field, fingerprints."""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import yaml

from specpilot.deployments import (DEPLOYMENTS_DIR, Arrival, Deployment, DeploymentError, DeviceKind, ModelRef, ModelRefKind,
                                   RegimeKind, engine_code_version, list_deployments, load_deployment,
                                   model_fingerprint, resolve_model)
from specpilot.engines.config import DrafterKind, DType
from specpilot.kernels.table import LaunchTable
from specpilot.testbed import ModelDirError, TINY, make_random_model
from specpilot.workload import Benchmark

SHIPPED = ["llama8b-shape-h200", "micro-batch-cpu", "qwen3-next-80b-layers-h200", "qwen3-next-tiny-cpu",
           "smollm2-135m-batch-h200", "smollm2-135m-block-cpu", "smollm2-135m-cpu", "smollm2-135m-h200",
           "smollm2-shape-h200"]
FP32 = ("micro-batch-cpu", "qwen3-next-tiny-cpu")  # the CPU development targets of random weights


def test_the_shipped_deployments_load():
    assert list_deployments() == SHIPPED
    for name in SHIPPED:
        dep = load_deployment(name)
        assert dep.name == name and dep.source == DEPLOYMENTS_DIR / f"{name}.yaml"
        assert dep.engine.dtype is (DType.FP32 if name in FP32 else DType.BF16)
        assert set(dep.workload.benchmarks) == set(Benchmark)
        assert load_deployment(DEPLOYMENTS_DIR / f"{name}.yaml") == dep  # by path too
        assert Deployment.from_dict(dep.to_dict()) == dep  # to_dict round-trips


def test_shipped_deployment_settings():
    cpu, h200, llama = (load_deployment(n) for n in ("smollm2-135m-cpu", "smollm2-135m-h200", "llama8b-shape-h200"))
    # Llama-3-8B's verify of 16 tokens reads keys in 32-row attention tiles at 2 warps; one token keeps 16 rows at
    # the default 4 warps (T-neutral either way)
    table = LaunchTable(llama.engine.kernel_table)
    assert [table.get("attention", 4096, 1024, t).get("tile_rows") for t in (1, 5, 16)] == [16, 16, 32]
    assert [table.get("attention", 4096, 1024, t).get("num_warps", 4) for t in (1, 16)] == [4, 2]
    # its projections' K chunks hold at every token count the batched engine runs (a reduction order)
    for kernel, n, k, block_k in (("qkv", 6144, 4096, 256), ("o_proj", 4096, 4096, 256), ("down", 4096, 14336, 512)):
        assert {table.get(kernel, n, k, t)["block_k"] for t in (1, 6, 16, 32, 144)} == {block_k}, kernel
    assert cpu.device.kind is DeviceKind.CPU and not cpu.engine.cuda_graphs
    assert (cpu.workload.max_new_tokens, cpu.workload.prompts_per_benchmark) == (64, 2)
    assert cpu.target == ModelRef(ModelRefKind.TESTBED, "smollm2-135m")
    assert [d.kind for d in cpu.drafters] == [DrafterKind.NGRAM, DrafterKind.DRAFT_MODEL]
    assert cpu.drafters[1].model == ModelRef(ModelRefKind.TESTBED, "smollm2-135m-l6")
    assert (h200.device.kind, h200.device.gpu, h200.device.count) == (DeviceKind.CUDA, "H200", 1)
    assert h200.workload.max_new_tokens == 2048
    # the real SmolLM2's Triton table: producer statistics for QKV, gate_up and the LM head at every token count
    real = LaunchTable(h200.engine.kernel_table)
    for kernel, n in (("qkv", 960), ("gate_up", 3072), ("lm_head", 49152)):
        assert all(real.get(kernel, n, 576, t).get("producer_stat") for t in (1, 6, 16)), kernel
    assert llama.target == ModelRef(ModelRefKind.RANDOM, "llama3-8b", 0)
    assert llama.regime.kind is RegimeKind.BATCH and llama.regime.concurrency == (16, 20, 24)
    assert llama.regime.arrival is Arrival.ALL and llama.regime.label == "batch16-20-24" and llama.batched
    batch = load_deployment("smollm2-135m-batch-h200")
    assert batch.batched and batch.regime.label == "batch16-20-24" and batch.target == cpu.target
    assert batch.engine.kernel_backend.value == "triton" and batch.workload.max_new_tokens == 2048
    micro = load_deployment("micro-batch-cpu")
    assert micro.batched and micro.regime.concurrency == (2, 3) and micro.engine.kernel_backend.value == "triton"
    assert micro.device.kind is DeviceKind.CPU and not cpu.batched and cpu.regime.label == "batch1"
    configs = cpu.drafter_configs()
    assert configs["draft_model:smollm2-135m-l6"].drafter is DrafterKind.DRAFT_MODEL
    assert cpu.ar_config().drafter is DrafterKind.NONE and cpu.ar_config().dtype is DType.BF16


def _base() -> dict:
    return yaml.safe_load((DEPLOYMENTS_DIR / "smollm2-135m-cpu.yaml").read_text())


BAD = [
    ("engine.draft_len", lambda d: d["engine"].update(draft_len=0)),
    ("engine.bogus", lambda d: d["engine"].update(bogus=1)),
    ("engine.dtype", lambda d: d["engine"].update(dtype="int8")),
    ("engine.cuda_graphs", lambda d: d["engine"].update(cuda_graphs=True)),
    ("engine.drafter", lambda d: d["engine"].update(drafter="ngram")),
    ("drafters[0].kind", lambda d: d["drafters"][0].update(kind="medusa")),
    ("drafters[0].kind", lambda d: d["drafters"][0].update(kind="none")),
    ("drafters[0].engine.draft_len", lambda d: d["drafters"][0].update(engine={"draft_len": 100})),
    ("drafters[0].model", lambda d: d["drafters"][0].update(model={"testbed": "smollm2-135m-l6"})),
    ("drafters[1].model", lambda d: d["drafters"][1].pop("model")),
    ("drafters[1].model.testbed", lambda d: d["drafters"][1]["model"].update(testbed="smollm2-135m-l99")),
    ("drafters[2]", lambda d: d["drafters"].append(copy.deepcopy(d["drafters"][1]))),
    ("drafters", lambda d: d.update(drafters=[])),
    ("target.random", lambda d: d.update(target={"random": "gpt5"})),
    ("target.seed", lambda d: d.update(target={"random": "tiny", "seed": -1})),
    ("target.seed", lambda d: d.update(target={"testbed": "smollm2-135m", "seed": 3})),
    ("target", lambda d: d.update(target={"path": "x", "testbed": "smollm2-135m"})),
    ("device.kind", lambda d: d.update(device={"kind": "tpu"})),
    ("device.gpu", lambda d: d.update(device={"kind": "cuda"})),
    ("device.count", lambda d: d.update(device={"kind": "cuda", "gpu": "H200", "count": 0})),
    ("regime.concurrency", lambda d: d.update(regime={"kind": "batch"})),
    ("regime.concurrency", lambda d: d.update(regime={"kind": "single", "concurrency": [4]})),
    ("workload.benchmarks", lambda d: d["workload"].update(benchmarks=["gsm8k", "aime"])),
    ("workload.tune_fraction", lambda d: d["workload"].update(tune_fraction=0.7)),
    ("workload.max_new_tokens", lambda d: d["workload"].pop("max_new_tokens")),
    ("workload.max_new_tokens", lambda d: d["workload"].update(max_new_tokens=5000)),
    ("workload.prompts_per_benchmark", lambda d: d["workload"].update(prompts_per_benchmark=41)),
    ("workload.seed", lambda d: d["workload"].update(seed="zero")),
    ("extra", lambda d: d.update(extra=1)),
    ("name", lambda d: d.pop("name")),
    ("name", lambda d: d.update(name="Has Spaces")),
]



def _load_error(tmp_path, data) -> tuple[DeploymentError, object]:
    """Write `data` as a deployment YAML and return (the DeploymentError loading it raises, its path)."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DeploymentError) as info:
        load_deployment(path)
    return info.value, path


@pytest.mark.parametrize("field,mutate", BAD, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD)])
def test_bad_yaml_errors_name_the_file_and_field(tmp_path, field, mutate):
    data = _base()
    mutate(data)
    error, path = _load_error(tmp_path, data)
    assert error.field == field, str(error)
    assert str(error).startswith(f"{path}: {field}: ")


BAD_BATCH = [  # mutations of the batch-regime deployment micro-batch-cpu
    ("regime.arrival", lambda d: d["regime"].update(arrival="bursty")),
    ("regime.rate", lambda d: d["regime"].update(rate=4.0)),  # a rate paces poisson arrivals only
    ("regime.rate", lambda d: d["regime"].update(arrival="poisson", rate=-1)),
    ("regime.concurrency", lambda d: d["regime"].update(concurrency=[2, 2])),
    ("regime.concurrency", lambda d: d["regime"].update(concurrency=[1])),
    ("regime.arrival", lambda d: d.update(regime={"kind": "single", "arrival": "all"})),
    ("regime.extra", lambda d: d["regime"].update(extra=1)),
    ("engine.kernel_backend", lambda d: d["engine"].update(kernel_backend="torch")),
    ("drafters[0].engine.verify", lambda d: d["drafters"][0].update(engine={"verify": "tree"})),
    ("drafters[1].kind", lambda d: d["drafters"].append({"kind": "draft_model", "model": {"testbed": "smollm2-135m-l6"}})),
    ("regime.kind", lambda d: d.update(target={"random": "qwen3-next-tiny", "seed": 0})),
]


@pytest.mark.parametrize("field,mutate", BAD_BATCH, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_BATCH)])
def test_bad_batch_regimes_name_the_field(tmp_path, field, mutate):
    data = yaml.safe_load((DEPLOYMENTS_DIR / "micro-batch-cpu.yaml").read_text())
    mutate(data)
    error, _ = _load_error(tmp_path, data)
    assert error.field == field, str(error)


def test_batch_regime_arrivals_round_trip(tmp_path):
    data = yaml.safe_load((DEPLOYMENTS_DIR / "micro-batch-cpu.yaml").read_text())
    data["regime"].update(arrival="poisson", rate=6)
    path = tmp_path / "poisson.yaml"
    path.write_text(yaml.safe_dump(data))
    dep = load_deployment(path)
    assert dep.regime.arrival is Arrival.POISSON and dep.regime.rate == 6.0 and dep.regime.label == "batch2-3-poisson@6"
    assert Deployment.from_dict(dep.to_dict()) == dep
    assert dep.fingerprint_digest() != load_deployment("micro-batch-cpu").fingerprint_digest()


def test_unloadable_files_and_unknown_names(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(DeploymentError, match=rf"{path}: invalid YAML"):
        load_deployment(path)
    path.write_text("- a list\n")
    with pytest.raises(DeploymentError, match="expected a mapping at the top level"):
        load_deployment(path)
    with pytest.raises(DeploymentError, match=r"unknown deployment 'nope'; shipped: \['llama8b-shape-h200'"):
        load_deployment("nope")
    with pytest.raises(DeploymentError, match="does not exist"):
        load_deployment(tmp_path / "missing.yaml")


def test_path_refs_resolve_relative_to_the_yaml_and_fingerprint_by_file_hash(tmp_path):
    model = make_random_model(TINY, tmp_path / "models" / "tiny", seed=5)
    data = _base()
    data.update(name="local", target={"path": "models/tiny"}, drafters=[{"kind": "ngram"}])
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(data))
    dep = load_deployment(tmp_path / "local.yaml")
    assert dep.target.value == str(model.resolve())
    with pytest.raises(ModelDirError, match="has no tokenizer"):
        resolve_model(dep.target)  # the engine needs a tokenizer for a path target
    (model / "tokenizer.json").write_text('{"model": {"type": "WordLevel", "vocab": {"a": 0}}}')
    assert resolve_model(dep.target) == model.resolve()
    fp = model_fingerprint(dep.target)
    assert fp["config_sha256"] == hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    digest = dep.fingerprint_digest()
    (model / "config.json").write_text((model / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert dep.fingerprint_digest() != digest  # a changed model changes the fingerprint


def test_random_targets_resolve_to_none_and_fingerprint_by_seed():
    dep = load_deployment("llama8b-shape-h200")
    assert resolve_model(dep.target) is None
    fp = dep.fingerprint()
    assert fp["target"] == {"random": "llama3-8b", "seed": 0}
    assert fp["device"] == {"kind": "cuda", "gpu": "H200", "count": 1}
    assert fp["engine_code"] == engine_code_version() and len(fp["engine_code"]["sources_sha256"]) == 16
    assert fp == dep.fingerprint()
    changed = Deployment.from_dict({**dep.to_dict(), "target": {"random": "llama3-8b", "seed": 1}})
    assert changed.fingerprint_digest() != dep.fingerprint_digest()
    assert fp["engine_config"] == dep.engine.digest() != load_deployment("smollm2-135m-cpu").engine.digest()


def test_deployment_rejects_inconsistent_values_on_construction():
    dep = load_deployment("smollm2-135m-cpu")
    with pytest.raises(DeploymentError, match="engine.compile"):
        Deployment(**{**{f: getattr(dep, f) for f in ("name", "target", "drafters", "device", "workload", "regime")},
                      "engine": dep.engine.replace(compile=True)})
    with pytest.raises(DeploymentError, match="drafters"):
        Deployment(name="x", target=dep.target, drafters=(), device=dep.device, workload=dep.workload)


@pytest.mark.slow
def test_testbed_refs_resolve_to_model_dirs():
    dep = load_deployment("smollm2-135m-cpu")
    target, draft = resolve_model(dep.target), resolve_model(dep.drafters[1].model)
    assert isinstance(target, Path) and (target / "model.safetensors").is_file()
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    fp = dep.fingerprint()
    assert fp["target"]["testbed"] == "smollm2-135m" and fp["drafters"][1]["model"]["testbed"] == "smollm2-135m-l6"
