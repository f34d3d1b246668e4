"""Grow a trained block drafter into a larger one that computes exactly what it computed, so training continues from
its acceptance instead of from scratch (a GPU call trains for minutes; a fresh larger drafter would start far
behind the shipped one).

- More layers: appended after the trained ones with their attention output and MLP down projections zero. A
  drafter layer is pre-norm residual (x + attn(norm x), then + mlp(norm x)), so each new layer passes its input
  through; its other projections are drawn as a fresh drafter's, so gradients reach them once the zero ones move.
- More target layers: the fc projection's columns for the new layers' features are zero, the trained layers'
  columns move to where their layer now sits in target_layers (sorted).
"""
from __future__ import annotations

import dataclasses

import torch

from specpilot.engines.drafters.block import BlockDrafterModel

ZERO_IN_NEW_LAYERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # (init_weights zeroes every bias)


def grow_drafter(model: BlockDrafterModel, add_layers: int = 0, add_target_layers: tuple[int, ...] = (),
                 seed: int = 0) -> BlockDrafterModel:
    """`model` with `add_layers` more layers and features from `add_target_layers` more target layers (float32, its
    outputs unchanged)."""
    c = model.config
    if add_layers < 0:
        raise ValueError(f"add_layers={add_layers}: must be >= 0")
    again = sorted(set(add_target_layers) & set(c.target_layers))
    if again or len(set(add_target_layers)) != len(add_target_layers):
        raise ValueError(f"target layers {again or list(add_target_layers)} are already read or listed twice")
    targets = tuple(sorted(c.target_layers + tuple(add_target_layers)))
    grown = BlockDrafterModel(dataclasses.replace(c, layers=c.layers + add_layers, target_layers=targets))
    grown.init_weights(seed)
    old = {k: v.detach().float() for k, v in model.state_dict().items()}
    with torch.no_grad():  # state_dict()'s tensors share the parameters' storage: written in place
        for name, t in grown.state_dict().items():
            if name == "fc.weight":
                t.zero_()
                h = c.hidden
                for i, layer in enumerate(c.target_layers):
                    j = targets.index(layer)
                    t[:, j * h:(j + 1) * h] = old[name][:, i * h:(i + 1) * h]
            elif name in old:
                t.copy_(old[name])
            elif name.endswith(ZERO_IN_NEW_LAYERS):
                t.zero_()
    return grown.float().train(model.training)
