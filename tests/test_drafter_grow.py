"""Growing a drafter keeps its outputs (more layers, more target layers), and int8-row checkpoints: what the trainer
measures is what the checkpoint holds."""
from __future__ import annotations

import json

import pytest
import torch
from _tiny import prompt, tiny_model

from specpilot.drafting.checkpoint import (DrafterCheckpointError, WeightStorage, as_stored, load_drafter,
                                           save_drafter)
from specpilot.drafting.grow import grow_drafter
from specpilot.drafting.sources import TargetBundle
from specpilot.drafting.train import TrainConfig, new_drafter, train_drafter
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape
from specpilot.engines.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")


def drafter_for(model, layers: int = 1, target_layers=(0, 2), seed: int = 0) -> BlockDrafterModel:
    c = BlockDrafterConfig.for_target(model.shape, layers=layers, block_size=4, target_layers=target_layers)
    return BlockDrafterModel(c).init_weights(seed).float().eval()


def proposal(model, drafter, ctx):
    cfg = EngineConfig(dtype="float32", max_seq_len=128, token_tile=8, drafter=DrafterKind.BLOCK, block_size=4)
    runner = ModelRunner(model, cfg, "cpu", block_width=32, capture=drafter.config.target_layers)
    d = BlockTreeDrafter(drafter, model, TreeShape(True, 4, 12, 4, 3), 128, "cpu")
    d.observe(0, runner.prefill(ctx[:-1]).features)
    return d.propose(ctx, 9)


@pytest.mark.parametrize("listed", [(0, 2), (2, 0)])  # features arrive in layer order, however they are listed
def test_a_grown_drafter_proposes_what_it_proposed(listed):
    model = tiny_model("mha_tied", 2)
    small = drafter_for(model, target_layers=listed, seed=3)
    with torch.no_grad():
        small.mask_embed.normal_(0, 0.3)
    grown = grow_drafter(small, add_layers=2, add_target_layers=(1,), seed=5)
    assert grown.config.layers == 3 and grown.config.target_layers == (0, 1, 2)
    h = model.shape.hidden
    fc = grown.fc.weight.detach()
    assert torch.equal(fc[:, :h], small.fc.weight[:, :h]) and torch.equal(fc[:, 2 * h:], small.fc.weight[:, h:])
    assert not fc[:, h:2 * h].any()
    for layer in grown.layers[1:]:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.q_proj.weight.abs().sum() > 0  # drawn, not zero: they learn once o / down move
    for ctx in (prompt(model.shape.vocab, 12, 7), prompt(model.shape.vocab, 20, 8)):
        a, b = proposal(model, small, ctx), proposal(model, grown, ctx)
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert b.scores == pytest.approx(a.scores, rel=1e-5, abs=1e-7)


def test_a_widened_drafter_proposes_what_it_proposed_and_its_new_channels_learn():
    model = tiny_model("mha_tied", 2)
    small = drafter_for(model, layers=2, seed=3)
    with torch.no_grad():
        small.mask_embed.normal_(0, 0.3)
    wide = grow_drafter(small, intermediate=3 * small.config.intermediate, seed=5)
    n = small.config.intermediate
    assert wide.config.intermediate == 3 * n and wide.config.layers == 2
    for old, new in zip(small.layers, wide.layers):
        assert torch.equal(new.mlp.gate_proj.weight[:n], old.mlp.gate_proj.weight)
        assert torch.equal(new.mlp.down_proj.weight[:, :n], old.mlp.down_proj.weight)
        assert not new.mlp.down_proj.weight[:, n:].any() and new.mlp.up_proj.weight[n:].abs().sum() > 0
    for ctx in (prompt(model.shape.vocab, 12, 7), prompt(model.shape.vocab, 20, 8)):
        a, b = proposal(model, small, ctx), proposal(model, wide, ctx)
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert b.scores == pytest.approx(a.scores, rel=1e-5, abs=1e-7)
    wide.train()
    feats = torch.randn(1, 6, wide.config.feature_dim)
    x = wide.block_inputs(model.embed_tokens.weight[:1].float())
    wide(x, torch.arange(6, 10)[None], wide.context_kv(feats, torch.arange(6)[None])).square().sum().backward()
    assert wide.layers[0].mlp.down_proj.weight.grad[:, n:].abs().sum() > 0


def test_the_new_layers_get_gradients():
    model = tiny_model("mha_tied", 2)
    grown = grow_drafter(drafter_for(model), add_layers=1).train()
    feats = torch.randn(1, 6, grown.config.feature_dim)
    pos = torch.arange(6)[None]
    x = grown.block_inputs(model.embed_tokens.weight[:1].float())  # [1, 4, H]
    out = grown(x, torch.arange(6, 10)[None], grown.context_kv(feats, pos))
    out.square().sum().backward()
    new = grown.layers[1]
    assert new.self_attn.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0


def test_growth_refuses_what_it_cannot_do():
    d = drafter_for(tiny_model("mha_tied", 1))
    with pytest.raises(ValueError, match="already read"):
        grow_drafter(d, add_target_layers=(2,))
    with pytest.raises(ValueError, match="twice"):
        grow_drafter(d, add_target_layers=(1, 1))
    with pytest.raises(ValueError, match="add_layers"):
        grow_drafter(d, add_layers=-1)
    with pytest.raises(ValueError, match="cannot narrow"):
        grow_drafter(d, intermediate=d.config.intermediate - 1)
    with pytest.raises(ValueError, match="set init"):
        TrainConfig(grow_layers=1)
    with pytest.raises(ValueError, match="set init"):
        TrainConfig(grow_intermediate=64)


def test_int8_rows_round_trip_and_as_stored_is_what_loads(tmp_path):
    model = tiny_model("mha_tied", 3)
    d = drafter_for(model, layers=2, seed=4)
    save_drafter(d, tmp_path / "q", model, storage=WeightStorage.INT8_ROWS)
    save_drafter(d, tmp_path / "b", model)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["storage"] == "int8-rows"
    assert "storage" not in json.loads((tmp_path / "b" / "config.json").read_text())
    from safetensors import safe_open
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.int8 and f.get_tensor("fc.weight.row_scale").dtype == torch.float32
        assert f.get_tensor("norm.weight").dtype == torch.bfloat16 and f.get_tensor("mask_embed").dtype == torch.bfloat16
    loaded = load_drafter(tmp_path / "q", model)
    for name, w in d.state_dict().items():
        q = loaded.state_dict()[name]
        if w.dim() == 2 and name != "mask_embed":  # within half a step of the row's int8 grid
            assert ((q - w).abs() <= w.abs().amax(dim=1, keepdim=True) / 127 * 0.5 + 1e-7).all(), name
    as_stored(d, WeightStorage.INT8_ROWS)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in d.state_dict().items())


def test_int8_rows_checkpoint_without_its_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    model = tiny_model("mha_tied", 3)
    save_drafter(drafter_for(model), tmp_path / "q", model, storage=WeightStorage.INT8_ROWS)
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    del state["fc.weight.row_scale"]
    save_file(state, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(DrafterCheckpointError, match="row_scale"):
        load_drafter(tmp_path / "q", model)
    meta = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**meta, "storage": "int3"}))
    with pytest.raises(DrafterCheckpointError, match="bad drafter config"):
        load_drafter(tmp_path / "q", model)


def test_trainer_grows_its_init_and_saves_int8_rows(tmp_path):
    model = tiny_model("mha_tied", 6)
    bundle = TargetBundle("tiny", model, None, frozenset())
    save_drafter(drafter_for(model, target_layers=(0, 2)), tmp_path / "init", model, storage=WeightStorage.FP32)
    quick = dict(block_size=4, batch_seqs=4, anchors=8, mbpp_prompts=12, free_prompts=4, free_sampled=2,
                 gen_tokens=16, gen_batch=64, held_out=2, eval_tokens=12, eval_anchors=8, warmup=2, progress=False)
    c = TrainConfig(**quick, steps=3, init=str(tmp_path / "init"), grow_layers=1, grow_target_layers=(1,),
                    checkpoint_storage="int8-rows")
    assert c.checkpoint_storage is WeightStorage.INT8_ROWS
    start = new_drafter(bundle, c)
    assert start.config.layers == 2 and start.config.target_layers == (0, 1, 2)
    result = train_drafter(bundle, c, tmp_path / "out")
    saved = load_drafter(tmp_path / "out", model)
    assert saved.config == result.model.config == start.config
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in result.model.state_dict().items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["storage"] == "int8-rows"
    assert result.report["config"]["checkpoint_storage"] == "int8-rows"


def test_command_line_grows_and_stores_int8_rows(tmp_path):
    import argparse

    from specpilot.drafting.cli import register_cli
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["drafter", "train", "--target", "t", "--out", str(tmp_path), "--init", "d",
                              "--grow-layers", "2", "--grow-target-layers", "5,9", "--checkpoint-storage", "int8-rows",
                              "--grow-intermediate", "3072"])
    assert (args.grow_layers, args.grow_target_layers, args.checkpoint_storage) == (2, (5, 9), "int8-rows")
    assert args.grow_intermediate == 3072
    with pytest.raises(SystemExit):
        parser.parse_args(["drafter", "train", "--target", "t", "--out", "o", "--checkpoint-storage", "int4"])


def test_a_four_layer_smollm2_drafter_fits_the_shipping_cap_in_int8_rows(tmp_path):
    """The 16 MB a shipped drafter may take: SmolLM2-135M's 2-layer drafter fits in bf16, a 4-layer one only as int8
    rows."""
    from specpilot.engines.loader import random_model
    from specpilot.engines.shapes import SMOLLM2_135M
    target = random_model(SMOLLM2_135M, torch.float32, "cpu", seed=0)
    sizes = {}
    for layers, storage in ((2, WeightStorage.BF16), (4, WeightStorage.BF16), (4, WeightStorage.INT8_ROWS)):
        d = BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=layers)).init_weights(0)
        save_drafter(d, tmp_path / f"{layers}-{storage.value}", target, storage=storage)
        sizes[layers, storage] = (tmp_path / f"{layers}-{storage.value}" / "model.safetensors").stat().st_size
    cap = 16 * 10**6
    assert sizes[2, WeightStorage.BF16] < cap < sizes[4, WeightStorage.BF16]
    assert sizes[4, WeightStorage.INT8_ROWS] < cap and sizes[4, WeightStorage.INT8_ROWS] < 0.55 * sizes[4, WeightStorage.BF16]
    # 2 layers with MLPs 3072 wide (5.3x hidden instead of 2x; the target's own are 1536) fit too, as int8 rows only
    d = BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=2, intermediate=3072)).init_weights(0)
    save_drafter(d, tmp_path / "wide", target, storage=WeightStorage.INT8_ROWS)
    assert (tmp_path / "wide" / "model.safetensors").stat().st_size < cap
