"""Hybrid recurrent targets: Gated DeltaNet + gated attention + MoE (the Qwen3-Next layout), chain and tree
verification with per-branch recurrent state and exact rollback. See runner.py for the design."""
from specpilot.engines.hybrid.build import HybridDrafter, best_chain, build_hybrid_engine
from specpilot.engines.hybrid.config import (QWEN3_NEXT_80B, GdnBackend, HybridConfig, HybridShape, LayerKind,
                                             hybrid_knob_schema)
from specpilot.engines.hybrid.model import HybridModel, load_hybrid_model, read_hybrid_shape
from specpilot.engines.hybrid.runner import HybridRunner
from specpilot.engines.hybrid.state import BlockSchedule

__all__ = [
    "QWEN3_NEXT_80B", "BlockSchedule", "GdnBackend", "HybridConfig", "HybridDrafter", "HybridModel", "HybridRunner",
    "HybridShape", "LayerKind", "best_chain", "build_hybrid_engine", "hybrid_knob_schema", "load_hybrid_model",
    "read_hybrid_shape",
]
