"""Hybrid recurrent targets through the normal entry points: family dispatch (loader, build_engine), the shipped
hybrid deployments, `specpilot bench` on the tiny one (CPU), the hybrid knobs (EngineConfig -> HybridConfig,
validation, trees grown from a drafter's alternatives), and the explorer proposing hybrid knobs for a hybrid
deployment and not for a Llama one."""
from __future__ import annotations

import json

import pytest
import torch

from specpilot.costmodel.attribution import Direction, DirectionName
from specpilot.deployments import DeploymentError, load_deployment
from specpilot.engines.build import build_engine
from specpilot.engines.config import ConfigError, EngineConfig, VerifyMode
from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.hybrid import GdnBackend, HybridConfig, HybridModel, HybridRunner
from specpilot.engines.hybrid.build import with_alternatives
from specpilot.engines.hybrid.config import QWEN3_NEXT_80B, QWEN3_NEXT_80B_LAYERS, QWEN3_NEXT_TINY
from specpilot.engines.hybrid.model import random_hybrid_model
from specpilot.engines.llama import LlamaModel
from specpilot.engines.loader import random_model, save_model
from specpilot.engines.shapes import LlamaShape, UnsupportedModelError
from specpilot.engines.targets import TargetFamily, load_target, read_target_shape

HYBRID_MECHANISMS = {"hybrid_tree_verify", "hybrid_state_checkpoints"}
HYBRID_FIELDS = {"state_checkpoint_spacing": 1, "tree_dfs_order": True, "verify": "chain"}  # stock values
SMALL_LLAMA = LlamaShape(vocab=512, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64,
                         rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def varied_tiny(seed: int = 0) -> HybridModel:
    """The tiny shape with weights large enough that greedy output varies (std-0.02 weights repeat a token)."""
    model = random_hybrid_model(QWEN3_NEXT_TINY, torch.float32, "cpu", seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(50.0 if "embed" in name else 10.0 if p.dim() >= 2 else 1.0)
    return model


def cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "max_seq_len": 128, "token_tile": 8, "cuda_graphs": False, **kw})


def test_family_dispatch_loads_and_builds_either_family(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
        num_hidden_layers=2, full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16))
    hf.save_pretrained(tmp_path / "hybrid")
    hybrid = load_target(tmp_path / "hybrid", torch.float32, "cpu")
    assert isinstance(hybrid, HybridModel) and read_target_shape(tmp_path / "hybrid").model_type == "qwen3_next"
    llama = load_target(save_model(random_model(SMALL_LLAMA, torch.float32, "cpu"), tmp_path / "llama"),
                        torch.float32, "cpu")
    assert isinstance(llama, LlamaModel) and TargetFamily.of_shape(llama.shape) is TargetFamily.LLAMA
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported.*llama.*qwen3_next"):
        load_target(tmp_path / "mamba", torch.float32, "cpu")
    # build_engine dispatches on the model: the hybrid runner, knobs from the EngineConfig
    engine = build_engine(cfg(drafter="ngram", state_checkpoint_spacing=3, tree_dfs_order=False), hybrid, frozenset(),
                          "cpu")
    assert isinstance(engine.target, HybridRunner) and engine.target.hybrid == HybridConfig(
        verify_tree=False, state_checkpoint_spacing=3, dfs_order=False, gdn_backend=GdnBackend.REFERENCE)
    with pytest.raises(ConfigError, match="block"):
        build_engine(cfg(drafter="block"), hybrid, frozenset(), "cpu")
    with pytest.raises(ConfigError, match="two_level"):
        build_engine(cfg(drafter="ngram", verify="two_level"), hybrid, frozenset(), "cpu")


def test_hybrid_knobs_are_engine_config_fields_validated_on_construction():
    for bad, match in ((dict(state_checkpoint_spacing=0), "state_checkpoint_spacing"),
                       (dict(state_checkpoint_spacing=True), "state_checkpoint_spacing"),
                       (dict(state_checkpoint_spacing=65), "1..64"), (dict(tree_dfs_order=1), "tree_dfs_order")):
        with pytest.raises(ConfigError, match=match):
            EngineConfig(**bad)
    tree = HybridConfig.from_engine(EngineConfig(verify="tree", kernel_backend="triton", state_checkpoint_spacing=4))
    assert tree == HybridConfig(verify_tree=True, state_checkpoint_spacing=4, gdn_backend=GdnBackend.TRITON)
    assert HybridConfig.from_engine(EngineConfig()) == HybridConfig(verify_tree=False)
    assert QWEN3_NEXT_80B_LAYERS.layer_kinds == QWEN3_NEXT_80B.layer_kinds[:8]
    assert len(QWEN3_NEXT_80B_LAYERS.gdn_layers) == 6
    with pytest.raises(ValueError, match="layers=49"):
        QWEN3_NEXT_80B.first_layers(49)


def test_chain_grows_into_a_tree_of_its_own_alternatives():
    chain = DraftTree.chain([10, 11, 12], [0.6, 0.3, 0.2], topk_tokens=[[10, 20, 21], [30, 11, 31], [12, 40]],
                            topk_probs=[[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.1]])
    tree = with_alternatives(chain, budget=6, width=2)  # one alternative per depth at most, 3 extra nodes
    assert tree.tokens == [10, 11, 12, 20, 30, 40] and tree.parents == [-1, 0, 1, -1, 0, 1]
    assert tree.scores[3:] == pytest.approx([0.3, 0.6 * 0.5, 0.6 * 0.4 * 0.1])
    best = with_alternatives(chain, budget=5, width=3)  # the two best-scoring alternatives of all depths
    assert best.tokens == [10, 11, 12, 20, 30] and best.parents == [-1, 0, 1, -1, 0]
    assert with_alternatives(chain, budget=8, width=1) is chain and with_alternatives(best, 8, 3) is best


def test_tree_verify_on_a_hybrid_with_a_draft_model_equals_ar():
    target = varied_tiny()
    draft = random_model(SMALL_LLAMA, torch.float32, "cpu", seed=1)  # a (poor) draft model sharing the vocab
    p = torch.randint(3, 512, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = build_engine(cfg(drafter="none"), target, frozenset(), "cpu").generate(p, 20).tokens
    for verify in (VerifyMode.CHAIN, VerifyMode.TREE):
        c = cfg(drafter="draft_model", draft_len=3, verify=verify, tree_budget=9, tree_width=3,
                state_checkpoint_spacing=2)
        r = build_engine(c, target, frozenset(), "cpu", draft_model=draft).generate(p, 20)
        assert r.tokens == ref, verify
        widest = max(s.verify_tokens for s in r.steps)
        assert widest == (10 if verify is VerifyMode.TREE else 4), verify  # root + 3 drafts (+ 6 alternatives)


def test_hybrid_deployments_load_and_refuse_llama_only_drafters(tmp_path):
    tiny, h200 = load_deployment("qwen3-next-tiny-cpu"), load_deployment("qwen3-next-80b-layers-h200")
    assert tiny.target_family() is h200.target_family() is TargetFamily.HYBRID
    assert load_deployment("smollm2-135m-cpu").target_family() is TargetFamily.LLAMA
    assert HybridConfig.from_engine(h200.engine).gdn_backend is GdnBackend.TRITON and h200.engine.cuda_graphs
    import yaml
    bad = {"name": "bad", "target": {"random": "qwen3-next-tiny", "seed": 0},
           "drafters": [{"kind": "block", "model": {"path": str(tmp_path)}}], "device": {"kind": "cpu"},
           "workload": {"prompts_per_benchmark": 1, "max_new_tokens": 8},
           "engine": {"cuda_graphs": False, "max_seq_len": 128}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(DeploymentError, match="drafters\\[0\\].kind.*hybrid"):
        load_deployment(tmp_path / "bad.yaml")


def test_bench_cli_on_the_tiny_hybrid_deployment(capsys):
    from specpilot.cli import main
    rc = main(["bench", "--deployment", "qwen3-next-tiny-cpu", "--benchmarks", "gsm8k", "mbpp",
               "--max-new-tokens", "12", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err  # the CLI's reason (e.g. no benchmarks folder) instead of a JSON error on ""
    out = json.loads(captured.out)
    spec = [v for v in out["summary"] if v.startswith("ngram")]  # the label may spell out drafter overrides
    assert {"ar", "ar_fast"} <= set(out["summary"]) and len(spec) == 1
    assert out["summary"][spec[0]]["all_match_ar"]
    assert {r["prompt_id"] for r in out["requests"]} and all(r["new_tokens"] == 12 for r in out["requests"])


def _explored(dep, direction: DirectionName):
    """Mechanisms and configs the search proposer measured on `dep` (a few trials, one short prompt)."""
    from specpilot.bench.session import DeploymentSession
    from specpilot.stages import catalog
    from specpilot.stages.explore import ExploreParams, explore
    from specpilot.stages.proposers import SearchProposer
    session = DeploymentSession(dep, device="cpu")
    prompts = session.tokenize(list(dep.workload.select().tune))[:1]
    params = ExploreParams.from_dict({"prompts": 1, "max_new_tokens": 6, "trials": 4, "batch": 4, "repeats": 1,
                                      "keep": 1, "memory_candidates": 0})
    result = explore(session, catalog.stock_candidate(dep), Direction(direction, 1.5, 0.5, "test"), prompts, params,
                     proposers=(SearchProposer(),))
    searched = [m.candidate for m in result.measured if m.candidate.source.value == "search"]
    assert len(searched) >= 2
    return {n for c in searched for n in c.mechanisms}, [c.config for c in searched], result.space


def test_explore_proposes_hybrid_knobs_for_a_hybrid_deployment_only(tmp_path):
    hybrid = load_deployment("qwen3-next-tiny-cpu")
    names, configs, space = _explored(hybrid, DirectionName.TREE_SHAPE)
    assert "hybrid_tree_verify" in names and "hybrid_tree_verify" in {m.name for m in space.mechanisms["ngram"]}
    assert {c.verify for c in configs} <= {VerifyMode.CHAIN, VerifyMode.TREE}
    names, configs, _ = _explored(hybrid, DirectionName.KERNELS)
    assert "hybrid_state_checkpoints" in names
    assert any((c.state_checkpoint_spacing, c.tree_dfs_order) != (1, True) for c in configs)
    yaml = tmp_path / "llama.yaml"  # the same deployment on a random Llama-family target
    yaml.write_text((hybrid.source.read_text().replace("qwen3-next-tiny-cpu", "llama-tiny-cpu")
                     .replace("{random: qwen3-next-tiny, seed: 0}", "{random: tiny, seed: 0}")))
    llama = load_deployment(yaml)
    assert llama.target_family() is TargetFamily.LLAMA
    for direction in (DirectionName.TREE_SHAPE, DirectionName.KERNELS):
        names, configs, space = _explored(llama, direction)
        assert not names & HYBRID_MECHANISMS and not HYBRID_MECHANISMS & {m.name for m in space.mechanisms["ngram"]}
        assert all({k: c.to_dict()[k] for k in HYBRID_FIELDS} == HYBRID_FIELDS for c in configs)
