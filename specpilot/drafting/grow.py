"""Grow a trained block drafter into a larger one that computes exactly what it computed, so training continues from
its acceptance instead of from scratch (a GPU call trains for minutes; a fresh larger drafter would start far
behind the shipped one).

- More layers: appended after the trained ones with their attention output and MLP down projections zero. A
  drafter layer is pre-norm residual (x + attn(norm x), then + mlp(norm x)), so each new layer passes its input
  through; its other projections are drawn as a fresh drafter's, so gradients reach them once the zero ones move.
- More target layers: the fc projection's columns for the new layers' features are zero, the trained layers'
  columns move to where their layer now sits in target_layers (sorted).
- A wider MLP (intermediate): the trained channels keep their rows of gate / up and their columns of down; the new
  channels' gate / up rows are drawn fresh and their down columns are zero, so they add nothing until down moves.
  Width, unlike depth, adds no launches to the drafter's step (its projections are launch-bound at 16 rows).
"""
from __future__ import annotations

import dataclasses

import torch

from specpilot.engines.drafters.block import BlockDrafterModel

ZERO_IN_NEW_LAYERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # (init_weights zeroes every bias)


def grow_drafter(model: BlockDrafterModel, add_layers: int = 0, add_target_layers: tuple[int, ...] = (),
                 seed: int = 0, intermediate: int | None = None) -> BlockDrafterModel:
    """`model` with `add_layers` more layers, features from `add_target_layers` more target layers and MLPs
    `intermediate` wide (None: as they are), float32, its outputs unchanged."""
    c = model.config
    if add_layers < 0:
        raise ValueError(f"add_layers={add_layers}: must be >= 0")
    width = c.intermediate if intermediate is None else intermediate
    if width < c.intermediate:
        raise ValueError(f"intermediate={width}: the drafter's MLPs are {c.intermediate} wide; growing cannot narrow")
    again = sorted(set(add_target_layers) & set(c.target_layers))
    if again or len(set(add_target_layers)) != len(add_target_layers):
        raise ValueError(f"target layers {again or list(add_target_layers)} are already read or listed twice")
    targets = tuple(sorted(c.target_layers + tuple(add_target_layers)))
    grown = BlockDrafterModel(dataclasses.replace(c, layers=c.layers + add_layers, target_layers=targets,
                                                  intermediate=width))
    grown.init_weights(seed)
    old = {k: v.detach().float() for k, v in model.state_dict().items()}
    with torch.no_grad():  # state_dict()'s tensors share the parameters' storage: written in place
        for name, t in grown.state_dict().items():
            if name == "fc.weight":
                t.zero_()
                h = c.hidden
                # the target hands its features over in layer order, whatever order the config lists them in
                for i, layer in enumerate(sorted(c.target_layers)):
                    j = targets.index(layer)
                    t[:, j * h:(j + 1) * h] = old[name][:, i * h:(i + 1) * h]
            elif name not in old:  # a new layer's: drawn, its output projections zero
                if name.endswith(ZERO_IN_NEW_LAYERS):
                    t.zero_()
            elif name.endswith("mlp.down_proj.weight"):  # [hidden, intermediate]: the new channels' columns zero
                t.zero_()
                t[:, :c.intermediate] = old[name]
            elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # [intermediate, hidden]
                t[:c.intermediate] = old[name]  # the new channels' rows stay as drawn
            else:
                t.copy_(old[name])
    return grown.float().train(model.training)
