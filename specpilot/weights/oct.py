"""The "oct" kernel layout of a W12 tensor: the packed-register decode's arrays (notes/w12-oct-plan.md, step 1).

Measured on an H200 (notes/h200.md, session 13; scripts/gpu_w12_variants.py) this layout lets a GEMV decode W12
at bf16 speed, where the package's kernel over `lo`/`codes` runs at 0.09-0.12x. It is derived from a W12Tensor (the
file format stays as it is) and holds, for K padded to Kp = ceil(K / 256) * 256 (pad elements: lo 0, code 0):
- `words`  int32 [N, Kp/4]: per 256-element block of a row, 64 words; word j < 32 holds the lo bytes of elements
  j, 32+j, 64+j, 96+j (byte q = element 32q + j), word 32 + j those of 128+j .. 224+j. A tile then decodes into
  eight 32-wide K slices with no interleave.
- `codes`  int32 [N, Kp/8]: per block 32 words; nibble e of word j is the code of element 32e + j.
- `base`   int32 [N]: per row, the start of the 15-exponent window [base, base + 14] that holds most of the row's
  elements; code = exponent - base inside the window, else 15 (an escape). No table gather: the decode adds.
- `cell_esc` int32 [N * Kp/256 + 1] and `escapes` int32 [E]: the escapes of (row r, block b) are
  escapes[cell_esc[r * Kp/256 + b] : cell_esc[r * Kp/256 + b + 1]], each position in the block (bits 0-7) |
  exponent (bits 8-15), in ascending position. Compressed rows, not a fixed number of slots per (row, block): on
  SmolLM2-135M (Q4_1-dequantised) escapes are 3e-4 of the projections' weights but clustered, 98% of (row, block)
  cells hold none and some hold 11-17, so slots sized by the most would cost 0.17-0.27 bytes a weight
  (notes/h200.md, session 14).
- `slots`  int32 [N, Kp/256]: each cell's first escape | SLOT_VALID (| SLOT_MORE when it holds more), else 0. A
  kernel loads it with the block's bytes (no load that waits on another) and patches that escape always; only a
  cell with SLOT_MORE sends it through `escapes` (random weights: 3.9% of cells hold one, 0.08% more than one).
`decode_oct` is the reference decoder (plain torch, exact); the W12 projection kernels (kernels/w12_tile.py) decode
the same bits from these arrays. Measured on SmolLM2-135M's 121 matrices (all exact): the
projections need 1.90 bytes a weight here against W12's 1.51, all of it the K padding (576 -> 768 for q|k|v, o and
gate|up; down's 1536 pads nothing), so K tails need a packing of their own before a kernel reads this; the
embedding (= LM head) escapes 1.0e-2 of its weights outside any 15-wide window where W12's table (not contiguous)
escapes none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.weights.format import ESCAPE, W12Tensor, _row_chunks, decode

BLOCK = 256  # elements of a row per block: eight 32-wide K slices
SLOT_VALID = 1 << 16  # slots: the cell holds an escape (the word's low 16 bits are its first, as in `escapes`)
SLOT_MORE = 1 << 17  # slots: the cell holds more than one (the rest only in `escapes`)
WINDOW = ESCAPE  # exponents a code spans (codes 0..14); 15 escapes


@dataclass(frozen=True, eq=False)
class OctLayout:
    shape: tuple[int, int]  # [N, K] of the source matrix
    words: torch.Tensor
    codes: torch.Tensor
    base: torch.Tensor
    cell_esc: torch.Tensor
    escapes: torch.Tensor
    slots: torch.Tensor

    @property
    def padded_cols(self) -> int:
        return self.words.shape[1] * 4

    @property
    def cell_counts(self) -> torch.Tensor:
        """Escapes per (row, block), [N, Kp/256]."""
        return torch.diff(self.cell_esc).view(self.shape[0], -1)

    @property
    def kernel_bytes(self) -> int:
        """What one matmul over the layout reads."""
        return sum(t.numel() * t.element_size() for t in (self.words, self.codes, self.base, self.cell_esc,
                                                           self.escapes, self.slots))


def _window_starts(exponents: torch.Tensor) -> torch.Tensor:
    """Per row of exponents (int64 [R, K]), the window start b in 0..241 with the most elements in [b, b + 14]
    (ties: the highest b, so a row whose exponents all fit starts its window at its lowest one)."""
    R = exponents.shape[0]
    hist = torch.zeros(R, 256, dtype=torch.int32, device=exponents.device)
    hist.scatter_add_(1, exponents, torch.ones_like(exponents, dtype=torch.int32))
    cum = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # cum[:, e] = elements with exponent < e
    covered = cum[:, WINDOW:] - cum[:, :-WINDOW]  # [R, 242]: elements in [b, b + 14] for b = 0..241
    return 241 - covered.flip(1).argmax(1)  # the last maximum: a row's window starts at its lowest exponent


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
    escaped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (row, element, exponent) per chunk
    for r0, r1 in _row_chunks(0, N, Kp):
        R = r1 - r0
        bits = decode(_rows(w, r0, r1)).view(torch.int16).reshape(R, K)
        ex = ((bits.to(torch.int64) >> 7) & 0xFF)
        b = _window_starts(ex)
        base[r0:r1] = b.to(torch.int32)
        code = ex - b[:, None]
        esc = (code < 0) | (code >= WINDOW)
        code = torch.where(esc, ESCAPE, code)
        lo = ((bits >> 8) & 0x80 | (bits & 0x7F)).to(torch.uint8)
        lo = torch.nn.functional.pad(lo, (0, Kp - K))
        code = torch.nn.functional.pad(code, (0, Kp - K)).to(torch.uint8)
        # words: [R, nb, 2 halves, 4 bytes q, 32 j] -> [R, nb, 2, 32, 4]: little-endian byte q of word (half, j)
        words[r0:r1] = lo.view(R, nb, 2, 4, 32).transpose(3, 4).contiguous().view(torch.int32).reshape(R, -1)
        # codes: nibble e of word j; byte k of word j holds elements 32(2k) + j (low) and 32(2k+1) + j (high)
        c = code.view(R, nb, 4, 2, 32)
        packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(2, 3).contiguous()  # [R, nb, 32 j, 4 k]
        codes[r0:r1] = packed.view(torch.int32).reshape(R, -1)
        rows, cols = esc.nonzero(as_tuple=True)
        escaped.append((rows + r0, cols, ex[rows, cols]))
    rows, cols, exps = (torch.cat(parts) for parts in zip(*escaped))
    cell = rows * nb + cols // BLOCK  # ascending: nonzero gives row-major order, chunks ascend
    cell_esc = torch.zeros(N * nb + 1, dtype=torch.int32, device=dev)
    torch.cumsum(torch.bincount(cell, minlength=N * nb), 0, out=cell_esc[1:])
    escapes = ((cols % BLOCK) | (exps << 8)).to(torch.int32)
    return OctLayout((N, K), words, codes, base, cell_esc, escapes, _first_slots(cell_esc, escapes, N))


def _first_slots(cell_esc: torch.Tensor, escapes: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [N, Kp/256]: each cell's first escape | SLOT_VALID, | SLOT_MORE when the cell holds more; else 0."""
    counts = torch.diff(cell_esc)
    if escapes.numel() == 0:
        return torch.zeros(rows, counts.numel() // rows, dtype=torch.int32, device=cell_esc.device)
    first = escapes[cell_esc[:-1].clamp(max=escapes.numel() - 1).long()]
    slot = torch.where(counts > 0, first | SLOT_VALID, 0) | torch.where(counts > 1, SLOT_MORE, 0)
    return slot.to(torch.int32).reshape(rows, -1).contiguous()


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
    """The bf16 [N, K] matrix the layout holds, bit for bit (the reference the oct kernels decode against)."""
    N, K = layout.shape
    nb = layout.padded_cols // BLOCK
    lo = layout.words.reshape(N, nb, 2, 32, 1).view(torch.uint8)  # [N, nb, 2, 32 j, 4 q]
    lo = lo.transpose(3, 4).reshape(N, nb * BLOCK).to(torch.int32)  # element 128 * half + 32q + j
    packed = layout.codes.reshape(N, nb, 32, 1).view(torch.uint8).to(torch.int32)  # [N, nb, 32 j, 4 k]
    code = torch.stack([packed & 15, packed >> 4], dim=-1)  # [N, nb, 32 j, 4 k, 2 i]: element 32(2k + i) + j
    code = code.reshape(N, nb, 32, 8).transpose(2, 3).reshape(N, nb * BLOCK)
    ex = layout.base[:, None].to(torch.int32) + code
    counts = torch.diff(layout.cell_esc).to(torch.int64)
    cell = torch.repeat_interleave(torch.arange(N * nb, device=ex.device), counts)
    esc = layout.escapes.to(torch.int64)
    ex[cell // nb, (cell % nb) * BLOCK + (esc & 0xFF)] = ((esc >> 8) & 0xFF).to(torch.int32)
    bits = ((lo & 0x80) << 8) | (ex << 7) | (lo & 0x7F)  # sign at bit 15 of the int16 below
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    return bits[:, :K].to(torch.int16).view(torch.bfloat16).contiguous()
