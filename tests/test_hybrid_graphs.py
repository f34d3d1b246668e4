"""The hybrid runner's CUDA-graph path: captured forwards (CUDA only) and, on CPU, the same static-buffer path
uncaptured (Triton interpreter) agree bit for bit with eager forwards; the GPU timing script runs end to end at
tiny shapes through the Triton kernels on a host without prefect, duckdb, boto3 or optuna."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()  # without it, the kernels run under the interpreter (tests/conftest.py)

from specpilot.engines.build import build_engine  # noqa: E402
from specpilot.engines.config import EngineConfig  # noqa: E402
from specpilot.engines.hybrid import GdnBackend, HybridConfig, HybridRunner  # noqa: E402
from specpilot.engines.hybrid.config import QWEN3_NEXT_TINY, LayerKind  # noqa: E402
from specpilot.engines.hybrid.model import random_hybrid_model  # noqa: E402
from specpilot.engines.layout import tree_anc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_hybrid_tree_vs_chain.py"
# One GDN layer (two value heads per key head) and one attention layer: interpreted kernels cost per program and row.
MICRO = dataclasses.replace(QWEN3_NEXT_TINY, layer_kinds=(LayerKind.LINEAR, LayerKind.FULL),
                            sparse_layers=(True, False), lin_k_heads=1, lin_v_heads=2)
TREE = [-1, 0, 0, 1, 1, 3, 2, 5, 6, 7, 4]  # 11 rows: two forwards of the 8-row tile, branches in both


pytestmark = pytest.mark.usefixtures("one_thread")


def varied_tiny(device: str, dtype: torch.dtype):
    """The tiny shape with weights large enough that greedy output varies (std-0.02 weights repeat a token)."""
    model = random_hybrid_model(MICRO, dtype, device, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(50.0 if "embed" in name else 10.0 if p.dim() >= 2 else 1.0)
    return model


def runner_pair(device: str, dtype: torch.dtype, spacing: int):
    model = varied_tiny(device, dtype)
    hybrid = HybridConfig(verify_tree=True, state_checkpoint_spacing=spacing, gdn_backend=GdnBackend.TRITON)
    make = lambda graphs: HybridRunner(model, EngineConfig(  # noqa: E731
        dtype="float32", max_seq_len=96, token_tile=8, cuda_graphs=graphs), hybrid, device, block_width=16)
    return model, make(True), make(False)


def check_agree(device: str, dtype: torch.dtype, spacing: int) -> HybridRunner:
    """Prefill, two tree verifies with partial commits, on both runners: every output and all state bitwise."""
    _, graphs, eager = runner_pair(device, dtype, spacing)
    assert graphs.graphs is not None and eager.graphs is None
    prompt = torch.randint(3, 512, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    assert graphs.prefill(prompt).argmax == eager.prefill(prompt).argmax
    depths = [0] * len(TREE)
    for i in range(1, len(TREE)):
        depths[i] = depths[TREE[i]] + 1
    base = len(prompt)
    for step, path in enumerate(([0, 1, 3, 5, 7], [0, 2, 6])):
        tokens = torch.randint(3, 512, (len(TREE),), generator=torch.Generator().manual_seed(step)).tolist()
        a, b = (r.verify(base, tokens, depths, tree_anc(TREE)) for r in (graphs, eager))
        assert a.argmax == b.argmax and torch.equal(a.margin, b.margin)
        graphs.replay_verify()  # re-running the device work changes nothing a commit reads
        for r in (graphs, eager):
            r.compact(base, path)
        assert torch.equal(graphs.rec.state, eager.rec.state) and torch.equal(graphs.rec.conv, eager.rec.conv)
        assert torch.equal(graphs.kv[..., :base + len(path), :], eager.kv[..., :base + len(path), :])
        base += len(path)
    return graphs


@pytest.mark.parametrize("spacing", [1, 3])
def test_static_buffer_path_equals_eager_on_cpu(spacing):
    """Without CUDA the graphs' static buffers and padded scans run uncaptured: the same inputs a graph replays."""
    graphs = check_agree("cuda" if CUDA else "cpu", torch.float32, spacing)
    assert bool(graphs.graphs.captured) == CUDA


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager_and_speculation_equals_ar(dtype):
    graphs = check_agree("cuda", dtype, spacing=2)
    assert (8, 0) in graphs.graphs.captured and (8, 8) in graphs.graphs.captured  # both forwards of a block
    model = varied_tiny("cuda", dtype)
    p = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    c = EngineConfig(dtype="float32", max_seq_len=128, token_tile=8, kernel_backend="triton")
    ar = build_engine(c.replace(drafter="none", cuda_graphs=False), model, frozenset(), "cuda").generate(p, 24)
    for verify in ("chain", "tree"):
        spec = build_engine(c.replace(verify=verify, state_checkpoint_spacing=2), model, frozenset(), "cuda")
        assert spec.target.graphs is not None and spec.generate(p, 24).tokens == ar.tokens, verify


def test_gpu_script_runs_at_tiny_shapes_without_the_orchestration_packages(tmp_path):
    """--tiny: CPU, Triton interpreter, every code path of the H200 run (graphs' static buffers, two forwards per
    block, checkpoint replays at spacing 4); prefect, duckdb, boto3 and optuna made unimportable, as on the host."""
    blocker = (
        "import runpy, sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'prefect', 'duckdb', 'boto3', 'optuna'}:\n"
        "            raise ImportError(f'{name} is not installed on the GPU host')\n"
        "sys.meta_path.insert(0, Absent())\n"
        f"sys.argv = [{str(SCRIPT)!r}, '--tiny', '--spacings', '1,4', '--iters', '1', {str(tmp_path / 'r.json')!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", blocker], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["status"] == "ok" and r["env"]["interpreted"] and set(r["ratios"]) == {"s1", "s4"}
    assert len(r["cases"]) == 6 and all(c["forwards"] == 2 and c["rows"] == 17 for c in r["cases"].values())
    for ratio in r["ratios"].values():
        assert ratio["main_path_tokens_equal_chain"] and ratio["main_path_margins_bitwise_equal_chain"]
        assert ratio["tree_vs_chain"] > 0 and ratio["tree_vs_chain_scan"] > 0
    cases = r["cases"]
    assert all(c["state_bytes"] >= c["floor_bytes"] > 0 for c in cases.values())
    assert cases["tree@s1"]["resumed_states"] == cases["chain@s1"]["resumed_states"]  # depth-first: like a chain
    assert cases["tree_drafter_order@s1"]["resumed_states"] > cases["tree@s1"]["resumed_states"]
    assert cases["chain@s4"]["stored_states"] < cases["chain@s1"]["stored_states"]
    assert r["meets_target"] == (r["ratio_tree_vs_chain"] <= 1.3)
    assert proc.stdout.strip().splitlines()[-1].startswith("tree/chain = ")  # the table is printed last
