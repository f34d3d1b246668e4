"""specpilot.collector: the decode loops run with the cyclic collector paused, and leave its state as they found it."""
from __future__ import annotations

import gc

import pytest
import torch

from specpilot.engines.build import build_engine
from specpilot.collector import collector_paused
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import LlamaShape


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_restores_the_previous_state(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():  # nested: still off, and the outer block restores
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a failed request")
        assert gc.isenabled() is enabled  # restored on the error path too
    finally:
        gc.enable()


def test_generate_runs_with_the_collector_off(monkeypatch):
    """SpecEngine.generate's decode loop sees the collector off; afterwards it is back on."""
    from specpilot.engines import engine as engine_mod
    seen = []
    real = engine_mod.SpecEngine._generate

    def spy(self, *a, **kw):
        seen.append(gc.isenabled())
        return real(self, *a, **kw)

    monkeypatch.setattr(engine_mod.SpecEngine, "_generate", spy)
    shape = LlamaShape(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64, rms_eps=1e-5,
                       rope_theta=10000.0, tie_embeddings=False)
    model = random_model(shape, torch.float32, "cpu", seed=0)
    eng = build_engine(EngineConfig(dtype="float32", max_seq_len=64, drafter=DrafterKind.NGRAM), model, frozenset(),
                       "cpu")
    gc.enable()
    res = eng.generate([1, 2, 3, 1, 2], 8)
    assert seen == [False] and gc.isenabled() and len(res.tokens) == 8
