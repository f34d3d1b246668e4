"""The oct kernel layout of W12 tensors (specpilot/weights/oct.py): exact on every bf16 bit pattern, edge values, K
not a multiple of 256, several escapes in one (row, block), row groups; the byte and nibble positions the kernels
will read."""
from __future__ import annotations

import pytest
import torch

from specpilot.weights import bitwise_equal, concat_rows, decode, encode
from specpilot.weights.oct import BLOCK, SLOT_MORE, SLOT_VALID, decode_oct, oct_layout


def bits(*values: int) -> torch.Tensor:
    return torch.tensor([v - 65536 if v >= 32768 else v for v in values], dtype=torch.int16).view(torch.bfloat16)


def every_pattern(shape, seed: int) -> torch.Tensor:
    b = torch.arange(65536, dtype=torch.int32)
    t = (b - ((b >> 15) << 16)).to(torch.int16).view(torch.bfloat16)
    n = torch.Size(shape).numel()
    return t[torch.randperm(65536, generator=torch.Generator().manual_seed(seed))][:n].reshape(shape)


def outside_window(t: torch.Tensor, base: torch.Tensor) -> int:
    ex = (t.view(torch.int16).to(torch.int64) >> 7) & 0xFF
    d = ex - base[:, None].to(torch.int64)
    return int(((d < 0) | (d > 14)).sum())


@pytest.mark.parametrize("shape", [(256, 256), (257, 255), (3, 1000), (1, 65536)])
def test_every_bf16_bit_pattern_round_trips(shape):
    t = every_pattern(shape, seed=sum(shape))
    lay = oct_layout(encode(t))
    assert bitwise_equal(decode_oct(lay), t)
    K = shape[1]
    assert lay.padded_cols == -(-K // BLOCK) * BLOCK
    assert lay.escapes.numel() == outside_window(t, lay.base)  # every element outside its row's window
    assert lay.cell_counts.shape == (shape[0], lay.padded_cols // BLOCK)


@pytest.mark.parametrize("K", [576, 4096, 300])
def test_llama_like_weights_are_exact_with_few_escapes(K):
    t = (torch.randn(64, K, generator=torch.Generator().manual_seed(K)) * 0.02).to(torch.bfloat16)
    lay = oct_layout(encode(t))
    assert bitwise_equal(decode_oct(lay), t)
    assert lay.escapes.numel() < t.numel() * 2e-3
    Kp = lay.padded_cols
    assert lay.words.shape == (64, Kp // 4) and lay.codes.shape == (64, Kp // 8) and lay.base.shape == (64,)
    assert lay.cell_esc.shape == (64 * Kp // BLOCK + 1,)
    assert lay.kernel_bytes == (64 * Kp * 1.5 + 64 * 4 + lay.cell_esc.numel() * 4 + lay.escapes.numel() * 4
                                + 64 * Kp // BLOCK * 4)


def test_slots_hold_each_cells_first_escape_and_flag_the_rest():
    t = (torch.randn(8, 600, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    t[2, 3], t[2, 4], t[2, 255], t[5, 513] = 1e-30, -2e-30, 3e-31, 1e-25  # row 2 block 0 three, row 5 block 2 one
    lay = oct_layout(encode(t))
    counts = lay.cell_counts
    assert lay.slots.shape == counts.shape == (8, 3)
    for r in range(8):
        for b in range(3):
            slot, n = int(lay.slots[r, b]), int(counts[r, b])
            first = int(lay.escapes[int(lay.cell_esc[r * 3 + b])]) if n else 0
            assert slot == (first | SLOT_VALID if n else 0) | (SLOT_MORE if n > 1 else 0), (r, b)
    assert int(lay.slots[2, 0]) & 0xFF == 3 and int(lay.slots[5, 2]) & 0xFF == 1 and counts[2, 0] >= 3


def test_edge_values_and_an_all_escape_table():
    cases = [torch.zeros(3, 40, dtype=torch.bfloat16), -torch.zeros(2, 9, dtype=torch.bfloat16),
             bits(*range(1, 128), *range(0x8001, 0x8080)).reshape(2, 127),  # subnormals
             bits(0x7F80, 0xFF80, 0x3F80, 0x0000, 0x8000, 0x7F80).reshape(3, 2),  # infinities, +-0
             bits(*range(0x7F81, 0x8000), *range(0xFF81, 0x10000)).reshape(2, 127)]  # NaN payloads
    for t in cases:
        assert bitwise_equal(decode_oct(oct_layout(encode(t))), t)
    # W12's table misses every exponent (all escapes there); the oct window follows the row's own exponents
    t = (torch.randn(33, 70, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    w = encode(t, exponents=range(200, 215))
    assert w.stats.escape_rate == 1.0
    lay = oct_layout(w)
    assert bitwise_equal(decode_oct(lay), t) and lay.escapes.numel() < t.numel() // 20


def test_several_escapes_in_one_block_and_row_groups():
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(6, 600, generator=g) * 0.02).to(torch.bfloat16)
    t[2, 260:300] = torch.tensor([2.0 ** e for e in range(-60, 60, 3)], dtype=torch.bfloat16)  # 40 exponents
    t[4, 599] = float("inf")
    lay = oct_layout(encode(t))
    assert bitwise_equal(decode_oct(lay), t)
    counts = lay.cell_counts
    assert int(counts[2, 1]) >= 20 and int(counts.max()) == int(counts[2, 1])  # most of the 40 miss one window
    mine = lay.escapes[int(lay.cell_esc[2 * 3 + 1]):int(lay.cell_esc[2 * 3 + 2])]
    pos = (mine & 0xFF) + BLOCK  # positions in the row
    assert int(((pos >= 260) & (pos < 300)).sum()) >= 20
    assert torch.equal(mine & 0xFF, (mine & 0xFF).sort().values)
    # q | k | v with their own tables: the layout follows each row's exponents, whatever its group
    parts = [encode((torch.randn(5, 256, generator=g) * s).to(torch.bfloat16)) for s in (0.02, 3.0, 1e-5)]
    w = concat_rows(parts)
    assert bitwise_equal(decode_oct(oct_layout(w)), decode(w))


def test_byte_and_nibble_positions():
    """Word j < 32 of a block holds the lo bytes of elements j, 32+j, 64+j, 96+j (byte q: element 32q + j), word
    32 + j those of 128 + j ..; nibble e of code word j is element 32e + j's code."""
    # element i of the block: mantissa i % 128, sign i >= 128, exponent 120 + i % 8 (inside one window)
    i = torch.arange(BLOCK)
    v = ((i >= 128).to(torch.int32) << 15) | ((120 + i % 8) << 7) | (i % 128)
    t = torch.where(v >= 1 << 15, v - (1 << 16), v).to(torch.int16).view(torch.bfloat16).reshape(1, BLOCK)
    lay = oct_layout(encode(t))
    assert int(lay.base[0]) == 120 and lay.escapes.numel() == 0
    words = lay.words[0].view(torch.uint8).reshape(64, 4)
    lo = ((i >= 128).to(torch.int32) << 7) | (i % 128)
    for half in (0, 1):
        for j in (0, 5, 31):
            assert words[32 * half + j].tolist() == [int(lo[128 * half + 32 * q + j]) for q in range(4)]
    codes = lay.codes[0]
    for j in (0, 7, 31):
        word = int(codes[j]) & 0xFFFFFFFF
        assert [(word >> (4 * e)) & 15 for e in range(8)] == [int((32 * e + j) % 8) for e in range(8)]


def test_refuses_tensors_that_are_not_matrices():
    with pytest.raises(ValueError, match="2-D"):
        oct_layout(encode(torch.zeros(4, 4, 4, dtype=torch.bfloat16)))
