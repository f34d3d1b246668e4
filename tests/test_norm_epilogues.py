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
@pytest.mark.parametrize("act_prefetch", [1, 2])  # 2: the rotary inputs are loaded before the K loop
def test_qkv_rope_equals_projection_then_rope(heads, kv_heads, head_dim, T, row_tile, act_prefetch):
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
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, kc, vc, heads, kv_heads, act_prefetch=act_prefetch,
                           **tile)
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


@pytest.mark.parametrize("block_n,split_k", [(32, 1), (32, 2), (16, 2)])
def test_qkv_rope_tiles_hold_rotary_pairs(block_n, split_k):
    # a tile holds half-head column runs and their partners (norm_gemm._rope_tile_cols): one head per tile at
    # block_n = head_dim, two runs of a head's halves at 16; split-K sums the same chains in split order
    g = torch.Generator().manual_seed(block_n + split_k)
    T, heads, kv_heads, D, K_in = 3, 4, 2, 32, 256
    x, nw, W = rnd(g, T, K_in), rnd(g, K_in), rnd(g, (heads + 2 * kv_heads) * D, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(64, D, 10000.0))
    pos, slots = torch.tensor([5, 0, 63], device=DEV), torch.tensor([2, 7, 4], device=DEV)
    kc, vc = rnd(g, kv_heads, 8, D), rnd(g, kv_heads, 8, D)
    kc2, vc2 = kc.clone(), vc.clone()
    tile = {"block_n": block_n, "split_k": split_k, "block_k": 64}
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, kc, vc, heads, kv_heads, **tile)
    q2 = K.rope_kv_write(K.rmsnorm_linear(x, nw, W, 1e-5, **tile), pos, slots, cos, sin, kc2, vc2, heads, kv_heads)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(ValueError, match="block_n=64 exceeds 32"):
        E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, kc, vc, heads, kv_heads, block_n=64)


@pytest.mark.parametrize("act_prefetch", [0, 2])
def test_qkv_rope_out_of_range_position_writes_nothing(act_prefetch):
    g = torch.Generator().manual_seed(1)
    x, nw, W = rnd(g, 2, 32), rnd(g, 32), rnd(g, (2 + 2) * 16, 32, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(8, 16, 10000.0))
    kc, vc = torch.zeros(1, 4, 16, dtype=BF, device=DEV), torch.zeros(1, 4, 16, dtype=BF, device=DEV)
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, torch.tensor([3, 99], device=DEV), torch.tensor([1, 2], device=DEV),
                           cos, sin, kc, vc, 2, 1, act_prefetch=act_prefetch)
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


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_launches_keep_the_epilogues_rows_and_counters(split_k):
    """split_k (gemm.split_k_combine): each fused epilogue still equals its unfused pair at the same split, a token's
    row is the same alone or among 17, results are near the unsplit ones, and the arrival counters end at zero."""
    from specpilot.kernels._common import arrival_counters
    g = torch.Generator().manual_seed(split_k)
    T, K_in, heads, kv_heads, hd = 17, 256, 4, 2, 16
    sk = {"block_n": 16, "block_k": 64, "split_k": split_k}
    x, nw, res = rnd(g, T, K_in), rnd(g, K_in), rnd(g, T, K_in)
    W = rnd(g, (heads + 2 * kv_heads) * hd, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(128, hd, 10000.0))
    pos, slots = torch.randint(0, 100, (T,), generator=g).to(DEV), torch.randperm(40, generator=g)[:T].to(DEV)
    kc, vc = rnd(g, kv_heads, 40, hd), rnd(g, kv_heads, 40, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, kc, vc, heads, kv_heads, **sk)
    q2 = K.rope_kv_write(K.rmsnorm_linear(x, nw, W, 1e-5, **sk), pos, slots, cos, sin, kc2, vc2, heads, kv_heads)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    act, h = E.rmsnorm_glu(x, nw, W, 1e-5, res, **sk)
    y, h2 = K.rmsnorm_linear(x, nw, W, 1e-5, res, **sk)
    assert torch.equal(act, K.swiglu(y)) and torch.equal(h, h2) and torch.equal(h, x + res)
    act1, _ = E.rmsnorm_glu(x[5:6], nw, W, 1e-5, res[5:6], **sk)
    assert torch.equal(act1[0], act[5])
    logits, best = K.rmsnorm_linear(x, nw, W, 1e-5, out_dtype=torch.float32, argmax=True, **sk)
    assert torch.equal(best, logits.argmax(-1))
    torch.testing.assert_close(logits, K.rmsnorm_linear(x, nw, W, 1e-5, out_dtype=torch.float32), atol=1e-2, rtol=1e-2)
    W2, r2 = rnd(g, 48, K_in, scale=0.1), rnd(g, T, 48)
    o, o1 = K.linear(x, W2, r2, **sk), K.linear(x[5:6], W2, r2[5:6], **sk)
    assert torch.equal(o1[0], o[5])
    torch.testing.assert_close(o.float(), K.linear_ref(x, W2, r2).float(), atol=3e-2, rtol=2e-2)
    assert int(arrival_counters(DEV).abs().sum()) == 0


def test_split_k_is_refused_when_it_cannot_run():
    g = torch.Generator().manual_seed(0)
    x, nw, W = rnd(g, 2, 128), rnd(g, 128), rnd(g, 32, 128)
    with pytest.raises(ValueError, match="exceeds the 2 K chunks"):
        K.linear(x, W, block_k=64, split_k=4)
    with pytest.raises(ValueError, match="split_k=3"):
        K.rmsnorm_linear(x, nw, W, 1e-5, split_k=3)
    from specpilot.weights.format import encode
    x576, W576 = rnd(g, 2, 576), rnd(g, 32, 576)  # W12 split-K runs hold whole 256-blocks: 5 chunks in 2 runs do not
    with pytest.raises(ValueError, match="whole 256-element blocks"):
        K.linear(x576, encode(W576), split_k=2)


def test_split_k_launches_chunk_long_token_counts_without_changing_a_bit(monkeypatch):
    """A split-K launch covers at most SPLIT_K_ROWS rows (prefill widths would otherwise need a workspace and
    counters per row tile): a long T runs in row chunks, and every row equals that row computed alone."""
    from specpilot.kernels import gemm
    monkeypatch.setattr(gemm, "SPLIT_K_ROWS", 8)
    g = torch.Generator().manual_seed(11)
    T, K_in, heads, kv_heads, hd = 21, 128, 2, 1, 16
    sk = {"block_n": 16, "block_k": 64, "split_k": 2}
    x, nw, res = rnd(g, T, K_in), rnd(g, K_in), rnd(g, T, K_in)
    W = rnd(g, (heads + 2 * kv_heads) * hd, K_in, scale=0.1)
    cos, sin = (t.to(DEV) for t in K.rope_tables(64, hd, 10000.0))
    pos, slots = torch.arange(T).to(DEV), torch.arange(T).to(DEV)
    kc, vc = torch.zeros(kv_heads, 32, hd, dtype=BF, device=DEV), torch.zeros(kv_heads, 32, hd, dtype=BF, device=DEV)
    q = E.rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, slots, cos, sin, kc, vc, heads, kv_heads, **sk)
    act, h = E.rmsnorm_glu(x, nw, W, 1e-5, res, **sk)
    logits, best = K.rmsnorm_linear(x, nw, W, 1e-5, out_dtype=torch.float32, argmax=True, **sk)
    o = K.linear(x, W, res[:, :W.shape[0]].contiguous(), **sk)
    for r in (0, 9, 20):  # first, middle and last chunk
        kc1, vc1 = torch.zeros_like(kc), torch.zeros_like(vc)
        q1 = E.rmsnorm_qkv_rope(x[r:r + 1], nw, W, 1e-5, pos[r:r + 1], slots[r:r + 1], cos, sin, kc1, vc1, heads,
                                kv_heads, **sk)
        assert torch.equal(q1[0], q[r]) and torch.equal(kc1[:, r], kc[:, r]) and torch.equal(vc1[:, r], vc[:, r])
        a1, h1 = E.rmsnorm_glu(x[r:r + 1], nw, W, 1e-5, res[r:r + 1], **sk)
        assert torch.equal(a1[0], act[r]) and torch.equal(h1[0], h[r])
        l1, b1 = K.rmsnorm_linear(x[r:r + 1], nw, W, 1e-5, out_dtype=torch.float32, argmax=True, **sk)
        assert torch.equal(l1[0], logits[r]) and int(b1[0]) == int(best[r])
        assert torch.equal(K.linear(x[r:r + 1], W, res[r:r + 1, :W.shape[0]].contiguous(), **sk)[0], o[r])
    assert torch.equal(best, logits.argmax(-1))


def test_max_registers_reaches_every_projection_launch(monkeypatch):
    """max_registers (LinearParams / RMSNormLinearParams) goes to each projection launch as ptxas's maxnreg, and only
    when set; a cap moves registers, not arithmetic: the same bits (on a GPU a real cap, under the interpreter the
    launch option alone). tests/test_kernel_codegen.py checks that ptxas honours it."""
    from specpilot.kernels import gemm, norm_gemm
    seen = []
    for kern in (gemm._linear_kernel, norm_gemm._rmsnorm_linear_kernel):
        def spy(*args, _run=type(kern).run, _k=kern, **kw):
            seen.append(kw.get("maxnreg"))
            return _run(_k, *args, **kw)
        monkeypatch.setattr(kern, "run", spy, raising=False)
    g = torch.Generator().manual_seed(3)
    T, heads, kv_heads, D, K_in = 2, 2, 1, 16, 64
    x, nw, gu = rnd(g, T, K_in), rnd(g, K_in), rnd(g, T, 2 * K_in)
    W, Wqkv, Wgu = rnd(g, 32, K_in, scale=0.1), rnd(g, (heads + 2 * kv_heads) * D, K_in, scale=0.1), rnd(g, 64, K_in)
    cos, sin = (t.to(DEV) for t in K.rope_tables(16, D, 10000.0))
    pos, slots = torch.tensor([1, 3], device=DEV), torch.tensor([0, 2], device=DEV)
    caches = lambda: [torch.zeros(kv_heads, 4, D, dtype=BF, device=DEV) for _ in "kv"]  # noqa: E731
    calls = {"linear": lambda **p: K.linear(x, W, **p), "swiglu_linear": lambda **p: K.swiglu_linear(gu, W, **p),
             "rmsnorm_linear": lambda **p: K.rmsnorm_linear(x, nw, W, 1e-5, **p),
             "rmsnorm_glu": lambda **p: E.rmsnorm_glu(x, nw, Wgu, 1e-5, **p),
             "rmsnorm_qkv_rope": lambda **p: E.rmsnorm_qkv_rope(x, nw, Wqkv, 1e-5, pos, slots, cos, sin, *caches(),
                                                                heads, kv_heads, **p)}
    for name, call in calls.items():
        seen.clear()
        base = call()
        assert seen == [None], (name, seen)
        seen.clear()
        assert torch.equal(call(max_registers=128), base), name
        assert seen == [128], (name, seen)
    with pytest.raises(ValueError, match="max_registers"):
        K.linear(x, W, max_registers=16)
    with pytest.raises(ValueError, match="max_registers"):
        K.rmsnorm_linear(x, nw, W, 1e-5, max_registers=True)
    assert "max_registers" in K.LinearParams.T_NEUTRAL and "max_registers" in K.RMSNormLinearParams.SEARCH_SPACE
