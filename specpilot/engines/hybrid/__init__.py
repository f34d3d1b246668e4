"""Hybrid recurrent targets: Gated DeltaNet + gated attention + MoE (the Qwen3-Next layout), chain and tree
verification with per-branch recurrent state and exact rollback, CUDA graphs per forward. See runner.py.

Names load lazily: importing the package (e.g. for hybrid.config's shapes, as the testbed and deployments do)
must not import torch or Triton."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build": ("HybridDrafter", "best_chain", "build_hybrid_engine", "with_alternatives"),
    "config": ("QWEN3_NEXT_80B", "QWEN3_NEXT_80B_LAYERS", "QWEN3_NEXT_TINY", "GdnBackend", "HybridConfig",
               "HybridShape", "LayerKind", "hybrid_knob_schema"),
    "model": ("HybridModel", "load_hybrid_model", "random_hybrid_model", "read_hybrid_shape"),
    "runner": ("HybridRunner",),
    "state": ("BlockSchedule",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
