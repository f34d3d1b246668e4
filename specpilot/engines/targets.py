"""Target models of either family (see engines/family.py): loading a model directory or a random shape by family.

Everything that loads a target without knowing its family (deployment sessions, memory scopes) goes through here,
and build_engine dispatches on the loaded model's type; a model_type neither family supports fails here, naming
the supported ones.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from specpilot.engines.family import (HYBRID_TYPES, FamilyLookupError, TargetFamily, TargetShape, family_of_dir,
                                      model_type)
from specpilot.engines.hybrid.config import HybridShape
from specpilot.engines.hybrid.model import HybridModel, load_hybrid_model, random_hybrid_model, read_hybrid_shape
from specpilot.engines.llama import LlamaModel
from specpilot.engines.loader import ModelLoadError, load_model, random_model, read_shape
from specpilot.engines.shapes import LlamaShape, UnsupportedModelError

TargetModel = Union[LlamaModel, HybridModel]
__all__ = ["HYBRID_TYPES", "TargetFamily", "TargetModel", "TargetShape", "family_of_dir", "load_target", "model_type",
           "random_target", "read_target_shape"]


def _family(model_dir: str | Path) -> TargetFamily:
    try:
        return family_of_dir(model_dir)
    except FamilyLookupError as e:  # the loaders' error for an unusable directory
        raise ModelLoadError(str(e)) from None


def read_target_shape(model_dir: str | Path) -> TargetShape:
    if _family(model_dir) is TargetFamily.HYBRID:
        return read_hybrid_shape(Path(model_dir))
    return read_shape(Path(model_dir))


def load_target(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device) -> TargetModel:
    """A model directory of either family, by its config.json's model_type."""
    if _family(model_dir) is TargetFamily.HYBRID:
        return load_hybrid_model(Path(model_dir), dtype, device)
    return load_model(Path(model_dir), dtype, device)


def random_target(shape: TargetShape, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> TargetModel:
    """Random weights of either family's shape (kernels and cost only, never acceptance)."""
    if isinstance(shape, HybridShape):
        return random_hybrid_model(shape, dtype, device, seed=seed)
    if isinstance(shape, LlamaShape):
        return random_model(shape, dtype, device, seed=seed)
    raise UnsupportedModelError(f"no target family has shapes of type {type(shape).__name__}")
