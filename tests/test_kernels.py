"""Tests of specpilot.kernels: each kernel against its torch reference, batch invariance, wrapper errors, acceptance.

Without CUDA the kernels run under the Triton interpreter (tests/conftest.py turns it on before triton is first
imported). With CUDA the same tests run the compiled kernels, plus GPU-only checks that the launch parameters
declared T-neutral change no bit.
"""
from __future__ import annotations

import random

import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402

import specpilot.kernels as K  # noqa: E402


DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def rnd(gen: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def poisoned(*shape: int, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "output has unwritten (NaN) or non-finite elements"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def anc_from_parents(parents: list[int]) -> torch.Tensor:
    T = len(parents)
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j != -1:
            anc[i, j] = True
            j = parents[j]
    return anc.to(DEV)


def random_tree(rng: random.Random, T: int) -> list[int]:
    return [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, T)]


TOKENS = [1, 3, 16, 17, 40]
INVARIANCE_CALLS = [(5, 3), (16, 15), (40, 22)]  # (T of the call, index of the row under test)
ROW_AT = {1: 0, **dict(INVARIANCE_CALLS)}


# ---------------------------------------------------------------- linear / swiglu_linear / swiglu

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("N,Kd,extras", [(64, 64, ""), (96, 128, "res"), (97, 256, "res+bias"), (50, 96, "fp32out")])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_linear_matches_ref(dtype, T, N, Kd, extras, row_tile):
    g = torch.Generator().manual_seed(T * 1000 + N)
    x, W = rnd(g, T, Kd, dtype=dtype), rnd(g, N, Kd, dtype=dtype, scale=Kd ** -0.5)
    out_dtype = torch.float32 if extras == "fp32out" else dtype
    res = rnd(g, T, N, dtype=out_dtype) if "res" in extras else None
    bias = rnd(g, N, dtype=dtype) if "bias" in extras else None
    out = poisoned(T, N, dtype=out_dtype)
    y = K.linear(x, W, res, bias=bias, out_dtype=out_dtype, out=out, row_tile=row_tile)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, K.linear_ref(x, W, res, bias=bias, out_dtype=out_dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 17, 40])
def test_swiglu_linear_matches_ref_and_unfused_bits(dtype, T):
    g = torch.Generator().manual_seed(T)
    gu, W, res = rnd(g, T, 2 * 160, dtype=dtype), rnd(g, 33, 160, dtype=dtype, scale=0.1), rnd(g, T, 33, dtype=dtype)
    y = K.swiglu_linear(gu, W, res, out=poisoned(T, 33, dtype=dtype))
    assert_close(y, K.swiglu_linear_ref(gu, W, res), dtype)
    assert torch.equal(y, K.linear(K.swiglu(gu), W, res)), "fused prologue must round like the separate swiglu"


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("T,I", [(1, 64), (3, 1500), (40, 96)])
def test_swiglu_matches_ref(dtype, T, I):
    g = torch.Generator().manual_seed(I)
    gu = rnd(g, T, 2 * I, dtype=dtype, scale=3.0)
    y = K.swiglu(gu, out=poisoned(T, I, dtype=dtype), block_i=256)
    ref = K.swiglu_ref(gu)
    assert torch.isfinite(y).all()
    # elementwise with torch's roundings: bf16/fp16 at most one ulp apart (where exp's last fp32 bits tip a
    # rounding); fp32 within 1e-5 relative (the GPU's exp is approximate)
    rel = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    bound = rel * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((y.float() - ref.float()).abs() <= bound * 1.01).all()


# ---------------------------------------------------------------- rmsnorm_linear

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("N,Kd,extras", [(96, 64, ""), (97, 192, "res"), (64, 128, "bias+fp32out")])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_rmsnorm_linear_matches_ref(dtype, T, N, Kd, extras, row_tile):
    g = torch.Generator().manual_seed(T * 7 + N)
    x, nw = rnd(g, T, Kd, dtype=dtype, scale=3.0), (1 + rnd(g, Kd, scale=0.2)).to(dtype)
    W = rnd(g, N, Kd, dtype=dtype, scale=Kd ** -0.5)
    bias = rnd(g, N, dtype=dtype) if "bias" in extras else None
    out_dtype = torch.float32 if "fp32out" in extras else dtype
    out = poisoned(T, N, dtype=out_dtype)
    if "res" in extras:
        res = rnd(g, T, Kd, dtype=dtype)
        y, h = K.rmsnorm_linear(x, nw, W, 1e-5, res, out=out, residual_out=poisoned(T, Kd, dtype=dtype),
                                row_tile=row_tile)
        y_ref, h_ref = K.rmsnorm_linear_ref(x, nw, W, 1e-5, res)
        assert torch.equal(h, h_ref), "the new residual stream is x + residual rounded once"
    else:
        y = K.rmsnorm_linear(x, nw, W, 1e-5, bias=bias, out_dtype=out_dtype, out=out, row_tile=row_tile)
        y_ref = K.rmsnorm_linear_ref(x, nw, W, 1e-5, bias=bias, out_dtype=out_dtype)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, y_ref, dtype)


# ---------------------------------------------------------------- rope + KV write

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,KVH,D", [(1, 4, 4, 32), (3, 6, 2, 16), (16, 3, 1, 64), (17, 4, 4, 16), (40, 6, 2, 16)])
def test_rope_kv_write_matches_ref(dtype, T, H, KVH, D):
    g = torch.Generator().manual_seed(T + D)
    S, max_pos = 64, 500
    cos, sin = (t.to(DEV) for t in K.rope_tables(max_pos, D, 10000.0))
    qkv = rnd(g, T, (H + 2 * KVH) * D, dtype=dtype)
    pos = torch.randint(0, max_pos, (T,), generator=g).to(DEV)
    slots = torch.randperm(S, generator=g)[:T].to(DEV)
    kc, vc = poisoned(KVH, S, D, dtype=dtype), poisoned(KVH, S, D, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    q = K.rope_kv_write(qkv, pos, slots, cos, sin, kc, vc, H, KVH, out=poisoned(T, H, D, dtype=dtype))
    q_ref = K.rope_kv_write_ref(qkv, pos, slots, cos, sin, kr, vr, H, KVH)
    assert_close(q, q_ref, dtype)
    written = torch.zeros(S, dtype=torch.bool, device=DEV)
    written[slots] = True
    for cache, ref in ((kc, kr), (vc, vr)):
        assert torch.isfinite(cache[:, written]).all() and torch.isnan(cache[:, ~written]).all(), "stray cache write"
        assert_close(cache[:, written], ref[:, written], dtype)
    assert torch.equal(vc[:, written], vr[:, written]), "v is copied, not rounded"


def test_rope_matches_transformers_convention():
    """q rotated at position p equals the rotate_half formula with cos/sin of p * theta^(-2i/D)."""
    D, H = 8, 1
    cos, sin = K.rope_tables(16, D, 10000.0)
    x = torch.arange(1.0, 1.0 + 3 * D).reshape(1, 3 * D)  # q, k, v of one head each
    kc, vc = torch.zeros(1, 4, D), torch.zeros(1, 4, D)
    q = K.rope_kv_write_ref(x, torch.tensor([5]), torch.tensor([2]), cos, sin, kc, vc, H, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    c, s = torch.cos(5 * inv), torch.sin(5 * inv)
    x1, x2 = x[0, : D // 2], x[0, D // 2:D]
    assert torch.allclose(q[0, 0], torch.cat([x1 * c - x2 * s, x2 * c + x1 * s]), atol=1e-5)
    assert torch.equal(vc[0, 2], x[0, 2 * D:])


def test_rope_bad_position_or_slot_poisons_q_and_writes_nothing():
    g = torch.Generator().manual_seed(3)
    cos, sin = (t.to(DEV) for t in K.rope_tables(32, 16, 10000.0))
    qkv = rnd(g, 3, 4 * 16)
    kc, vc = poisoned(1, 8, 16, dtype=torch.float32), poisoned(1, 8, 16, dtype=torch.float32)
    pos = torch.tensor([1, 99, 2], device=DEV)
    slots = torch.tensor([0, 1, 8], device=DEV)
    q = K.rope_kv_write(qkv, pos, slots, cos, sin, kc, vc, 2, 1)
    assert torch.isfinite(q[0]).all() and torch.isnan(q[1:]).all()
    assert torch.isfinite(kc[:, 0]).all() and torch.isnan(kc[:, 1:]).all() and torch.isnan(vc[:, 1:]).all()
    with pytest.raises(ValueError, match="positions"):
        K.rope_kv_write_ref(qkv, pos, slots.clamp_max(7), cos, sin, kc, vc, 2, 1)
    with pytest.raises(ValueError, match="slots"):
        K.rope_kv_write_ref(qkv, pos.clamp_max(31), slots, cos, sin, kc, vc, 2, 1)


# ---------------------------------------------------------------- attention

ATTN_CASES = [  # T, heads, kv_heads, D, base, tree?, split_keys, block_n
    (1, 4, 4, 16, 1, False, 64, 64),
    (1, 6, 2, 32, 100, False, 256, 64),
    (3, 6, 2, 32, 37, True, 64, 32),
    (16, 3, 1, 16, 64, True, 64, 64),
    (17, 4, 4, 64, 5, True, 64, 32),
    (40, 6, 2, 16, 100, True, 64, 64),
    (40, 4, 4, 16, 63, False, 256, 64),
    (5, 6, 2, 16, 300, True, 256, 64),
    (3, 2, 1, 16, 1100, True, 16, 16),  # 69 splits: the combine's multi-group loops (<= 64: one round of loads)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,KVH,D,base,tree,split,bn", ATTN_CASES)
def test_attention_matches_ref(dtype, T, H, KVH, D, base, tree, split, bn):
    g = torch.Generator().manual_seed(T * 31 + base)
    rng = random.Random(T + base)
    S = base + T + 24
    kc, vc = rnd(g, KVH, S, D, dtype=dtype), rnd(g, KVH, S, D, dtype=dtype)
    kc[:, base + T:] = float("nan")  # never read: only keys 0 .. base+T-1 exist
    vc[:, base + T:] = float("nan")
    q = rnd(g, T, H, D, dtype=dtype, scale=2.0)
    anc = anc_from_parents(random_tree(rng, T) if tree else list(range(-1, T - 1)))
    o = K.attention(q, kc, vc, base, anc, out=poisoned(T, H * D, dtype=dtype), split_keys=split, block_n=bn)
    assert_close(o, K.attention_ref(q, kc, vc, base, anc), dtype)
    o_dev_base = K.attention(q, kc, vc, torch.tensor([base], device=DEV), anc, split_keys=split, block_n=bn)
    assert torch.equal(o, o_dev_base), "a device-side base must give the same bits as an int base"


@pytest.mark.parametrize("T,base,window,split,bn", [
    (16, 300, 100, 64, 64),  # the window starts mid key block, 4 splits wholly below it
    (16, 300, 256, 64, 32),
    (4, 130, 64, 256, 64),  # one split holds both sides of the window's start
    (16, 40, 200, 64, 64),  # a window longer than the context: everything visible
    (1, 1100, 17, 16, 16),  # 69 splits, all but two below the window
    (16, 300, 49, 64, 64),  # window + T - 1 a whole split: the grid's widest reach (3 splits from the window's first)
])
def test_windowed_attention_sees_the_last_window_keys_only(T, base, window, split, bn):
    """The block drafter's context window: keys below base - window are neither visible nor read (NaN there)."""
    g = torch.Generator().manual_seed(base + window)
    KVH, H, D, dtype = 2, 6, 16, torch.bfloat16
    S = base + T + 8
    kc, vc = rnd(g, KVH, S, D, dtype=dtype), rnd(g, KVH, S, D, dtype=dtype)
    lo = max(0, base - window) // bn * bn  # the first key block the window reaches is read whole
    for c in (kc, vc):
        c[:, :lo] = float("nan")
        c[:, base + T:] = float("nan")
    q = rnd(g, T, H, D, dtype=dtype, scale=2.0)
    anc = torch.ones(T, T, dtype=torch.bool)  # the drafter's non-causal block
    o = K.attention(q.to(DEV), kc.to(DEV), vc.to(DEV), torch.tensor([base], device=DEV), anc.to(DEV),
                    split_keys=split, block_n=bn, window=window)
    want = K.attention_ref(q.cpu(), kc.cpu().nan_to_num(), vc.cpu().nan_to_num(), base, anc, window=window)
    assert_close(o.cpu(), want, dtype)
    # the grid spans the window's splits only (from its first), with a device-side base as with an int one
    assert torch.equal(o, K.attention(q.to(DEV), kc.to(DEV), vc.to(DEV), base, anc.to(DEV), split_keys=split,
                                      block_n=bn, window=window))
    if window >= base:
        assert torch.equal(o, K.attention(q.to(DEV), kc.to(DEV), vc.to(DEV), base, anc.to(DEV), split_keys=split,
                                          block_n=bn))
    with pytest.raises(ValueError, match="window"):
        K.attention(q.to(DEV), kc.to(DEV), vc.to(DEV), base, anc.to(DEV), window=-1)


def test_attention_ref_masks_exactly():
    """attention_ref against a hand computation: one query, context of 2 keys plus itself, one masked sibling."""
    kc = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [9.0, 9, 9, 9]]])
    vc = torch.tensor([[[1.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 3.0, 0], [100.0, 100, 100, 100]]])
    q = torch.tensor([[[2.0, 0, 0, 0]], [[0, 0, 0, 2.0]]])
    anc = torch.tensor([[True, False], [True, True]])
    o = K.attention_ref(q, kc, vc, 2, anc)
    w = torch.softmax(torch.tensor([2.0, 0, 0]) / 2, 0)  # token 0 sees slots 0, 1, 2 (itself), not slot 3
    assert torch.allclose(o[0], w[0] * vc[0, 0] + w[1] * vc[0, 1] + w[2] * vc[0, 2])


# ---------------------------------------------------------------- batch invariance (bit for bit)

def _check_rows(fn, make_row, make_other, extract=lambda out, i: out[i]):
    """fn(batch) on a 1-row batch vs the same row at index p of larger batches with other random rows."""
    row = make_row()
    single = fn(row[None] if isinstance(row, torch.Tensor) else row, 1)
    for n, p in INVARIANCE_CALLS:
        batch = make_other(n)
        batch[p] = row
        got = fn(batch, n)
        want = extract(single, 0)
        have = extract(got, p)
        for a, b in zip(want if isinstance(want, tuple) else (want,), have if isinstance(have, tuple) else (have,)):
            assert torch.equal(a, b), f"row differs when computed among T={n} rows"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "res+bias", "fp32out", "swiglu"])
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_linear_batch_invariant(dtype, variant, row_tile):
    g = torch.Generator().manual_seed(11)
    Kd, N = 256, 97
    W = rnd(g, N, Kd, dtype=dtype, scale=0.06)
    bias = rnd(g, N, dtype=dtype)
    width = 2 * Kd if variant == "swiglu" else Kd
    out_dtype = torch.float32 if variant == "fp32out" else dtype
    res_row = rnd(g, N, dtype=out_dtype)

    def fn(x, n):
        if variant == "swiglu":
            return K.swiglu_linear(x, W, row_tile=row_tile)
        if variant == "res+bias":
            res = rnd(g, n, N, dtype=dtype)
            res[ROW_AT[n]] = res_row
            return K.linear(x, W, res, bias=bias, row_tile=row_tile)
        return K.linear(x, W, out_dtype=out_dtype, row_tile=row_tile)

    _check_rows(fn, lambda: rnd(g, width, dtype=dtype), lambda n: rnd(g, n, width, dtype=dtype, scale=5.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_tile", K.ROW_TILES)
def test_rmsnorm_linear_batch_invariant(dtype, row_tile):
    g = torch.Generator().manual_seed(12)
    Kd, N = 192, 97
    nw, W = (1 + rnd(g, Kd, scale=0.2)).to(dtype), rnd(g, N, Kd, dtype=dtype, scale=0.07)
    res_row = rnd(g, Kd, dtype=dtype)

    def fn(x, n):
        res = rnd(g, n, Kd, dtype=dtype, scale=4.0)
        res[ROW_AT[n]] = res_row
        return K.rmsnorm_linear(x, nw, W, 1e-5, res, row_tile=row_tile)

    _check_rows(fn, lambda: rnd(g, Kd, dtype=dtype), lambda n: rnd(g, n, Kd, dtype=dtype, scale=3.0),
                extract=lambda out, i: (out[0][i], out[1][i]))
    _check_rows(lambda x, n: K.rmsnorm_linear(x, nw, W, 1e-5, out_dtype=torch.float32, row_tile=row_tile),
                lambda: rnd(g, Kd, dtype=dtype), lambda n: rnd(g, n, Kd, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_batch_invariant(dtype):
    g = torch.Generator().manual_seed(13)
    _check_rows(lambda x, n: K.swiglu(x), lambda: rnd(g, 2 * 96, dtype=dtype), lambda n: rnd(g, n, 2 * 96, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_batch_invariant(dtype):
    g = torch.Generator().manual_seed(14)
    H, KVH, D, S = 6, 2, 16, 64
    cos, sin = (t.to(DEV) for t in K.rope_tables(128, D, 10000.0))
    row, pos_row, slot_row = rnd(g, (H + 2 * KVH) * D, dtype=dtype), 77, 50

    def fn(qkv, n):
        p = ROW_AT[n]
        pos = torch.randint(0, 128, (n,), generator=g).to(DEV)
        slots = torch.tensor([s for s in range(S) if s != slot_row][:n], device=DEV)
        pos[p], slots[p] = pos_row, slot_row
        kc, vc = poisoned(KVH, S, D, dtype=dtype), poisoned(KVH, S, D, dtype=dtype)
        q = K.rope_kv_write(qkv, pos, slots, cos, sin, kc, vc, H, KVH)
        return q, kc[:, slot_row], vc[:, slot_row]

    _check_rows(fn, lambda: row, lambda n: rnd(g, n, (H + 2 * KVH) * D, dtype=dtype),
                extract=lambda out, i: (out[0][i], out[1], out[2]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("KVH,G", [(2, 1), (1, 3)])
@pytest.mark.parametrize("bn,split", [(64, 64), (32, 128)])
@pytest.mark.parametrize("tiles,tile_rows", [(1, 16), (4, 16), (1, 32)])
def test_attention_batch_invariant(dtype, KVH, G, bn, split, tiles, tile_rows):
    """The token at slot b seeing slots 0..b gives the same bits as a T=1 decode step (base=b) and inside a
    verify step of T tokens (base=b-p, the token at index p, its ancestors = the chain 0..p, other branches
    beside it), however many extra masked key blocks and splits the bigger call iterates, and however many row
    tiles one program runs in turn (tiles_per_program, T-neutral) or how many rows a tile holds (tile_rows)."""
    g = torch.Generator().manual_seed(15 + KVH)
    rng = random.Random(G)
    H, D, b, S = KVH * G, 16, 60, 128
    kc, vc = rnd(g, KVH, S, D, dtype=dtype), rnd(g, KVH, S, D, dtype=dtype)
    q_row = rnd(g, H, D, dtype=dtype, scale=2.0)
    one = torch.ones(1, 1, dtype=torch.bool, device=DEV)
    single = K.attention(q_row[None], kc, vc, b, one, block_n=bn, split_keys=split)[0]
    for n, p in [(5, 3), (16, 15), (40, 2), (40, 31)]:
        parents = [-1] + [i - 1 if i <= p else rng.randrange(0, i) for i in range(1, n)]
        kc2, vc2 = kc.clone(), vc.clone()
        kc2[:, b + 1:] = rnd(g, KVH, S - b - 1, D, dtype=dtype)  # the other tokens' own keys
        vc2[:, b + 1:] = rnd(g, KVH, S - b - 1, D, dtype=dtype)
        q = rnd(g, n, H, D, dtype=dtype)
        q[p] = q_row
        o = K.attention(q, kc2, vc2, b - p, anc_from_parents(parents), block_n=bn, split_keys=split,
                        tiles_per_program=tiles, tile_rows=tile_rows)
        assert torch.equal(o[p], single), f"row differs inside a T={n} call (index {p})"


def test_greedy_accept_batch_invariant():
    """Appending wrong nodes anywhere in the tree (more nodes in the call) changes nothing."""
    rng = random.Random(16)
    tgt, drf, par = [7, 3, 4, 9, 2], [0, 7, 3, 4, 5], [-1, 0, 1, 2, 2]  # chain 0-1-2-3 correct, node 4 wrong
    base = K.greedy_accept(*(torch.tensor(v, device=DEV) for v in (tgt, drf, par)))
    for n in (16, 40):
        t2, d2, p2 = list(tgt), list(drf), list(par)
        for i in range(5, n):
            parent = rng.randrange(0, i)
            p2.append(parent)
            d2.append(t2[parent] + 1)  # never the target's argmax: wrong
            t2.append(rng.randrange(0, 10))
        got = K.greedy_accept(*(torch.tensor(v, device=DEV) for v in (t2, d2, p2)))
        assert torch.equal(got[0], base[0]) and torch.equal(got[2], base[2])
        assert torch.equal(got[1][:5], base[1]) and (got[1][5:] == -1).all()


# ---------------------------------------------------------------- greedy acceptance

def _accept(tgt, drf, par):
    args = [torch.tensor(v, dtype=torch.int64, device=DEV) for v in (tgt, drf, par)]
    T = len(tgt)
    out = (torch.full((1,), -7, dtype=torch.int64, device=DEV), torch.full((T,), -7, dtype=torch.int64, device=DEV),
           torch.full((1,), -7, dtype=torch.int64, device=DEV))
    got = K.greedy_accept(*args, out=out)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out))
    ref = K.greedy_accept_ref(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), (got, ref)
    return got[0].item(), got[1].tolist(), got[2].item()


@pytest.mark.parametrize("tgt,drf,par,expected", [
    # root only: nothing to accept, the bonus is the root's argmax
    ([5], [0], [-1], (0, [0], 5)),
    # chain, nothing accepted
    ([5, 6, 7, 8], [0, 4, 6, 7], [-1, 0, 1, 2], (0, [0, -1, -1, -1], 5)),
    # chain, everything accepted: bonus from the last node
    ([5, 6, 7, 8], [0, 5, 6, 7], [-1, 0, 1, 2], (3, [0, 1, 2, 3], 8)),
    # chain, a later node "matches" but its parent is wrong: stop at the first miss
    ([5, 6, 7, 8], [0, 5, 9, 7], [-1, 0, 1, 2], (1, [0, 1, -1, -1], 6)),
    # tree branching at depth 2: 0 -> 1 -> {2 (wrong), 3 (right) -> 4 (right)}, 0 -> 5 (wrong)
    ([1, 2, 0, 3, 4, 0], [0, 1, 9, 2, 3, 8], [-1, 0, 1, 1, 3, 0], (3, [0, 1, 3, 4, -1, -1], 4)),
    # ties: two correct siblings at the deepest level: the lowest index wins
    ([1, 2, 6, 6], [0, 1, 2, 2], [-1, 0, 1, 1], (2, [0, 1, 2, -1], 6)),
    # ties across subtrees: depth-1 nodes 1 and 2 both correct and leaves: node 1
    ([4, 8, 9], [0, 4, 4], [-1, 0, 0], (1, [0, 1, -1], 8)),
])
def test_greedy_accept_edge_cases(tgt, drf, par, expected):
    n, path, bonus = expected
    assert _accept(tgt, drf, par) == (n, path + [-1] * (len(tgt) - len(path)), bonus)


def test_greedy_accept_random_trees_vs_python():
    rng = random.Random(17)
    for _ in range(40):
        T = rng.choice([2, 3, 9, 16, 17, 40, 64, 200, 256])
        par = [-1] + [rng.randrange(max(0, i - rng.choice([1, 2, 8])), i) for i in range(1, T)]
        V = rng.choice([2, 3])
        _accept([rng.randrange(V) for _ in range(T)], [rng.randrange(V) for _ in range(T)], par)


def test_greedy_accept_bad_parent_is_never_accepted():
    tgt, drf, par = [5, 6, 7], [0, 5, 6], [-1, 0, 5]  # node 2 names parent 5 (out of range)
    args = [torch.tensor(v, device=DEV) for v in (tgt, drf, par)]
    n, path, bonus = K.greedy_accept(*args)
    assert (n.item(), path.tolist(), bonus.item()) == (1, [0, 1, -1], 6)
    with pytest.raises(ValueError, match="parents"):
        K.greedy_accept_ref(*args)


# ---------------------------------------------------------------- wrapper errors

def _wrapper_error_cases():
    bf = torch.bfloat16
    x, W = torch.randn(3, 64, device=DEV), torch.randn(32, 64, device=DEV)
    nw = torch.ones(64, device=DEV)
    kc = torch.randn(2, 16, 16, device=DEV)
    q = torch.randn(2, 4, 16, device=DEV)
    anc = torch.ones(2, 2, dtype=torch.bool, device=DEV)
    cos, sin = K.rope_tables(8, 16, 10000.0, DEV)
    qkv = torch.randn(2, 8 * 16, device=DEV)
    i64 = torch.zeros(2, dtype=torch.int64, device=DEV)
    meta = torch.randn(32, 64, device="meta")
    return [
        ("linear K mismatch", lambda: K.linear(x, W[:, :32]), "W must have shape"),
        ("linear dtype mismatch", lambda: K.linear(x, W.to(bf)), "W must have dtype"),
        ("linear int input", lambda: K.linear(x.long(), W), "x must have dtype"),
        ("linear non-contiguous W", lambda: K.linear(x, torch.randn(64, 32, device=DEV).t()), "contiguous"),
        ("linear strided x", lambda: K.linear(torch.randn(3, 128, device=DEV)[:, ::2], W), "contiguous"),
        ("linear 1-D x", lambda: K.linear(x[0], W), "x must have shape"),
        ("linear other device", lambda: K.linear(x, meta), "is on meta"),
        ("linear residual shape", lambda: K.linear(x, W, torch.randn(3, 31, device=DEV)), "residual"),
        ("linear bad out", lambda: K.linear(x, W, out=torch.empty(3, 32, dtype=bf, device=DEV)), "out must"),
        ("linear block_n", lambda: K.linear(x, W, block_n=24), "block_n"),
        ("linear num_warps", lambda: K.linear(x, W, num_warps=3), "num_warps"),
        ("swiglu_linear odd", lambda: K.swiglu_linear(torch.randn(3, 65, device=DEV), W), "gate_up"),
        ("swiglu odd", lambda: K.swiglu(torch.randn(3, 65, device=DEV)), "even"),
        ("rmsnorm norm_w", lambda: K.rmsnorm_linear(x, nw[:63], W, 1e-5), "norm_w"),
        ("rmsnorm eps", lambda: K.rmsnorm_linear(x, nw, W, 0.0), "eps"),
        ("rmsnorm residual_out alone",
         lambda: K.rmsnorm_linear(x, nw, W, 1e-5, residual_out=torch.empty_like(x)), "residual_out"),
        ("rope heads", lambda: K.rope_kv_write(qkv, i64, i64, cos, sin, kc, kc.clone(), 3, 2), "multiple"),
        ("rope qkv width", lambda: K.rope_kv_write(qkv[:, :-16], i64, i64, cos, sin, kc, kc.clone(), 4, 2), "qkv"),
        ("rope positions dtype",
         lambda: K.rope_kv_write(qkv, i64.int(), i64, cos, sin, kc, kc.clone(), 4, 2), "positions"),
        ("rope cos dtype", lambda: K.rope_kv_write(qkv, i64, i64, cos.half(), sin, kc, kc.clone(), 4, 2), "cos"),
        ("rope v_cache", lambda: K.rope_kv_write(qkv, i64, i64, cos, sin, kc, kc[:1].clone(), 4, 2), "v_cache"),
        ("attn anc dtype", lambda: K.attention(q, kc, kc.clone(), 3, anc.int()), "anc must have dtype"),
        ("attn anc shape", lambda: K.attention(q, kc, kc.clone(), 3, anc[:1]), "anc must have shape"),
        ("attn base range", lambda: K.attention(q, kc, kc.clone(), 15, anc), "base=15"),
        ("attn base negative", lambda: K.attention(q, kc, kc.clone(), -1, anc), "base=-1"),
        ("attn base tensor", lambda: K.attention(q, kc, kc.clone(), torch.tensor([3.0], device=DEV), anc), "base"),
        ("attn gqa", lambda: K.attention(torch.randn(2, 3, 16, device=DEV), kc, kc.clone(), 3, anc), "multiple"),
        ("attn head_dim", lambda: K.attention(torch.randn(2, 4, 12, device=DEV), torch.randn(2, 16, 12, device=DEV),
                                              torch.randn(2, 16, 12, device=DEV), 3, anc), "head_dim"),
        ("attn split", lambda: K.attention(q, kc, kc.clone(), 3, anc, split_keys=96), "split_keys"),
        ("attn q dtype", lambda: K.attention(q.to(bf), kc, kc.clone(), 3, anc), "k_cache must have dtype"),
        ("accept dtype", lambda: K.greedy_accept(i64.int(), i64, i64), "target_argmax"),
        ("accept size", lambda: K.greedy_accept(*(torch.zeros(257, dtype=torch.int64, device=DEV),) * 3), "1..256"),
        ("accept mismatch", lambda: K.greedy_accept(i64, i64[:1], i64), "draft_tokens"),
        ("accept out", lambda: K.greedy_accept(i64, i64, i64, out=(i64,)), "out must be a tuple"),
    ]


@pytest.mark.parametrize("case", _wrapper_error_cases(), ids=lambda c: c[0])
def test_wrapper_errors(case):
    _, call, match = case
    with pytest.raises(ValueError, match=match):
        call()


def test_launch_params():
    for cls in (K.LinearParams, K.RMSNormLinearParams, K.AttentionParams, K.RopeKVParams, K.SwigluParams,
                K.AcceptParams):
        p = cls()
        fields = set(p.as_kwargs())
        assert set(cls.T_NEUTRAL) <= fields and set(cls.SEARCH_SPACE) <= fields
    # block_n/split_keys set the order; row tiles run in turn by one program keep each tile's dots
    # (slot_stages: the stages of block_slots launches, whose dots are the same: tests/test_kernel_codegen.py)
    assert set(K.AttentionParams.T_NEUTRAL) == {"num_warps", "num_stages", "tiles_per_program", "tile_rows",
                                                "slot_stages"}
    with pytest.raises(ValueError, match="tiles_per_program"):
        K.AttentionParams(tiles_per_program=3)
    with pytest.raises(ValueError, match="tile_rows"):
        K.AttentionParams(tile_rows=64)  # 64-row tiles compile to wgmma: other bits
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="slot_stages"):
            K.AttentionParams(slot_stages=bad)
    with pytest.raises(ValueError, match="num_stages"):
        K.LinearParams(num_stages=0)
    with pytest.raises(ValueError, match="split_keys"):
        K.AttentionParams(block_n=128, split_keys=64)
    g = torch.Generator().manual_seed(18)
    x, W = rnd(g, 2, 64), rnd(g, 16, 64)
    assert torch.equal(K.linear(x, W, **K.LinearParams(block_n=16).as_kwargs()), K.linear(x, W, block_n=16))


def test_bench_refuses_cpu():
    from specpilot.engines.shapes import SMOLLM2_135M
    from specpilot.kernels.bench import bench_kernels

    with pytest.raises(RuntimeError, match="CUDA"):
        bench_kernels(SMOLLM2_135M, [1], device="cpu")


# ---------------------------------------------------------------- GPU only

@gpu
@pytest.mark.gpu
def test_cpu_tensors_rejected_when_compiled():
    with pytest.raises(ValueError, match="CUDA tensors"):
        K.linear(torch.randn(2, 64), torch.randn(16, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_t_neutral_params_change_no_bit(dtype):
    """Every T-neutral launch parameter (and T itself) leaves every output bit unchanged. The interpreter ignores
    num_warps/num_stages, so without CUDA only block_n is swept; on the GPU this checks the real compiler."""
    from triton.runtime.errors import OutOfResources

    g = torch.Generator().manual_seed(19)
    x, gu = rnd(g, 40, 256, dtype=dtype), rnd(g, 40, 512, dtype=dtype)
    W, res = rnd(g, 200, 256, dtype=dtype, scale=0.06), rnd(g, 40, 200, dtype=dtype)
    nw = (1 + rnd(g, 256, scale=0.2)).to(dtype)
    base_lin, base_sw = K.linear(x, W, res), K.swiglu_linear(gu, W)
    base_norm = K.rmsnorm_linear(x, nw, W, 1e-5)
    combos = [(bn, w, st) for bn in (16, 32, 64, 128) for w in ((2, 4, 8) if CUDA else (4,))
              for st in ((2, 3, 5) if CUDA else (3,))]
    checked = 0
    for bn, w, st in combos:
        kw = dict(block_n=bn, num_warps=w, num_stages=st)
        try:
            assert torch.equal(K.linear(x, W, res, **kw), base_lin), kw
            assert torch.equal(K.swiglu_linear(gu, W, **kw), base_sw), kw
            assert torch.equal(K.rmsnorm_linear(x, nw, W, 1e-5, **kw), base_norm), kw
            assert torch.equal(K.linear(x[7:8].contiguous(), W, res[7:8].contiguous(), **kw), base_lin[7:8]), kw
            checked += 1
        except OutOfResources:  # a launch that does not fit (fp32 tiles with deep pipelines): not numerics
            continue
    assert checked >= len(combos) * 2 // 3
    for regs in K.MAX_REGISTERS if CUDA else ():  # ptxas register caps: allocation only (the interpreter has none)
        assert torch.equal(K.linear(x, W, res, max_registers=regs), base_lin), regs
        assert torch.equal(K.rmsnorm_linear(x, nw, W, 1e-5, max_registers=regs), base_norm), regs
    # the statistic's chunks loaded 1..8 at a time (K=256: two 64-chunks and masked ones past K), residual too
    x2, r2 = rnd(g, 5, 256, dtype=dtype), rnd(g, 5, 256, dtype=dtype)
    base_res = K.rmsnorm_linear(x2, nw, W, 1e-5, r2, block_k=64)
    bias = rnd(g, 200, dtype=dtype)  # residual and bias loaded after the K loop (not before, the default): the same bits
    for split in (1, 2):
        assert torch.equal(K.linear(x, W, res, bias=bias, split_k=split, early_residual=False),
                           K.linear(x, W, res, bias=bias, split_k=split)), split
    for unroll, prefetch in ((1, 0), (2, 1), (4, 2), (8, 0)):
        kw = dict(stat_unroll=unroll, act_prefetch=prefetch)
        assert torch.equal(K.rmsnorm_linear(x, nw, W, 1e-5, **kw), base_norm), kw
        got = K.rmsnorm_linear(x2, nw, W, 1e-5, r2, block_k=64, **kw)
        assert all(torch.equal(out, want) for out, want in zip(got, base_res)), kw
        assert torch.equal(K.rmsnorm_linear(x2, nw, W, 1e-5, block_k=64, split_k=2, **kw),
                           K.rmsnorm_linear(x2, nw, W, 1e-5, block_k=64, split_k=2)), kw
    with pytest.raises(ValueError, match="stat_unroll"):
        K.rmsnorm_linear(x, nw, W, 1e-5, stat_unroll=3)
    KVH, G, D, b, T = 2, 4, 32, 300, 16
    kc, vc = rnd(g, KVH, 400, D, dtype=dtype), rnd(g, KVH, 400, D, dtype=dtype)
    q = rnd(g, T, KVH * G, D, dtype=dtype)
    anc = anc_from_parents(random_tree(random.Random(0), T))
    base_attn = K.attention(q, kc, vc, b, anc)
    for w in ((2, 4, 8) if CUDA else (4,)):
        for st in ((1, 2, 3) if CUDA else (2,)):
            assert torch.equal(K.attention(q, kc, vc, b, anc, num_warps=w, num_stages=st), base_attn)
    gu_act = rnd(g, 3, 2 * 1500, dtype=dtype)
    assert torch.equal(K.swiglu(gu_act, block_i=256), K.swiglu(gu_act, block_i=2048))


@gpu
@pytest.mark.gpu
def test_bench_runs_on_gpu():
    from specpilot.engines.shapes import LlamaShape
    from specpilot.kernels.bench import KERNELS, bench_kernels

    tiny = LlamaShape(vocab=1000, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                      rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=True, max_positions=4096)
    rows = bench_kernels(tiny, [1, 5], context=300, warmup_ms=1, rep_ms=5)
    assert [r["kernel"] for r in rows] == list(KERNELS) * 2
    assert all(r["ms"] > 0 and r["ref_ms"] > 0 and r["gbps"] > 0 for r in rows)


def test_pdl_launch_keywords_are_off_on_cpu_and_the_mode_switch_restores():
    import specpilot.kernels.pdl as pdl
    from specpilot.kernels.pdl import GridDependency, grid_dependency, pdl_launch, prefetch_lines
    cpu = torch.device("cpu")
    assert pdl_launch(cpu) == {"PDL": 0}  # the interpreter never sees the attribute or the PTX
    # weights prefetched only when the whole matrix fits the budget: SmolLM2's gate_up yes, its LM head not
    assert pdl_launch(cpu, 3072, 576) == {"PDL": 0, "PF_LINES": 16}
    assert pdl_launch(cpu, 49152, 576) == {"PDL": 0, "PF_LINES": 0}
    with grid_dependency(GridDependency.OFF, prefetch_max_bytes=0):
        assert pdl._state == {"mode": GridDependency.OFF, "prefetch_max_bytes": 0, "large_mode": GridDependency.OFF}
        assert pdl_launch(cpu, 3072, 576)["PF_LINES"] == 0
    assert pdl._state == {"mode": GridDependency.WAIT_THEN_TRIGGER, "prefetch_max_bytes": pdl.PREFETCH_MAX_BYTES,
                          "large_mode": GridDependency.OFF}
    for bad in ({"mode": 1}, {"mode": GridDependency.OFF, "prefetch_max_bytes": -1},
                {"mode": GridDependency.OFF, "large_mode": 2}):
        with pytest.raises(ValueError):
            with grid_dependency(**bad):
                pass
    # SmolLM2 rows: 576 bf16 = 9 lines -> 16; 1536 -> 24 -> 32; Llama-3-8B's 4096 (64 lines) capped at 32
    assert [prefetch_lines(k, 2) for k in (576, 1536, 4096, 64)] == [16, 32, 32, 1]
    assert [prefetch_lines(4096, 2, most) for most in (1, 4, 5, 20)] == [1, 4, 4, 16]  # powers of two


def test_pdl_launch_gives_matrices_over_the_prefetch_budget_the_large_matrix_mode(monkeypatch):
    import specpilot.kernels.pdl as pdl
    from specpilot.kernels.pdl import GridDependency, grid_dependency, pdl_launch
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)  # the decision alone (no launch here)
    gpu = torch.device("cuda", 0)
    assert pdl_launch(gpu, 3072, 576) == {"PDL": 1, "launch_pdl": True, "PF_LINES": 16}  # SmolLM2's gate_up
    assert pdl_launch(gpu, 28672, 4096) == {"PDL": 0, "PF_LINES": 0}  # Llama-3-8B's gate_up: plain stream order
    assert pdl_launch(gpu) == {"PDL": 1, "launch_pdl": True}  # attention reads no weights: the small-matrix mode
    with grid_dependency(GridDependency.WAIT_THEN_TRIGGER, large_mode=GridDependency.WAIT_THEN_TRIGGER_AT_END):
        # the first lines of each row that fit the budget together: 16 MiB / (28672 rows x 128 B) = 4.6 -> 4 lines
        assert pdl_launch(gpu, 28672, 4096) == {"PDL": 2, "launch_pdl": True, "PF_LINES": 4}
        assert pdl_launch(gpu, 4096, 4096)["PF_LINES"] == 32  # o_proj: 32 MiB, 32 lines a row (16 MiB) fit
        assert pdl_launch(gpu, 128256, 4096)["PF_LINES"] == 1  # the LM head: one line a row
        assert pdl_launch(gpu, 200000, 4096)["PF_LINES"] == 0  # not even one line a row fits: none
        assert pdl_launch(gpu, 3072, 576) == {"PDL": 1, "launch_pdl": True, "PF_LINES": 16}
    with grid_dependency(GridDependency.WAIT_THEN_TRIGGER_AT_END):
        assert pdl_launch(gpu, 3072, 576) == {"PDL": 2, "launch_pdl": True, "PF_LINES": 16}
        assert pdl_launch(gpu, 28672, 4096) == {"PDL": 0, "PF_LINES": 0}
    assert pdl_launch(torch.device("cpu"), 3072, 576) == {"PDL": 0, "PF_LINES": 16}


def test_a_launch_may_set_its_own_grid_dependency(monkeypatch):
    import specpilot.kernels.pdl as pdl
    from specpilot.kernels.pdl import GridDependency, pdl_launch
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)
    gpu = torch.device("cuda", 0)
    # Llama-3-8B's o_proj: stream order by the size policy; mode 2 of its own, with the budget's lines a row
    assert pdl_launch(gpu, 4096, 4096) == {"PDL": 0, "PF_LINES": 0}
    assert pdl_launch(gpu, 4096, 4096, mode=2) == {"PDL": 2, "launch_pdl": True, "PF_LINES": 32}
    assert pdl_launch(gpu, 3072, 576, mode=GridDependency.OFF) == {"PDL": 0, "PF_LINES": 16}  # SmolLM2's gate_up
    assert pdl_launch(torch.device("cpu"), 4096, 4096, mode=2) == {"PDL": 0, "PF_LINES": 0}  # the interpreter: off
    for bad in (3, True, "2"):
        with pytest.raises(ValueError, match="grid_dependency"):
            pdl_launch(gpu, 4096, 4096, mode=bad)
        with pytest.raises(ValueError, match="grid_dependency"):
            K.LinearParams(grid_dependency=bad)
        with pytest.raises(ValueError, match="grid_dependency"):
            K.RMSNormLinearParams(grid_dependency=bad)
    assert "grid_dependency" in K.LinearParams.T_NEUTRAL and "grid_dependency" not in K.LinearParams.SEARCH_SPACE
    # the wrappers take it (on CPU every launch is in stream order: the same call)
    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(2, 32, generator=g).to(DEV), torch.randn(16, 32, generator=g).to(DEV)
    assert torch.equal(K.linear(x, W, grid_dependency=2), K.linear(x, W))
    nw = torch.ones(32, device=DEV)
    assert torch.equal(K.rmsnorm_linear(x, nw, W, 1e-5, grid_dependency=1), K.rmsnorm_linear(x, nw, W, 1e-5))


def test_parse_grid_dependency_reads_the_scripts_spec():
    from specpilot.kernels.pdl import PREFETCH_MAX_BYTES, GridDependency, parse_grid_dependency
    assert parse_grid_dependency("wait_then_trigger::wait_then_trigger_at_end") == {
        "mode": GridDependency.WAIT_THEN_TRIGGER, "prefetch_max_bytes": PREFETCH_MAX_BYTES,
        "large_mode": GridDependency.WAIT_THEN_TRIGGER_AT_END}
    assert parse_grid_dependency("OFF:1024") == {"mode": GridDependency.OFF, "prefetch_max_bytes": 1024 << 20,
                                                 "large_mode": GridDependency.OFF}
    for bad in ("bogus", "off:many", "off::bogus"):
        with pytest.raises(ValueError, match="MODE"):
            parse_grid_dependency(bad)
