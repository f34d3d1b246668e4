"""The norm as a launch of its own (prenorm): the same bits as the fused norm + projection kernels, every epilogue.

rms_norm_rows writes the tile a fused kernel would multiply; a projection with prenorm=True reads it, so its
outputs (and the residual stream it writes) equal prenorm=False bit for bit. Under the Triton interpreter on CPU;
compiled on a GPU.
"""
from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402

import specpilot.kernels as K  # noqa: E402
from specpilot.kernels import norm_epilogues as E  # noqa: E402
from specpilot.kernels.rmsnorm import rms_norm_ref, rms_norm_rows  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
BF = torch.bfloat16


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF).to(DEV)


@pytest.mark.parametrize("T,K_in,block_k", [(1, 96, 32), (5, 64, 64), (18, 200, 64)])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_rows_matches_the_reference_and_writes_the_stream(T, K_in, block_k, row_tile, residual):
    g = torch.Generator().manual_seed(T + K_in)
    x, nw = rnd(g, T, K_in), rnd(g, K_in)
    r = rnd(g, T, K_in) if residual else None
    h = torch.full_like(x, float("nan")) if residual else None
    a = rms_norm_rows(x, nw, 1e-5, r, h, block_k=block_k, row_tile=row_tile, num_warps=4)
    src = x if r is None else x + r
    if residual:
        assert torch.equal(h, src)  # x + r rounded once, as the fused kernels store it
    # the statistic's fp32 order is not torch's: within a rounding of the reference
    torch.testing.assert_close(a.float(), rms_norm_ref(src, nw, 1e-5).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("T", [1, 7, 17])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_prenorm_linear_equals_the_fused_norm_bit_for_bit(T, row_tile, split_k):
    g = torch.Generator().manual_seed(T * 3 + split_k)
    K_in, N = 160, 48
    x, nw, W, r = rnd(g, T, K_in), rnd(g, K_in), rnd(g, N, K_in, scale=0.1), rnd(g, T, K_in)
    tile = {"block_n": 16, "block_k": 32, "row_tile": row_tile, "split_k": split_k, "stat_unroll": 2}
    y, h = K.rmsnorm_linear(x, nw, W, 1e-5, r, **tile)
    y2, h2 = K.rmsnorm_linear(x, nw, W, 1e-5, r, prenorm=True, **tile)
    assert torch.equal(y, y2) and torch.equal(h, h2)
    # the LM head's form: fp32 logits and the argmax epilogue
    y, best = K.rmsnorm_linear(x, nw, W, 1e-5, out_dtype=torch.float32, argmax=True, **tile)
    y2, best2 = K.rmsnorm_linear(x, nw, W, 1e-5, out_dtype=torch.float32, argmax=True, prenorm=True, **tile)
    assert torch.equal(y, y2) and torch.equal(best, best2)


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_prenorm_epilogues_equal_the_fused_norm_bit_for_bit(T, row_tile):
    g = torch.Generator().manual_seed(T + row_tile)
    heads, kv_heads, D, K_in = 4, 2, 16, 96
    x, nw, r = rnd(g, T, K_in), rnd(g, K_in), rnd(g, T, K_in)
    W = rnd(g, (heads + 2 * kv_heads) * D, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(64, D, 10000.0))
    pos, slots = torch.arange(T, device=DEV) * 3, torch.arange(T, device=DEV) + 1
    caches = [rnd(g, kv_heads, 12, D) for _ in range(2)]
    caches2 = [c.clone() for c in caches]
    tile = {"block_n": 16, "block_k": 32, "row_tile": row_tile}
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, *caches, heads, kv_heads, **tile)
    q2 = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, *caches2, heads, kv_heads, prenorm=True, **tile)
    assert torch.equal(q, q2) and all(torch.equal(a, b) for a, b in zip(caches, caches2))
    Wg = rnd(g, 2 * 24, K_in, scale=0.1)
    act, h = E.rmsnorm_glu(x, nw, Wg, 1e-5, r, **tile)
    act2, h2 = E.rmsnorm_glu(x, nw, Wg, 1e-5, r, prenorm=True, **tile)
    assert torch.equal(act, act2) and torch.equal(h, h2)


def test_prenorm_must_be_a_bool():
    x = torch.zeros(1, 32, dtype=BF, device=DEV)
    with pytest.raises(ValueError, match="prenorm"):
        K.rmsnorm_linear(x, x[0], torch.zeros(16, 32, dtype=BF, device=DEV), 1e-5, prenorm=1)
    assert K.RMSNormLinearParams(prenorm=True).prenorm and "prenorm" in K.RMSNormLinearParams.T_NEUTRAL
