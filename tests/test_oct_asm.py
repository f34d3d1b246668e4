"""The W12 decode's inline PTX (kernels/w12_tile.OCT_ASM), run on CPU by emulating its instructions: every output
bf16 has the sign and mantissa of its byte and the exponent base + code + 16 * high nibble (mod 256). The GPU kernels
run this text (the interpreter runs `_oct_pair` instead, checked by tests/test_weights_w12.py); the H200 checks both
against bf16 bit for bit, and this test keeps a change to the PTX honest where no GPU is at hand."""
from __future__ import annotations

import re

import numpy as np
import pytest

from specpilot.kernels.w12_tile import OCT_ASM

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
    """Outputs $0..$(n_out-1) (16-bit) of the PTX subset the decode uses, inputs $n_out.. as uint32 arrays."""
    reg: dict[str, np.ndarray] = {f"${n_out + i}": x.astype(np.uint64) & M32 for i, x in enumerate(inputs)}

    def val(tok: str):
        tok = tok.strip()
        return np.uint64(int(tok, 0)) if tok[0].isdigit() else reg[tok]

    for stmt in (s.strip() for s in asm.strip().strip("{}").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        pair = re.fullmatch(r"\{(\$\d+),\s*(\$\d+)\},\s*(\w+)", rest)
        if op == "mov.b32" and pair:
            r = reg[pair.group(3)]
            reg[pair.group(1)], reg[pair.group(2)] = r & np.uint64(0xFFFF), r >> np.uint64(16)
            continue
        d, *args = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            v = val(args[0]) + np.zeros_like(reg[f"${n_out}"])
        elif op == "prmt.b32":
            v = _prmt(val(args[0]), val(args[1]), int(args[2], 0))
        elif op == "shl.b32":
            v = (val(args[0]) << np.uint64(int(args[1]))) & M32
        elif op == "shr.u32":
            v = val(args[0]) >> np.uint64(int(args[1]))
        elif op == "and.b32":
            v = val(args[0]) & val(args[1])
        elif op == "or.b32":
            v = val(args[0]) | val(args[1])
        elif op == "add.u32":
            v = (val(args[0]) + val(args[1])) & M32
        elif op == "lop3.b32":
            v = _lop3(val(args[0]), val(args[1]), val(args[2]), int(args[3], 0))
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        reg[d] = v
    return [reg[f"${i}"] for i in range(n_out)]


def expected(La, Lb, Cw, H, base):
    """Output e (slice e, element 32e + j): byte e % 4 of La (e < 4) or Lb, code and high nibble e."""
    out = []
    for e in range(8):
        byte = ((La if e < 4 else Lb) >> np.uint64(8 * (e % 4))) & np.uint64(0xFF)
        code = (Cw >> np.uint64(4 * e)) & np.uint64(15)
        h = (H >> np.uint64(4 * e)) & np.uint64(15)
        ex = (base + code + np.uint64(16) * h) % np.uint64(256)
        out.append(((byte & np.uint64(0x80)) << np.uint64(8)) | (ex << np.uint64(7)) | (byte & np.uint64(0x7F)))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_oct_asm_decodes_bytes_codes_and_high_nibbles(seed):
    rng = np.random.default_rng(seed)
    n = 20000
    La, Lb, Cw = (rng.integers(0, 2 ** 32, n, dtype=np.uint64) for _ in range(3))
    H = rng.integers(0, 2 ** 32, n, dtype=np.uint64) * (rng.random(n) < 0.5)  # half without escapes
    base = rng.integers(0, 241, n, dtype=np.uint64)
    base[:4] = [0, 240, 127, 1]  # window edges: exponents 0..15 and 240..255, sums that wrap past 255
    b2 = (base << np.uint64(7)) | (base << np.uint64(23))
    got = run_asm(OCT_ASM.value, [La, Lb, Cw, H, b2], 8)
    for e, (g, w) in enumerate(zip(got, expected(La, Lb, Cw, H, base))):
        assert np.array_equal(g, w), f"output {e}: {np.flatnonzero(g != w)[:5]}"
