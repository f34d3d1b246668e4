"""The "oct" kernel layout of a W12 tensor: the packed-register decode's arrays (notes/w12-oct-plan.md).

Derived from a W12Tensor (the file format stays as it is); for K padded to Kp = ceil(K / 256) * 256 it holds:
- `words`  int32 [N, Kp/4]: per 256-element block of a row, 64 words; word j < 32 holds the sign+mantissa bytes of
  elements j, 32+j, 64+j, 96+j (byte q = element 32q + j), word 32 + j those of 128+j .. 224+j. A tile then decodes
  into eight 32-wide K slices with no interleave. Pad elements: byte 0, code 0.
- `codes`  int32 [N, Kp/8]: per block 32 words; nibble e of word j is the code of element 32e + j.
- `base`   int32 [N]: per row, the start of the 16-exponent window [base, base + 15] holding most of its elements;
  an element decodes to exponent base + code (no table gather: the decode adds). An element outside the window (an
  escape) gets the nearest code, and its cell's correction words carry the difference.
- `fat_cells` int32 [N, Kp/256]: per (row, block) cell, the index of its correction words in `fat`, or -1 when
  the cell holds no escape (random weights: 96% of cells; SmolLM2-135M's projections: 98%).
- `fat`    int32 [F, 4, 32]: per cell with escapes, word (q, j) = the exponent corrections of the output pair q of
  lane j, element 32q + j's at bit 7 and element 128 + 32q + j's at bit 23, summed mod 2^32: exactly what the
  decode adds to that pair's exponent bits (kernels/w12_tile.py), so a kernel patches escapes with one masked
  load and one add per pair, no search and no data-dependent loop (the loop stays one Triton can pipeline).
  A cell with escapes reads 512 more bytes: 1.52-1.58 bytes a weight in all on trained and random weights.
`decode_oct` is the reference decoder (plain torch, the kernels' integer steps, exact). The embedding (= LM head)
of SmolLM2-135M escapes ~1e-2 of its weights outside any 16-wide window (its common exponents are not contiguous),
so nearly every cell there carries corrections: keep such a tensor in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.weights.format import W12Tensor, _row_chunks, decode

BLOCK = 256  # elements of a row per block: eight 32-wide K slices
WINDOW = 16  # exponents the 4-bit codes span: base + 0 .. base + 15
EXP_SHIFTS = (7, 23)  # bit of a pair word where the low / high bf16 half's exponent starts


@dataclass(frozen=True, eq=False)
class OctLayout:
    shape: tuple[int, int]  # [N, K] of the source matrix
    words: torch.Tensor
    codes: torch.Tensor
    base: torch.Tensor
    fat_cells: torch.Tensor
    fat: torch.Tensor
    escapes: int  # elements outside their row's window (each corrected through `fat`)

    @property
    def padded_cols(self) -> int:
        return self.words.shape[1] * 4

    @property
    def kernel_bytes(self) -> int:
        """What one matmul over the layout reads (correction words only for the cells that have them)."""
        return sum(t.numel() * t.element_size() for t in (self.words, self.codes, self.base, self.fat_cells,
                                                           self.fat))


def _window_starts(exponents: torch.Tensor) -> torch.Tensor:
    """Per row of exponents (int64 [R, K]), the window start b in 0..240 with the most elements in [b, b + 15]
    (ties: the highest b, so a row whose exponents all fit starts its window at its lowest one)."""
    R = exponents.shape[0]
    hist = torch.zeros(R, 256, dtype=torch.int32, device=exponents.device)
    hist.scatter_add_(1, exponents, torch.ones_like(exponents, dtype=torch.int32))
    cum = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # cum[:, e] = elements with exponent < e
    covered = cum[:, WINDOW:] - cum[:, :-WINDOW]  # [R, 241]: elements in [b, b + 15] for b = 0..240
    return 256 - WINDOW - covered.flip(1).argmax(1)  # the last maximum


def _wrap_i32(v: torch.Tensor) -> torch.Tensor:
    """int64 values as the int32 words with the same low 32 bits."""
    v = v & 0xFFFFFFFF
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def oct_layout(w: W12Tensor) -> OctLayout:
    """The oct layout of a 2-D W12 tensor (exact: decode_oct(oct_layout(w)) == decode(w), bit for bit)."""
    if len(w.shape) != 2:
        raise ValueError(f"the oct layout is for 2-D weights, got shape {w.shape}")
    N, K = w.shape
    nb = -(-K // BLOCK)
    Kp = nb * BLOCK
    dev = w.device
    words = torch.empty(N, Kp // 4, dtype=torch.int32, device=dev)
    codes = torch.empty(N, Kp // 8, dtype=torch.int32, device=dev)
    base = torch.empty(N, dtype=torch.int32, device=dev)
    fat_cells = torch.full((N, nb), -1, dtype=torch.int32, device=dev)
    fats: list[torch.Tensor] = []
    escapes = 0
    for r0, r1 in _row_chunks(0, N, Kp):
        R = r1 - r0
        bits = decode(_rows(w, r0, r1)).view(torch.int16).reshape(R, K)
        ex = ((bits.to(torch.int64) >> 7) & 0xFF)
        b = _window_starts(ex)
        base[r0:r1] = b.to(torch.int32)
        code = (ex - b[:, None]).clamp(0, WINDOW - 1)
        delta = torch.nn.functional.pad(ex - b[:, None] - code, (0, Kp - K))  # nonzero only at escapes
        lo = ((bits >> 8) & 0x80 | (bits & 0x7F)).to(torch.uint8)
        lo = torch.nn.functional.pad(lo, (0, Kp - K))
        code = torch.nn.functional.pad(code, (0, Kp - K)).to(torch.uint8)
        # words: [R, nb, 2 halves, 4 bytes q, 32 j] -> [R, nb, 2, 32, 4]: little-endian byte q of word (half, j)
        words[r0:r1] = lo.view(R, nb, 2, 4, 32).transpose(3, 4).contiguous().view(torch.int32).reshape(R, -1)
        # codes: nibble e of word j; byte k of word j holds elements 32(2k) + j (low) and 32(2k+1) + j (high)
        c = code.view(R, nb, 4, 2, 32)
        packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(2, 3).contiguous()  # [R, nb, 32 j, 4 k]
        codes[r0:r1] = packed.view(torch.int32).reshape(R, -1)
        d = delta.view(R, nb, 2, 4, 32)  # [row, block, half, q, j]: element 128 * half + 32q + j
        corr = (d[:, :, 0] << EXP_SHIFTS[0]) + (d[:, :, 1] << EXP_SHIFTS[1])  # [R, nb, 4, 32]
        has = (d != 0).flatten(2).any(2)  # [R, nb]
        escapes += int((delta != 0).sum())
        if bool(has.any()):
            rows, blocks = has.nonzero(as_tuple=True)  # row-major: cells in ascending (row, block) order
            first = sum(f.shape[0] for f in fats)
            fat_cells[rows + r0, blocks] = torch.arange(first, first + rows.numel(), dtype=torch.int32, device=dev)
            fats.append(_wrap_i32(corr[rows, blocks]))
    fat = torch.cat(fats) if fats else torch.zeros(0, 4, 32, dtype=torch.int32, device=dev)
    return OctLayout((N, K), words, codes, base, fat_cells, fat.contiguous(), escapes)


def _rows(w: W12Tensor, r0: int, r1: int) -> W12Tensor:
    """Rows r0..r1 of a 2-D W12 tensor as a W12 tensor of its own (its groups and escapes cut to those rows)."""
    ends = w.group_ends.long()
    g0 = int((ends <= r0).sum())
    g1 = int((ends < r1).sum()) + 1
    cut = (ends[g0:g1].clamp(max=r1) - r0).to(torch.int32)
    esc = w.escapes[int(w.row_esc[r0]):int(w.row_esc[r1])]
    return W12Tensor((r1 - r0, w.cols), w.lo[r0:r1], w.codes[r0:r1], w.tables[g0:g1].contiguous(),
                     cut.contiguous(), esc.contiguous())


def decode_oct(layout: OctLayout) -> torch.Tensor:
    """The bf16 [N, K] matrix the layout holds, bit for bit, by the kernels' integer steps: per output pair the
    exponent word (codes at bits 7 and 23) + the row's base at both + the cell's correction word, then its two
    16-bit halves' exponent fields next to their sign and mantissa."""
    N, K = layout.shape
    nb = layout.padded_cols // BLOCK
    lo = layout.words.reshape(N, nb, 2, 32, 1).view(torch.uint8)  # [N, nb, 2, 32 j, 4 q]
    lo = lo.transpose(3, 4).to(torch.int64)  # [N, nb, half, q, j]: element 128 * half + 32q + j
    packed = layout.codes.reshape(N, nb, 32, 1).view(torch.uint8).to(torch.int64)  # [N, nb, 32 j, 4 k]
    code = torch.stack([packed & 15, packed >> 4], dim=-1)  # [N, nb, 32 j, 4 k, 2 i]: element 32(2k + i) + j
    code = code.reshape(N, nb, 32, 2, 4).permute(0, 1, 3, 4, 2)  # [N, nb, half, q, j]
    b = layout.base.to(torch.int64)[:, None, None, None]
    u = (code[:, :, 0] << EXP_SHIFTS[0]) + (code[:, :, 1] << EXP_SHIFTS[1]) + (b << EXP_SHIFTS[0]) \
        + (b << EXP_SHIFTS[1])  # [N, nb, q, j]
    f = layout.fat_cells.to(torch.int64)
    if layout.fat.numel():
        corr = layout.fat.to(torch.int64)[f.clamp(min=0)]  # [N, nb, 4, 32]
        u = u + torch.where((f >= 0)[:, :, None, None], corr, 0)
    u = u & 0xFFFFFFFF
    ex = torch.stack([(u >> 7) & 0xFF, (u >> 23) & 0xFF], dim=2)  # [N, nb, half, q, j]
    bits = ((lo & 0x80) << 8) | (ex << 7) | (lo & 0x7F)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    return bits.reshape(N, nb * BLOCK)[:, :K].to(torch.int16).view(torch.bfloat16).contiguous()
