"""Projections in 32-row tiles (tile_rows, T-neutral): every launch kind gives the bits of its 16-row tiles.

A program then reads each W chunk once for two 16-row slabs (at T=128 the LM head's W is read from L2 four times
instead of eight). On the GPU the bits rest on the same MMA v2 dots (tests/test_kernel_codegen.py); here the
interpreted kernels check the tiling itself: ragged last tiles, split-K partials, the norm statistic, the epilogues.
"""
from __future__ import annotations

import pytest
import torch

import specpilot.kernels as K
from specpilot.kernels import norm_epilogues as E
from specpilot.kernels.rmsnorm import row_sumsq_ref
from specpilot.weights import encode

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF = torch.bfloat16
T = 40  # one full 32-row tile and a ragged one (two full 16-row tiles and a ragged one)


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF).to(DEV)


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a is None and b is None or torch.equal(a, b)


@pytest.mark.parametrize("split_k", [1, 2])
def test_linear_and_swiglu_linear(split_k):
    g = torch.Generator().manual_seed(31 + split_k)
    x, gu = rnd(g, T, 256), rnd(g, T, 512)
    W, res, bias = rnd(g, 96, 256, scale=0.06), rnd(g, T, 96), rnd(g, 96)
    for fn, args in ((K.linear, (x, W, res)), (K.swiglu_linear, (gu, W, res))):
        base = fn(*args, bias=bias, split_k=split_k, block_n=32)
        for bn in (32, 64):
            assert same(fn(*args, bias=bias, split_k=split_k, block_n=bn, tile_rows=32), base), (fn.__name__, bn)
    # and the producer's statistics and scaled rows (a norm launch reads them next)
    sums16, sums32 = (torch.zeros(T, 96 // 16, device=DEV) for _ in range(2))
    y16 = K.linear(x, W, res, row_sumsq_out=sums16, split_k=split_k)
    y32 = K.linear(x, W, res, row_sumsq_out=sums32, split_k=split_k, tile_rows=32)
    assert same(y32, y16) and same(sums32, sums16)


@pytest.mark.parametrize("producer_stat", [False, True])
def test_norm_linear_head_glu_and_qkv_rope(producer_stat):
    g = torch.Generator().manual_seed(5 + producer_stat)
    Kin, N = 128, 96
    x, nw, W = rnd(g, T, Kin), rnd(g, Kin), rnd(g, N, Kin, scale=0.1)
    stat = {"producer_stat": True, "row_sumsq": row_sumsq_ref(x)} if producer_stat else {}
    # the LM head: float32 logits and the argmax partials, and split-K
    for kw in ({"out_dtype": torch.float32, "argmax": True}, {"split_k": 2, "block_k": 64}, {"block_k": 64}):
        base = K.rmsnorm_linear(x, nw, W, 1e-5, block_n=32, **kw, **stat)
        assert same(K.rmsnorm_linear(x, nw, W, 1e-5, block_n=32, tile_rows=32, **kw, **stat), base), kw
    r = None if producer_stat else rnd(g, T, Kin)
    glu = [E.rmsnorm_glu(x, nw, W, 1e-5, r, block_n=16, tile_rows=rows, **stat) for rows in (16, 32)]
    assert same(glu[0], glu[1])
    heads, kvh, D = 4, 1, 16
    Wq = rnd(g, (heads + 2 * kvh) * D, Kin, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(128, D, 10000.0))
    pos, slots = torch.randint(0, 100, (T,), generator=g).to(DEV), torch.randperm(64, generator=g)[:T].to(DEV)
    outs = []
    for rows in (16, 32):
        kc, vc = torch.zeros(kvh, 64, D, dtype=BF, device=DEV), torch.zeros(kvh, 64, D, dtype=BF, device=DEV)
        q = E.rmsnorm_qkv_rope(x, nw, Wq, 1e-5, pos, slots, cos, sin, kc, vc, heads, kvh, tile_rows=rows, **stat)
        outs.append((q, kc, vc))
    assert same(outs[0], outs[1])


def test_tile_rows_is_checked():
    assert "tile_rows" in K.LinearParams.T_NEUTRAL and "tile_rows" in K.RMSNormLinearParams.T_NEUTRAL
    for cls in (K.LinearParams, K.RMSNormLinearParams):
        with pytest.raises(ValueError, match="tile_rows"):
            cls(tile_rows=64)  # 64-row tiles compile to wgmma: other bits
        with pytest.raises(ValueError, match="row_tile=1"):
            cls(row_tile=1, tile_rows=32)
        assert cls(tile_rows=32).program_rows() == 32 and cls(row_tile=1).program_rows() == 1
    g = torch.Generator().manual_seed(0)
    x, W = rnd(g, 2, 256), rnd(g, 32, 256)
    with pytest.raises(ValueError, match="tile_rows=16"):
        K.linear(x, encode(W), tile_rows=32)  # a W12Tensor, laid out by the call


def test_table_variant_sets_one_t_and_keeps_the_table_checked(tmp_path, monkeypatch):
    """scripts/table_variant.py, which writes the tables with 32-row entries: KERNEL@T touches that T's entry only;
    an order-setting field at one T is refused (check_invariance)."""
    import json

    from specpilot.kernels.table import InvarianceError
    monkeypatch.syspath_prepend("scripts")
    import table_variant

    base = tmp_path / "base.json"
    base.write_text(json.dumps([["lm_head@49152x576@T1", '{"producer_stat": true}'],
                                ["lm_head@49152x576@T128", '{"producer_stat": true, "block_n": 128}']]))
    out = tmp_path / "v.json"
    assert table_variant.main([str(out), "--shape", "smollm2-135m", "--base", str(base),
                               "--set", "lm_head@128:tile_rows=32"]) == 0
    got = {k: json.loads(v) for k, v in json.loads(out.read_text())}
    assert got == {"lm_head@49152x576@T1": {"producer_stat": True},
                   "lm_head@49152x576@T128": {"producer_stat": True, "block_n": 128, "tile_rows": 32}}
    with pytest.raises(InvarianceError):
        table_variant.main([str(out), "--shape", "smollm2-135m", "--base", str(base), "--set", "lm_head@128:split_k=2"])
    # a whole deployment's table as the base
    assert table_variant.main([str(out), "--shape", "smollm2-135m", "--deployment", "smollm2-135m-h200",
                               "--set", "attention@128:num_warps=8"]) == 0
    assert json.loads(dict(json.loads(out.read_text()))["attention@576x192@T128"]) == {"tile_rows": 32, "num_warps": 8}
