"""The oct kernel layout of W12 tensors (specpilot/weights/oct.py): exact on every bf16 bit pattern, edge values, K
not a multiple of 256, several escapes in one (row, block), row groups; the byte and nibble positions the kernels
will read."""
from __future__ import annotations

import pytest
import torch

from specpilot.weights import bitwise_equal, concat_rows, decode, encode
from specpilot.weights.oct import BLOCK, WINDOW, code_position, decode_oct, oct_layout


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
    return int(((d < 0) | (d >= WINDOW)).sum())


def cells_with_escapes(t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """bool [N, Kp/256]: the (row, block) cells holding an element outside the row's window."""
    ex = (t.view(torch.int16).to(torch.int64) >> 7) & 0xFF
    d = ex - base[:, None].to(torch.int64)
    out = (d < 0) | (d >= WINDOW)
    K = t.shape[1]
    out = torch.nn.functional.pad(out, (0, -(-K // BLOCK) * BLOCK - K))
    return out.view(t.shape[0], -1, BLOCK).any(2)


@pytest.mark.parametrize("shape", [(256, 256), (257, 255), (3, 1000), (1, 65536)])
def test_every_bf16_bit_pattern_round_trips(shape):
    t = every_pattern(shape, seed=sum(shape))
    lay = oct_layout(encode(t))
    assert bitwise_equal(decode_oct(lay), t)
    K = shape[1]
    assert lay.padded_cols == -(-K // BLOCK) * BLOCK
    assert lay.escapes == outside_window(t, lay.base)  # every element outside its row's window
    assert torch.equal(lay.fat_cells >= 0, cells_with_escapes(t, lay.base))  # and only their cells carry words


@pytest.mark.parametrize("K", [576, 4096, 300])
def test_llama_like_weights_are_exact_with_few_escapes(K):
    t = (torch.randn(64, K, generator=torch.Generator().manual_seed(K)) * 0.02).to(torch.bfloat16)
    lay = oct_layout(encode(t))
    assert bitwise_equal(decode_oct(lay), t)
    assert lay.escapes < t.numel() * 2e-4
    Kp = lay.padded_cols
    assert lay.words.shape == (64, Kp // 4) and lay.codes.shape == (64, Kp // 8) and lay.base.shape == (64,)
    assert lay.fat_cells.shape == (64, Kp // BLOCK)
    F = int((lay.fat_cells >= 0).sum())
    assert lay.fat.shape == (F, 32) and F <= lay.escapes
    assert lay.kernel_bytes == 64 * Kp * 1.5 + 64 * 4 + 64 * Kp // BLOCK * 4 + F * 128


def nibble_at(words: torch.Tensor, e: int, j: int) -> int:
    """Element 32e + j's nibble in a block's 32 code (or high-nibble) words."""
    w, n = code_position(e, j)
    return (int(words[w]) >> (4 * n)) & 15


def test_high_nibbles_of_cells_with_escapes():
    """A cell with escapes gets the next word block in (row, block) order (others -1); its words hold element 32e + j's
    (exponent - base) // 16 mod 16 where the code words hold its code, the remainder mod 16: base + code + 16 h =
    exponent."""
    t = (torch.randn(8, 600, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    t = (t.sign() * t.abs().clamp(min=2.0 ** -12)).to(torch.bfloat16)  # every exponent within one window
    t[2, 3], t[2, 4 + 128], t[2, 255], t[5, 513] = 1e-30, -2e-30, 3e-31, 1e-25  # row 2 block 0 three, row 5 block 2
    lay = oct_layout(encode(t))
    assert lay.escapes == 4
    want = torch.full((8, 3), -1, dtype=torch.int32)
    want[2, 0], want[5, 2] = 0, 1
    assert torch.equal(lay.fat_cells, want) and lay.fat.shape == (2, 32)
    exp = lambda v: (int(torch.tensor(v, dtype=torch.bfloat16).view(torch.int16)) >> 7) & 0xFF  # noqa: E731
    nib = lambda cell, e, j: nibble_at(lay.fat[cell], e, j)  # noqa: E731
    code = lambda r, e, j, b: nibble_at(lay.codes[r, 32 * b:32 * b + 32], e, j)  # noqa: E731
    for (r, b, e, j, v) in ((2, 0, 0, 3, 1e-30), (2, 0, 4, 4, -2e-30), (2, 0, 7, 31, 3e-31), (5, 2, 0, 1, 1e-25)):
        off = (exp(v) - int(lay.base[r])) % 256
        assert (nib(int(lay.fat_cells[r, b]), e, j), code(r, e, j, b)) == (off >> 4, off & 15), (r, b, e, j)
    assert int((lay.fat != 0).sum()) == 4  # one word per escaped element here (no two share a lane)
    assert bitwise_equal(decode_oct(lay), t)


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
    assert bitwise_equal(decode_oct(lay), t) and lay.escapes < t.numel() // 20


def test_several_escapes_in_one_block_and_row_groups():
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(6, 600, generator=g) * 0.02).to(torch.bfloat16)
    t[2, 260:300] = torch.tensor([2.0 ** e for e in range(-60, 60, 3)], dtype=torch.bfloat16)  # 40 exponents
    t[4, 599] = float("inf")
    lay = oct_layout(encode(t))
    assert bitwise_equal(decode_oct(lay), t)
    assert lay.escapes >= 20 and int(lay.fat_cells[2, 1]) >= 0 and int(lay.fat_cells[4, 2]) >= 0
    # q | k | v with their own tables: the layout follows each row's exponents, whatever its group
    parts = [encode((torch.randn(5, 256, generator=g) * s).to(torch.bfloat16)) for s in (0.02, 3.0, 1e-5)]
    w = concat_rows(parts)
    assert bitwise_equal(decode_oct(oct_layout(w)), decode(w))


def test_byte_and_nibble_positions():
    """Word j < 32 of a block holds the lo bytes of elements j, 32+j, 64+j, 96+j (byte q: element 32q + j), word
    32 + j those of 128 + j ..; code words by lane pairs (2i, 2i + 1): word 2i nibble q = lane 2i's code in slice q,
    nibble q + 4 = lane 2i + 1's; word 2i + 1 the same for slices 4 + q (lane j of slice e = element 32e + j)."""
    # element 32e + j of the block: mantissa i % 128, sign i >= 128, code (e + 3j) % 16 over exponents 120..135
    i = torch.arange(BLOCK)
    e_of, j_of = i // 32, i % 32
    v = ((i >= 128).to(torch.int32) << 15) | ((120 + (e_of + 3 * j_of) % 16) << 7) | (i % 128)
    t = torch.where(v >= 1 << 15, v - (1 << 16), v).to(torch.int16).view(torch.bfloat16).reshape(1, BLOCK)
    lay = oct_layout(encode(t))
    assert int(lay.base[0]) == 120 and lay.escapes == 0 and lay.fat.numel() == 0
    words = lay.words[0].view(torch.uint8).reshape(64, 4)
    lo = ((i >= 128).to(torch.int32) << 7) | (i % 128)
    for half in (0, 1):
        for j in (0, 5, 31):
            assert words[32 * half + j].tolist() == [int(lo[128 * half + 32 * q + j]) for q in range(4)]
    code = lambda e, j: (e + 3 * j) % 16  # noqa: E731
    nibbles = lambda w: [(int(lay.codes[0, w]) & 0xFFFFFFFF) >> (4 * n) & 15 for n in range(8)]  # noqa: E731
    for lane in (0, 6, 30):  # an even lane and the odd one after it
        assert nibbles(lane) == [code(q, lane) for q in range(4)] + [code(q, lane + 1) for q in range(4)]
        assert nibbles(lane + 1) == [code(4 + q, lane) for q in range(4)] + [code(4 + q, lane + 1) for q in range(4)]
    assert code_position(5, 7) == (7, 5) and code_position(2, 6) == (6, 2) and code_position(6, 30) == (31, 2)


def test_refuses_tensors_that_are_not_matrices():
    with pytest.raises(ValueError, match="2-D"):
        oct_layout(encode(torch.zeros(4, 4, 4, dtype=torch.bfloat16)))
