"""The W12 decode's inline PTX (kernels/w12_tile.OCT_ASM), run on CPU by emulating its instructions: each output holds
two bf16 (lanes 2i and 2i + 1 of one slice), each with the sign and mantissa of its byte and the exponent base + code
+ 16 * high nibble (mod 256), the code and high nibble read where weights/oct.py puts them. The GPU kernels run this
text (the interpreter runs `_oct_lane` instead, checked by tests/test_weights_w12.py); the H200 checks both against
bf16 bit for bit, and this test keeps a change to the PTX honest where no GPU is at hand."""
from __future__ import annotations


import numpy as np
import pytest

from specpilot.kernels.w12_tile import OCT_ASM
from specpilot.weights.oct import code_position

M32 = np.uint64(0xFFFFFFFF)


def _prmt(a, b, sel: int):
    src = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)] + \
          [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        assert s < 8, "sign-replicating selectors are not emulated"
        out |= src[s] << np.uint64(8 * i)
    return out


def _lop3(a, b, c, lut: int):
    out = np.zeros_like(a)
    for idx in range(8):
        if lut >> idx & 1:
            out |= (a if idx & 4 else ~a & M32) & (b if idx & 2 else ~b & M32) & (c if idx & 1 else ~c & M32)
    return out


def run_asm(asm: str, inputs: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Outputs $0..$(n_out-1) (32-bit) of the PTX subset the decode uses, inputs $n_out.. as uint32 arrays."""
    reg: dict[str, np.ndarray] = {f"${n_out + i}": x.astype(np.uint64) & M32 for i, x in enumerate(inputs)}

    def val(tok: str):
        tok = tok.strip()
        return np.uint64(int(tok, 0)) if tok[0].isdigit() else reg[tok]

    for stmt in (s.strip() for s in asm.strip().strip("{}").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        d, *args = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            v = val(args[0]) + np.zeros_like(reg[f"${n_out}"])
        elif op == "prmt.b32":
            v = _prmt(val(args[0]), val(args[1]), int(args[2], 0))
        elif op == "and.b32":
            v = val(args[0]) & val(args[1])
        elif op == "shl.b32":
            v = (val(args[0]) << np.uint64(int(args[1]))) & M32
        elif op == "shr.u32":
            v = val(args[0]) >> np.uint64(int(args[1]))
        elif op == "mad.lo.u32":
            v = (val(args[0]) * val(args[1]) + val(args[2])) & M32
        elif op == "mad.hi.u32":  # the high word of the 64-bit product (exact in uint64 for a power-of-2 factor)
            a, b = val(args[0]), int(val(args[1]))
            assert b & (b - 1) == 0, "the emulator takes power-of-2 factors only"
            v = ((a >> np.uint64(32 - b.bit_length() + 1)) + val(args[2])) & M32
        elif op == "lop3.b32":
            v = _lop3(val(args[0]), val(args[1]), val(args[2]), int(args[3], 0))
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        reg[d] = v
    return [reg[f"${i}"] for i in range(n_out)]


def expected(lo, codes, highs, base, e):
    """Output e of lane pair (2i, 2i + 1): slice e's element of each lane, lane 2i in the low half. lo: the lanes' lo
    words of slice e's half (byte e % 4); codes / highs: [lane 2i's word, 2i + 1's] (weights/oct.code_position)."""
    halves = []
    for lane, lo_word in enumerate(lo):
        byte = (lo_word >> np.uint64(8 * (e % 4))) & np.uint64(0xFF)
        word, nib = code_position(e, lane)  # lane 0 / 1 of the pair: the pair's word 0 (slices 0-3) or 1 (4-7)
        code = (codes[word] >> np.uint64(4 * nib)) & np.uint64(15)
        h = (highs[word] >> np.uint64(4 * nib)) & np.uint64(15)
        ex = (base + code + np.uint64(16) * h) % np.uint64(256)
        halves.append(((byte & np.uint64(0x80)) << np.uint64(8)) | (ex << np.uint64(7)) | (byte & np.uint64(0x7F)))
    return halves[0] | (halves[1] << np.uint64(16))


@pytest.mark.parametrize("seed", range(3))
def test_oct_asm_decodes_bytes_codes_and_high_nibbles(seed):
    rng = np.random.default_rng(seed)
    n = 20000
    La0, La1, Lb0, Lb1, C0, C1 = (rng.integers(0, 2 ** 32, n, dtype=np.uint64) for _ in range(6))
    has = rng.random(n) < 0.5  # half without escapes
    H0, H1 = (rng.integers(0, 2 ** 32, n, dtype=np.uint64) * has for _ in range(2))
    base = rng.integers(0, 241, n, dtype=np.uint64)
    base[:4] = [0, 240, 127, 1]  # window edges: exponents 0..15 and 240..255, sums that wrap past 255
    b2 = (base << np.uint64(7)) | (base << np.uint64(23))
    got = run_asm(OCT_ASM.value, [La0, La1, Lb0, Lb1, C0, C1, H0, H1, b2, b2], 8)
    for e, g in enumerate(got):
        w = expected((La0, La1) if e < 4 else (Lb0, Lb1), (C0, C1), (H0, H1), base, e)
        assert np.array_equal(g, w), f"output {e}: {np.flatnonzero(g != w)[:5]}"
