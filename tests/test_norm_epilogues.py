"""The epilogue-fused norm + projection kernels equal the unfused pairs bit for bit, for any T, and check inputs.

rmsnorm_qkv_rope == rmsnorm_linear then rope_kv_write (q, k cache, v cache); rmsnorm_glu == rmsnorm_linear then
swiglu (and the residual stream). Under the Triton interpreter on CPU; compiled on a GPU.
"""
from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402

import specpilot.kernels as K  # noqa: E402
from specpilot.kernels import norm_epilogues as E  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
BF = torch.bfloat16


def rnd(g, *shape, scale=1.0, dtype=BF):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 32)])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_qkv_rope_equals_projection_then_rope(heads, kv_heads, head_dim, T, row_tile):
    g = torch.Generator().manual_seed(T * 7 + heads)
    K_in = 64
    x, nw = rnd(g, T, K_in), rnd(g, K_in)
    W = rnd(g, (heads + 2 * kv_heads) * head_dim, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(128, head_dim, 10000.0))
    pos = torch.randint(0, 100, (T,), generator=g).to(DEV)
    slots = torch.randperm(40, generator=g)[:T].to(DEV)
    kc, vc = rnd(g, kv_heads, 40, head_dim), rnd(g, kv_heads, 40, head_dim)
    kc2, vc2 = kc.clone(), vc.clone()
    tile = {"block_n": 16, "row_tile": row_tile}  # with one row per program block_n shapes the sum: keep it
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, kc, vc, heads, kv_heads, **tile)
    q2 = K.rope_kv_write(K.rmsnorm_linear(x, nw, W, 1e-5, **tile), pos, slots, cos, sin, kc2, vc2, heads, kv_heads)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    kc3, vc3 = kc.clone(), vc.clone()  # the reference, to tolerance (it rounds through torch's ops)
    q3 = E.rmsnorm_qkv_rope_ref(x, nw, W, 1e-5, pos, slots, cos, sin, kc3, vc3, heads, kv_heads)
    torch.testing.assert_close(q.float(), q3.float(), atol=2e-2, rtol=2e-2)
    # rows are batch-invariant: token 0 alone gives the same q row and cache rows
    if T > 1:
        kc4, vc4 = kc.clone(), vc.clone()
        q4 = E.rmsnorm_qkv_rope(x[:1], nw, W, 1e-5, pos[:1], slots[:1], cos, sin, kc4, vc4, heads, kv_heads, **tile)
        assert torch.equal(q4[0], q[0]) and torch.equal(kc4[:, slots[0]], kc[:, slots[0]])


def test_qkv_rope_out_of_range_position_writes_nothing():
    g = torch.Generator().manual_seed(1)
    x, nw, W = rnd(g, 2, 32), rnd(g, 32), rnd(g, (2 + 2) * 16, 32, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(8, 16, 10000.0))
    kc, vc = torch.zeros(1, 4, 16, dtype=BF, device=DEV), torch.zeros(1, 4, 16, dtype=BF, device=DEV)
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, torch.tensor([3, 99], device=DEV), torch.tensor([1, 2], device=DEV),
                           cos, sin, kc, vc, 2, 1)
    assert q[1].isnan().all() and not q[0].isnan().any()
    assert kc[0, 2].eq(0).all() and vc[0, 2].eq(0).all() and kc[0, 1].ne(0).any()


@pytest.mark.parametrize("T", [1, 6, 20])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_glu_equals_projection_then_swiglu(T, residual, row_tile):
    g = torch.Generator().manual_seed(T + 100 * residual)
    x, nw, W = rnd(g, T, 48), rnd(g, 48), rnd(g, 2 * 40, 48, scale=0.1)
    r = rnd(g, T, 48) if residual else None
    got = E.rmsnorm_glu(x, nw, W, 1e-5, r, block_n=16, row_tile=row_tile)
    want = K.rmsnorm_linear(x, nw, W, 1e-5, r, block_n=16, row_tile=row_tile)
    if residual:
        assert torch.equal(got[0], K.swiglu(want[0])) and torch.equal(got[1], want[1])
        ref = E.rmsnorm_glu_ref(x, nw, W, 1e-5, r)[0]
        got = got[0]
    else:
        assert torch.equal(got, K.swiglu(want))
        ref = E.rmsnorm_glu_ref(x, nw, W, 1e-5)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_wrappers_refuse_bad_shapes():
    g = torch.Generator().manual_seed(2)
    x, nw = rnd(g, 2, 32), rnd(g, 32)
    with pytest.raises(ValueError, match="multiple of 2 rows"):
        E.rmsnorm_glu(x, nw, rnd(g, 33, 32), 1e-5)
    cos, sin = (t.to(DEV) for t in K.rope_tables(8, 16, 10000.0))
    kc = torch.zeros(1, 4, 16, dtype=BF, device=DEV)
    pos = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="need 64"):
        E.rmsnorm_qkv_rope(x, nw, rnd(g, 60, 32), 1e-5, pos, pos, cos, sin, kc, kc.clone(), 2, 1)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        E.rmsnorm_qkv_rope(x, nw, rnd(g, 64, 32), 1e-5, pos, pos, cos, sin, kc, kc.clone(), 3, 2)
