"""Soft labels for the block drafter: the target's top-K distribution recorded while it generates, and the loss
that mixes it with the greedy tokens' cross-entropy."""
from __future__ import annotations

import math

import pytest
import torch
from _tiny import prompt, tiny_model

from specpilot.drafting.data import concat, generate
from specpilot.drafting.objective import block_logits, block_loss, sample_batch
from specpilot.drafting.sources import TargetBundle
from specpilot.drafting.train import TrainConfig, new_drafter, train_drafter
from specpilot.engines.drafters.block import lm_head_weight

pytestmark = pytest.mark.usefixtures("one_thread")
NO_EOS: frozenset[int] = frozenset()
QUICK = dict(block_size=4, layers=1, batch_seqs=4, anchors=8, mbpp_prompts=24, free_prompts=8, free_sampled=3,
             gen_tokens=20, gen_batch=64, held_out=2, eval_tokens=12, eval_anchors=8, warmup=2, progress=False)


def data_with_soft(model, k: int, sampled: int = 0, eos: frozenset[int] = NO_EOS, seed: int = 0):
    prompts = [prompt(model.shape.vocab, 5 + i % 4, 100 * seed + i) for i in range(6)]
    return prompts, generate(model, prompts, 16, (0, 1), eos, sampled=sampled, seed=seed, soft_topk=k)


@pytest.mark.parametrize("sampled", [0, 3])
def test_the_recorded_top1_is_the_greedy_token_and_nothing_outside_the_generation_is_labelled(sampled):
    model = tiny_model("gqa", 1)
    prompts, d = data_with_soft(model, 4, sampled)
    assert d.soft_ids.shape == (*d.tokens.shape, 4) and d.soft_logits.dtype == torch.float16
    for n in range(len(d)):
        p, length, plen = len(prompts[n]), int(d.length[n]), int(d.prompt_len[n])
        assert plen == p + sampled
        # greedy positions: the target's likeliest token is the one it wrote, the logits run downwards
        assert torch.equal(d.soft_ids[n, plen:length, 0].long(), d.tokens[n, plen:length])
        assert (d.soft_logits[n, plen:length, :-1] >= d.soft_logits[n, plen:length, 1:]).all()
        assert not d.soft_ids[n, :p].any() and not d.soft_ids[n, length:].any()


def test_soft_labels_follow_the_kept_rows_when_sequences_are_dropped_or_cut():
    model = tiny_model("gqa", 2)
    _, free = data_with_soft(model, 2, seed=3)
    eos = frozenset({int(free.tokens[0, int(free.prompt_len[0]) + 2])})  # one row ends early at this token
    prompts, d = data_with_soft(model, 2, eos=eos, seed=3)
    assert int(d.length.min()) < int(d.length.max())
    for n in range(len(d)):
        plen, length = int(d.prompt_len[n]), int(d.length[n])
        assert torch.equal(d.soft_ids[n, plen:length, 0].long(), d.tokens[n, plen:length])
        assert not d.soft_ids[n, length:].any()


def test_concat_and_to_keep_soft_labels_and_concat_refuses_a_mix():
    model = tiny_model("gqa", 1)
    _, a = data_with_soft(model, 3, seed=1)
    _, b = data_with_soft(model, 3, seed=2)
    both = concat([a, b])
    assert torch.equal(both.soft_ids[:len(a), :a.tokens.shape[1]], a.soft_ids)
    assert torch.equal(both.soft_logits[len(a):, :b.tokens.shape[1]], b.soft_logits)
    plain = generate(model, [prompt(model.shape.vocab, 6, 9)], 8, (0, 1), NO_EOS)
    assert plain.soft_ids is None and concat([plain, plain]).soft_ids is None
    moved = both.to("cpu")  # .to keeps every field, the absent ones absent
    assert torch.equal(moved.soft_logits, both.soft_logits) and torch.equal(moved.features, both.features)
    assert plain.to("cpu").soft_ids is None
    with pytest.raises(ValueError, match="soft labels"):
        concat([a, plain])


def test_concat_pads_each_part_in_order_and_releases_the_parts_it_copied():
    model = tiny_model("gqa", 1)
    parts = [generate(model, [prompt(model.shape.vocab, n, s) for s in range(k)], new, (0, 1), NO_EOS)
             for n, k, new in ((5, 2, 4), (9, 3, 7), (3, 1, 2))]  # unequal widths, the widest in the middle
    t_max = max(p.tokens.shape[1] for p in parts)
    want = [torch.cat([torch.nn.functional.pad(getattr(p, f), pad(p)) for p in parts])
            for f, pad in (("tokens", lambda p: (0, t_max - p.tokens.shape[1])),
                           ("features", lambda p: (0, 0, 0, t_max - p.tokens.shape[1])))]
    lens = [torch.cat([getattr(p, f) for p in parts]) for f in ("prompt_len", "length")]
    queue = list(parts)
    got = concat(queue)
    assert queue == []  # each part is dropped once copied: no padded copies beside the parts and the result
    assert torch.equal(got.tokens, want[0]) and torch.equal(got.features, want[1])
    assert torch.equal(got.prompt_len, lens[0]) and torch.equal(got.length, lens[1])
    assert got.tokens.dtype == parts[0].tokens.dtype and got.features.dtype == parts[0].features.dtype


def test_concat_assembles_on_the_cpu_where_the_gpu_cannot_hold_a_second_copy(monkeypatch):
    """assembly_device: the parts' own device while it can hold the result beside them (and a 1 GiB margin), else
    the CPU (the result moves back once the parts are freed); CPU parts stay where they are at any size."""
    import specpilot.drafting.data as data

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(data, "_cuda_spare_bytes", lambda device: 40 << 30)
    assert data.assembly_device(gpu, 39 << 30) == gpu
    assert data.assembly_device(gpu, (39 << 30) + 1) == torch.device("cpu")
    assert data.assembly_device(torch.device("cpu"), 1 << 50) == torch.device("cpu")


def _loss_inputs(k: int):
    model = tiny_model("gqa", 4)
    drafter = new_drafter(TargetBundle("tiny", model, None, NO_EOS), TrainConfig(**QUICK)).float()
    _, d = data_with_soft(model, k, seed=5)
    batch = sample_batch(d, torch.arange(len(d)), 6, 4, torch.Generator().manual_seed(0))
    return model, drafter, batch


def test_a_batch_carries_the_soft_labels_of_its_target_slots():
    _, _, batch = _loss_inputs(3)
    assert batch.soft_ids.shape == (*batch.targets.shape, 3)
    valid = batch.weight > 0
    assert torch.equal(batch.soft_ids[..., 0][valid], batch.targets[valid])


def test_top1_soft_labels_are_the_hard_loss_and_more_of_them_are_their_cross_entropy():
    value = lambda m: float(m.loss.detach())  # noqa: E731
    model, drafter, batch = _loss_inputs(1)
    embed, head = model.embed_tokens.weight, lm_head_weight(model)
    hard = block_loss(drafter, embed, head, batch, 7.0)
    assert value(block_loss(drafter, embed, head, batch, 7.0, soft_weight=1.0)) == pytest.approx(value(hard), rel=1e-5)
    model, drafter, batch = _loss_inputs(4)
    embed, head = model.embed_tokens.weight, lm_head_weight(model)
    hard = block_loss(drafter, embed, head, batch, 7.0)
    mixed = block_loss(drafter, embed, head, batch, 7.0, soft_weight=0.5)
    # by hand: q = softmax of the recorded logits, the slot's loss -sum q log p, mixed half and half, decayed
    logp = block_logits(drafter, embed, head, batch).float().log_softmax(-1)
    soft = -(batch.soft_logits.float().softmax(-1) * logp.gather(-1, batch.soft_ids)).sum(-1)
    hard_slots = -logp.gather(-1, batch.targets[..., None])[..., 0]
    w = batch.weight * torch.exp(-torch.arange(3.0) / 7.0)
    want = (((hard_slots + soft) / 2) * w).sum() / w.sum()
    assert value(mixed) == pytest.approx(float(want.detach()), rel=1e-5)
    assert value(mixed) != pytest.approx(value(hard), rel=1e-3)
    assert mixed.accepted == hard.accepted  # the metrics are the greedy tokens' either way
    mixed.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0


def test_soft_weight_without_soft_labels_is_refused():
    model = tiny_model("gqa", 4)
    drafter = new_drafter(TargetBundle("tiny", model, None, NO_EOS), TrainConfig(**QUICK)).float()
    d = generate(model, [prompt(model.shape.vocab, 6, 1)] * 2, 10, (0, 1), NO_EOS)
    batch = sample_batch(d, torch.arange(2), 4, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="soft labels"):
        block_loss(drafter, model.embed_tokens.weight, lm_head_weight(model), batch, 7.0, soft_weight=0.3)


def test_config_checks_the_soft_knobs():
    with pytest.raises(ValueError, match="soft_weight"):
        TrainConfig(soft_topk=4, soft_weight=1.5)
    with pytest.raises(ValueError, match="data_from"):
        TrainConfig(soft_topk=4, data_from="somewhere")
    with pytest.raises(ValueError, match="soft_topk"):
        TrainConfig(soft_topk=-1)
    for w in (0.3, 0.5):  # the default's value too: set without soft labels, it would weigh nothing
        with pytest.raises(ValueError, match="set soft_topk"):
            TrainConfig(soft_weight=w)
    assert TrainConfig(soft_topk=4).soft_weight == 0.5 and TrainConfig().soft_weight is None
    model = tiny_model("gqa", 1)
    with pytest.raises(ValueError, match="more than the target"):
        train_drafter(TargetBundle("tiny", model, None, NO_EOS),
                      TrainConfig(**QUICK, steps=1, soft_topk=model.shape.vocab + 1))


def test_training_with_soft_labels_runs_end_to_end_and_says_so(tmp_path):
    model = tiny_model("gqa", 6)
    result = train_drafter(TargetBundle("tiny", model, None, NO_EOS),
                           TrainConfig(**QUICK, steps=4, soft_topk=4, soft_weight=0.7), tmp_path / "out")
    assert result.report["config"]["soft_topk"] == 4 and result.report["config"]["soft_weight"] == 0.7
    assert all(r["equal_to_ar"] for r in result.report["trained"]["engine"])
    assert all(math.isfinite(r["loss"]) for r in result.report["loss_curve"] if "loss" in r)


def test_command_line_takes_the_soft_knobs(tmp_path):
    import argparse

    from specpilot.drafting.cli import register_cli
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["drafter", "train", "--target", "t", "--out", str(tmp_path), "--soft-topk", "8",
                              "--soft-weight", "0.25"])
    assert (args.soft_topk, args.soft_weight) == (8, 0.25)
