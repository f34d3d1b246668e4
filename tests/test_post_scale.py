"""post_scale (RMSNormLinearParams): the producer (gemm.linear's epilogue) also stores its rows times the norm weight
of the launch that reads them next, and that launch projects those rows as a plain projection does, then scales
each row's accumulator by rstd from the producer's segment sums (rmsnorm.py, producer statistics).

Its bits: the producer's scaled rows equal rmsnorm.scaled_rows_ref whatever its tile, split-K or T; each norm
launch with it gives a row the same bits whatever T (every epilogue), within a rounding of post_scale_ref; an
engine with it verifies exactly what it decodes (tests/test_row_sumsq.py, the engine test). Under the Triton
interpreter on CPU; compiled on a GPU.
"""
from __future__ import annotations

import pytest
import torch
from test_row_sumsq import BF, DEV, one_row_at_a_time, rnd

import specpilot.kernels as K
from specpilot.kernels import norm_epilogues as E
from specpilot.kernels.rmsnorm import post_scale_ref, row_sumsq_ref, scaled_rows_ref


@pytest.mark.parametrize("T,split_k", [(1, 1), (7, 2), (17, 1)])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_a_producer_stores_its_rows_times_the_norm_weight_whatever_its_tile(T, row_tile, split_k):
    g = torch.Generator().manual_seed(T + 3 * split_k)
    K_in, N = 96, 64
    x, W, r, nw = rnd(g, T, K_in), rnd(g, N, K_in, scale=0.1), rnd(g, T, N), rnd(g, N)
    plain = K.linear(x, W, r, block_k=32, row_tile=row_tile, split_k=split_k)
    for block_n in (16, 64):
        sums, scaled = torch.full((T, N // 16), float("nan"), device=DEV), torch.empty(T, N, dtype=BF, device=DEV)
        y = K.linear(x, W, r, block_n=block_n, block_k=32, row_tile=row_tile, split_k=split_k, row_sumsq_out=sums,
                     scale_w=nw, scaled_out=scaled)
        assert torch.equal(y, plain) and torch.equal(sums, row_sumsq_ref(y)), block_n
        assert torch.equal(scaled, scaled_rows_ref(y, nw)), block_n


def test_a_w12_producer_stores_the_same_scaled_rows():
    from specpilot.weights.format import encode
    g = torch.Generator().manual_seed(5)
    x, W, nw = rnd(g, 3, 64), rnd(g, 48, 64, scale=0.1), rnd(g, 48)
    a, b = (torch.empty(3, 48, dtype=BF, device=DEV) for _ in range(2))
    y = K.linear(x, W, block_n=16, block_k=32, scale_w=nw, scaled_out=a)
    y12 = K.linear(x, encode(W), block_n=16, block_k=32, scale_w=nw, scaled_out=b)
    assert torch.equal(y, y12) and torch.equal(a, b)


def inputs(g, T, K_in):
    h, nw = rnd(g, T, K_in), rnd(g, K_in)
    return h, nw, row_sumsq_ref(h), scaled_rows_ref(h, nw)


@pytest.mark.parametrize("row_tile", K.ROW_TILES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_a_post_scale_launch_gives_each_row_the_same_bits_whatever_T(row_tile, split_k):
    g = torch.Generator().manual_seed(40 + row_tile + split_k)
    T, K_in, N = 9, 80, 48
    h, nw, sums, scaled = inputs(g, T, K_in)
    W = rnd(g, N, K_in, scale=0.1)
    kw = {"block_k": 32, "block_n": 16, "row_tile": row_tile, "split_k": split_k, "producer_stat": True,
          "post_scale": True}

    def head(rows, s, x_scaled):
        return K.rmsnorm_linear(rows, nw, W, 1e-5, out_dtype=torch.float32, argmax=True, row_sumsq=s,
                                scaled_x=x_scaled, **kw)

    logits, best = head(h, sums, scaled)
    rows = [head(h[i:i + 1], sums[i:i + 1].contiguous(), scaled[i:i + 1]) for i in range(T)]
    assert torch.equal(logits, torch.cat([r[0] for r in rows])) and torch.equal(best, logits.argmax(-1))
    torch.testing.assert_close(logits, post_scale_ref(h, nw, W, 1e-5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_the_epilogue_launches_with_post_scale_are_t_invariant(row_tile):
    g = torch.Generator().manual_seed(60 + row_tile)
    T, heads, kv_heads, D, K_in = 6, 4, 2, 16, 64
    h, nw, sums, scaled = inputs(g, T, K_in)
    W = rnd(g, (heads + 2 * kv_heads) * D, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(64, D, 10000.0))
    pos = torch.arange(T, device=DEV) * 3
    kw = {"block_n": 16, "block_k": 32, "row_tile": row_tile, "producer_stat": True, "post_scale": True}

    def qkv(at):
        caches = [torch.zeros(kv_heads, 8, D, dtype=BF, device=DEV) for _ in range(2)]
        q = E.rmsnorm_qkv_rope(h[at].contiguous(), nw, W, 1e-5, pos[at], at, cos, sin, *caches, heads, kv_heads,
                               row_sumsq=sums[at].contiguous(), scaled_x=scaled[at].contiguous(), **kw)
        return q, caches

    q, caches = qkv(torch.arange(T, device=DEV))
    for i in range(T):
        qi, ci = qkv(torch.tensor([i], device=DEV))
        assert torch.equal(qi[0], q[i]) and all(torch.equal(a[:, i], b[:, i]) for a, b in zip(ci, caches)), i
    Wg = rnd(g, 2 * 24, K_in, scale=0.1)
    act = E.rmsnorm_glu(h, nw, Wg, 1e-5, row_sumsq=sums, scaled_x=scaled, **kw)
    assert torch.equal(act, one_row_at_a_time(
        lambda r, s: E.rmsnorm_glu(r, nw, Wg, 1e-5, row_sumsq=s, scaled_x=scaled_rows_ref(r, nw), **kw), h, sums))
    want = post_scale_ref(h, nw, Wg, 1e-5)
    ref_act = (torch.nn.functional.silu(want[:, :24].to(BF).float()) * want[:, 24:].to(BF).float()).to(BF)
    torch.testing.assert_close(act.float(), ref_act.float(), atol=2e-2, rtol=2e-2)


def test_bad_post_scale_inputs_are_refused_with_the_reason():
    x = torch.zeros(2, 32, dtype=BF, device=DEV)
    W = torch.zeros(16, 32, dtype=BF, device=DEV)
    sums = torch.zeros(2, 2, device=DEV)
    stat = {"producer_stat": True, "row_sumsq": sums}
    cases = [({"post_scale": True, "scaled_x": x}, "needs producer_stat"),
             ({**stat, "post_scale": True}, "needs scaled_x"),
             ({**stat, "scaled_x": x}, "only with post_scale"),
             ({**stat, "post_scale": True, "scaled_x": x[:1].contiguous()}, "\\[2, 32\\]"),
             ({**stat, "post_scale": True, "scaled_x": x.float()}, "bfloat16"),
             ({**stat, "post_scale": True, "prenorm": True, "scaled_x": x}, "prenorm=False")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.rmsnorm_linear(x, x[0], W, 1e-5, **kw)
    with pytest.raises(ValueError, match="go together"):
        K.linear(x, W, scale_w=W[:, 0].contiguous())
    with pytest.raises(ValueError, match="scaled_out"):
        K.linear(x, W, scale_w=W[:, 0].contiguous(), scaled_out=torch.empty(2, 8, dtype=BF, device=DEV))
    with pytest.raises(ValueError, match="needs producer_stat"):
        K.RMSNormLinearParams(post_scale=True)
    assert "post_scale" not in K.RMSNormLinearParams.T_NEUTRAL  # another rounding: one value for every T
    assert "post_scale" not in K.RMSNormLinearParams.SEARCH_SPACE  # needs the producer: judged on the step
