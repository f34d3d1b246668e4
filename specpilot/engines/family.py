"""Target families, known without loading a model: from a config.json's model_type or a shape.

Two families exist: the Llama family (engines/llama.py, engines/runner.py) and the hybrid recurrent family
(engines/hybrid: Gated DeltaNet + gated attention, the Qwen3-Next layout). This module imports neither engine
(no torch, no Triton), so deployments, the testbed and the explorer's catalog can ask for a family cheaply;
engines/targets.py loads the models.
"""
from __future__ import annotations

import dataclasses
import json
from enum import Enum
from pathlib import Path
from typing import Any, Union

from specpilot.engines.hybrid.config import HybridShape
from specpilot.engines.shapes import SUPPORTED_LLAMA_TYPES, LlamaShape, UnsupportedModelError

TargetShape = Union[LlamaShape, HybridShape]
HYBRID_TYPES = ("qwen3_next",)


class FamilyLookupError(ValueError):
    """A model directory says nothing readable about its architecture (no or a broken config.json)."""


class TargetFamily(str, Enum):
    LLAMA = "llama"  # dense decoder with a KV cache per layer (Llama, Qwen2, Qwen3, Mistral, SmolLM2)
    HYBRID = "hybrid"  # recurrent Gated DeltaNet layers mixed with attention: per-branch state, no crop

    @classmethod
    def of_model_type(cls, model_type: str | None) -> "TargetFamily":
        if model_type in SUPPORTED_LLAMA_TYPES:
            return cls.LLAMA
        if model_type in HYBRID_TYPES:
            return cls.HYBRID
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported: the Llama-family engine loads "
            f"{', '.join(SUPPORTED_LLAMA_TYPES)}; the hybrid engine loads {', '.join(HYBRID_TYPES)}")

    @classmethod
    def of_shape(cls, shape: TargetShape) -> "TargetFamily":
        return cls.HYBRID if isinstance(shape, HybridShape) else cls.LLAMA


def shape_to_dict(shape: TargetShape) -> dict[str, Any]:
    """A shape as JSON-able fields plus its family (profile's shape.json)."""
    return {"family": TargetFamily.of_shape(shape).value, **dataclasses.asdict(shape)}


def shape_from_dict(d: dict[str, Any]) -> TargetShape:
    """The inverse of shape_to_dict; a dict without "family" (written before hybrids) is a Llama shape."""
    fields = {k: v for k, v in d.items() if k != "family"}
    if TargetFamily(d.get("family", TargetFamily.LLAMA.value)) is TargetFamily.HYBRID:
        return HybridShape.from_dict(fields)
    return LlamaShape(**fields)


def model_type(model_dir: str | Path) -> str | None:
    """config.json's model_type of a Hugging Face model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FamilyLookupError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise FamilyLookupError(f"{path} is not a JSON object: {e}") from None


def family_of_dir(model_dir: str | Path) -> TargetFamily:
    return TargetFamily.of_model_type(model_type(model_dir))
