"""The interpreter's float `tl.dot` (fix 3 of kernels._common._fix_interpreter) rounds per 16-wide K step, like a
GPU MMA (m16n8k16): one 256-wide dot, two chained 128-wide dots and eight chained 32-wide dots over the same K
give the same bits, on random inputs and on hand-built cancellations where a single rounding of the whole K would
not. Interpreted, the results also equal a numpy model of the rule; batched (3-D) dots keep working.

Without CUDA the kernels run under the Triton interpreter (tests/conftest.py turns it on before triton is first
imported). With CUDA the same kernels run compiled: only the equalities between dot widths are checked there.
"""
from __future__ import annotations

import numpy as np
import torch

CUDA = torch.cuda.is_available()

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import specpilot.kernels._common  # noqa: E402,F401  (installs the interpreter fixes)

DEV = torch.device("cuda" if CUDA else "cpu")
M, N, K = 16, 32, 256
WIDTHS = (256, 128, 32)
interpreted = pytest.mark.skipif(CUDA, reason="pins the interpreter's rounding model")


@triton.jit
def _chained_dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    acc = tl.zeros((M, N), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def _batched_dot_kernel(a_ptr, b_ptr, c_ptr, out_ptr, B: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                        K: tl.constexpr):
    rb = tl.arange(0, B)[:, None, None]
    rm = tl.arange(0, M)[None, :, None]
    rn = tl.arange(0, N)[None, None, :]
    rka = tl.arange(0, K)[None, None, :]
    rkb = tl.arange(0, K)[None, :, None]
    a = tl.load(a_ptr + rb * M * K + rm * K + rka)
    b = tl.load(b_ptr + rb * K * N + rkb * N + rn)
    c = tl.load(c_ptr + rb * M * N + rm * N + rn)
    tl.store(out_ptr + rb * M * N + rm * N + rn, tl.dot(a, b, c))


def chained_dot(a: torch.Tensor, b: torch.Tensor, block_k: int) -> torch.Tensor:
    out = torch.empty(M, N, dtype=torch.float32, device=DEV)
    _chained_dot_kernel[(1,)](a, b, out, M=M, N=N, K=K, BLOCK_K=block_k)
    return out


def step16_ref(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The rule, element by element: for each 16-wide k slice in ascending order,
    acc = fp32(acc + fp32(sum of the slice's exact products in fp64)); a K that is not a multiple of 16 ends
    with a shorter slice."""
    x, y, out = a.double().cpu().numpy(), b.double().cpu().numpy(), acc.cpu().numpy().astype(np.float32)
    for k0 in range(0, x.shape[-1], 16):
        s = np.zeros(out.shape, dtype=np.float64)
        for k in range(k0, min(k0 + 16, x.shape[-1])):
            s = s + x[..., :, k, None] * y[..., None, k, :]
        out = out + s.astype(np.float32)
    return torch.from_numpy(out)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.cpu().view(torch.int32), y.cpu().view(torch.int32))


def hand_built() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose 256-wide exact sum, rounded once, differs from the 16-step result (b is all ones, so every
    column of a row holds that row's sum). 2^24 + 1 rounds to 2^24 in fp32 (a tie, to even), so a slice holding
    both ends at 2^24, and a later -2^24 cancels it to 0; the exact sum is 1."""
    a = torch.zeros(M, K, dtype=torch.float64)
    big = 2.0 ** 24
    for row, k_neg in ((0, 16), (1, 40), (2, 200)):  # -2^24 in the next slice, the next 32, the next 128
        a[row, 0], a[row, 1], a[row, k_neg] = big, 1.0, -big
    # fp32(acc + fp32(s)), not fp32(acc + s): slice 1 sums to 1 + 2^-30, whose fp32 rounding is 1, and
    # 2^24 + 1 is a tie (-> 2^24); unrounded, 2^24 + 1 + 2^-30 would round up to 2^24 + 2.
    a[3, 0], a[3, 16], a[3, 17] = big, 1.0, 2.0 ** -30
    expect = torch.zeros(M, N, dtype=torch.float32)
    expect[3] = big
    return a.to(torch.bfloat16), torch.ones(K, N, dtype=torch.bfloat16), expect


def test_dot_widths_give_same_bits_random():
    gen = torch.Generator().manual_seed(12)
    for trial in range(3):
        a = torch.randn(M, K, generator=gen).mul(4.0 ** (trial - 1)).to(torch.bfloat16).to(DEV)
        b = torch.randn(K, N, generator=gen).to(torch.bfloat16).to(DEV)
        outs = {w: chained_dot(a, b, w) for w in WIDTHS}
        for w in WIDTHS[1:]:
            assert same_bits(outs[w], outs[WIDTHS[0]]), f"trial {trial}: {K // w} x {w}-wide dots != one {K}-wide"
        if not CUDA:
            assert same_bits(outs[WIDTHS[0]], step16_ref(a, b, torch.zeros(M, N)))


def test_dot_widths_give_same_bits_cancellation():
    a, b, expect = hand_built()
    a, b = a.to(DEV), b.to(DEV)
    outs = {w: chained_dot(a, b, w) for w in WIDTHS}
    for w in WIDTHS[1:]:
        assert same_bits(outs[w], outs[WIDTHS[0]]), f"{K // w} x {w}-wide dots != one {K}-wide"
    if not CUDA:
        # one rounding of the whole exact sum would give 1.0 in rows 0..2
        assert float(a[0].double() @ b[:, 0].double()) == 1.0
        assert same_bits(outs[WIDTHS[0]], expect), outs[WIDTHS[0]][:4, 0]


@interpreted
def test_batched_dot_keeps_batch_dims():
    gen = torch.Generator().manual_seed(3)
    B, Kb, Nb = 2, 64, 16
    a = torch.randn(B, M, Kb, generator=gen).to(torch.bfloat16)
    b = torch.randn(B, Kb, Nb, generator=gen).to(torch.bfloat16)
    c = torch.randn(B, M, Nb, generator=gen)
    out = torch.empty(B, M, Nb)
    _batched_dot_kernel[(1,)](a, b, c, out, B=B, M=M, N=Nb, K=Kb)
    assert same_bits(out, step16_ref(a, b, c))


@interpreted
@pytest.mark.parametrize("kb", [8, 4])
def test_short_k_is_one_slice(kb):
    """The interpreter accepts dots with K < 16 (a GPU 16-bit dot does not): one shorter slice, no error."""
    gen = torch.Generator().manual_seed(kb)
    a = torch.randn(1, M, kb, generator=gen).to(torch.bfloat16)
    b = torch.randn(1, kb, N, generator=gen).to(torch.bfloat16)
    c = torch.randn(1, M, N, generator=gen)
    out = torch.empty(1, M, N)
    _batched_dot_kernel[(1,)](a, b, c, out, B=1, M=M, N=N, K=kb)
    assert same_bits(out, step16_ref(a, b, c))
