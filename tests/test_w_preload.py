"""linear's w_preload (the W tile, or a large tile's first chunks, loaded before the predecessor wait) changes no bit.

linear and swiglu_linear with w_preload=True against the pipelined K loop (w_preload=False), for token counts on
both sides of the 16-row tile, K not a multiple of the chunk, with residuals and biases, and a tile too large to
preload whole (its first chunks preloaded, the K loop over the rest). Under the Triton interpreter on CPU; compiled
on a GPU (where the preloaded tiles take another path through registers to the dots).
"""
from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402

import specpilot.kernels as K  # noqa: E402
from specpilot.kernels.gemm import PRELOAD_HEAD_BYTES, PRELOAD_MAX_BYTES, LinearParams, preload_chunks  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
BF = torch.bfloat16


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF).to(DEV)


def same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit (-0.0 and NaN payloads too)


@pytest.mark.parametrize("T", [1, 5, 16, 21])
def test_preloaded_linear_equals_the_k_loop(T):
    g = torch.Generator().manual_seed(T)
    K_in, N = 200, 48  # 200 = one full 128-chunk and a partial one (and 4 chunks of 64, the last partial)
    x, W, res, bias = rnd(g, T, K_in), rnd(g, N, K_in, scale=0.1), rnd(g, T, N), rnd(g, N)
    gu = rnd(g, T, 2 * K_in)
    for kw in ({"block_n": 16}, {"block_n": 32, "block_k": 64}, {"block_n": 16, "early_residual": False}):
        for args, fn in (((x, W), K.linear), ((x, W, res), K.linear), ((gu, W, res), K.swiglu_linear)):
            want = fn(*args, bias=bias, **kw)
            assert same(fn(*args, bias=bias, w_preload=True, **kw), want), (fn.__name__, kw)


@pytest.mark.parametrize("T", [1, 17])
def test_a_large_tiles_first_chunks_preloaded_equal_the_k_loop(T):
    g = torch.Generator().manual_seed(100 + T)
    K_in, N = 2200, 32  # 18 chunks of 128 (the last partial): 72 KiB a 16-column tile, over PRELOAD_MAX_BYTES
    assert preload_chunks(True, False, 1, 16, K_in, 128, 2) == 4  # 4 chunks preloaded, 14 through the K loop
    x, W, res, bias = rnd(g, T, K_in), rnd(g, N, K_in, scale=0.1), rnd(g, T, N), rnd(g, N)
    want = K.linear(x, W, res, bias=bias, block_n=16)
    assert same(K.linear(x, W, res, bias=bias, block_n=16, w_preload=True), want)


def test_preload_applies_only_to_unsplit_bf16_tiles_whole_when_small():
    assert preload_chunks(True, False, 1, 16, 576, 128, 2) == 5  # SmolLM2's o_proj tile: 18 KiB
    assert preload_chunks(True, False, 1, 16, 1536, 128, 2) == 12  # down: 48 KiB
    assert preload_chunks(False, False, 1, 16, 576, 128, 2) == 0
    assert preload_chunks(True, True, 1, 16, 576, 128, 2) == 0  # W12 decodes in its own tile loads
    assert preload_chunks(True, False, 2, 16, 576, 128, 2) == 0  # split-K: each program a run of chunks
    assert preload_chunks(True, False, 1, 64, 4096, 128, 2) == 1  # Llama-3-8B: 512 KiB a tile, its first 16 KiB
    assert preload_chunks(True, False, 1, 32, 4096, 256, 2) == 1  # its o_proj (block_k 256): one 16 KiB chunk
    assert preload_chunks(True, False, 1, 64, 4096, 256, 2) == 0  # a 32 KiB chunk: over the head budget
    assert preload_chunks(True, False, 1, 16, 2048, 128, 2) == 16  # exactly PRELOAD_MAX_BYTES: all of it
    assert preload_chunks(True, False, 1, 16, 2049, 128, 2) == 4  # a 17th chunk: over it, the first 16 KiB
    assert 16 * 16 * 128 * 2 == PRELOAD_MAX_BYTES and 4 * 16 * 128 * 2 == PRELOAD_HEAD_BYTES
    assert "w_preload" in LinearParams.T_NEUTRAL
    with pytest.raises(ValueError, match="w_preload"):
        LinearParams(w_preload=1)


@pytest.mark.interpreter
def test_the_persistent_probe_runs_its_variants_to_the_same_bits(monkeypatch):
    """scripts/gpu_persistent_probe.py (session 27: a grid barrier costs what a kernel boundary costs) under the
    interpreter: with one program every barrier opens, so separate launches, one launch a layer and one for all
    layers must give the same bits, close to torch's chain."""
    monkeypatch.syspath_prepend("scripts")
    from gpu_persistent_probe import Chain
    chain = Chain("tiny", 3, "cpu", programs=1)
    outs = []
    for run in (lambda: chain.run_separate(False), lambda: chain.run_persistent(True),
                lambda: chain.run_persistent(False)):
        run()
        outs.append(chain.b0.clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert chain.cnt.tolist() == [1] * 12  # every program (one) arrived at each layer's four barriers
    torch.testing.assert_close(outs[0].float(), chain.reference().float(), atol=0.05, rtol=0.05)
