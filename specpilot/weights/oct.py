"""The "oct" kernel layout of a W12 tensor: the packed-register decode's arrays (notes/w12-oct-plan.md).

Derived from a W12Tensor (the file format stays as it is); for K padded to Kp = ceil(K / 256) * 256 it holds:
- `words`  int32 [N, Kp/4]: per 256-element block of a row, 64 words; word j < 32 holds the sign+mantissa bytes of
  elements j, 32+j, 64+j, 96+j (byte q = element 32q + j), word 32 + j those of 128+j .. 224+j. A tile then decodes
  into eight 32-wide K slices with no interleave. Pad elements: byte 0, code 0.
- `codes`  int32 [N, Kp/8]: per block 32 words in lane pairs (2i, 2i + 1): word 2i holds slices 0-3, word 2i + 1
  slices 4-7, nibble q the code of lane 2i's element of slice q (or 4 + q), nibble q + 4 lane 2i + 1's (element
  32e + j is lane j of slice e; `code_position`). A kernel's decode gets both lanes' words at once (they are one MMA
  operand register: two consecutive K), so each of its eight outputs is one packed bf16 pair, no repacking.
- `base`   int32 [N]: per row, the start of the 16-exponent window [base, base + 15] holding most of its elements.
  An element's exponent is base + code + 16 * h (mod 256), h = 0 inside the window (no table gather: the decode adds).
- `fat_cells` int32 [N, Kp/256]: per (row, block) cell, the index of its high-nibble word block in `fat`, or -1 when
  the cell holds no escape (no element outside the window; random weights: 98% of cells, SmolLM2-135M's
  projections: 98%).
- `fat`    int32 [F, 32]: per cell with escapes, the high nibbles h in the positions of `codes`. A kernel loads
  it under a mask that is false for cells without escapes (they read nothing more) and adds it to the exponent bits
  next to the code: one load per lane and three integer instructions per two weights, no search and no
  data-dependent loop (the loop stays one Triton can pipeline). 128 more bytes per cell with escapes: ~1.52 bytes a
  weight on random Llama-like weights.
`decode_oct` is the reference decoder (plain torch, exact). The embedding (= LM head) of SmolLM2-135M escapes ~1e-2
of its weights outside any 16-wide window (its common exponents are not contiguous), so most cells there carry high
nibbles: W12Weights.kernel_layouts keeps such a tensor in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.weights.format import W12Tensor, _row_chunks, decode

BLOCK = 256  # elements of a row per block: eight 32-wide K slices
WINDOW = 16  # exponents the 4-bit codes span: base + 0 .. base + 15


def code_position(e: torch.Tensor | int, j: torch.Tensor | int):
    """(word, nibble) of a block's code (and high-nibble) words holding element 32e + j (slice e, lane j)."""
    return (j & ~1) + (e >= 4), e % 4 + 4 * (j & 1)


_E, _J = torch.meshgrid(torch.arange(8), torch.arange(32), indexing="ij")  # [8 slices, 32 lanes]
_WORD, _NIBBLE = code_position(_E, _J)


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """[..., 8 e, 32 j] values 0..15 -> int32 [..., 32] words, each at its code_position."""
    shifted = (nib.to(torch.int64) << (4 * _NIBBLE.to(nib.device))).flatten(-2)
    idx = _WORD.to(nib.device).flatten().expand_as(shifted)
    words = torch.zeros(*nib.shape[:-2], 32, dtype=torch.int64, device=nib.device).scatter_add_(-1, idx, shifted)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@dataclass(frozen=True, eq=False)
class OctLayout:
    shape: tuple[int, int]  # [N, K] of the source matrix
    words: torch.Tensor
    codes: torch.Tensor
    base: torch.Tensor
    fat_cells: torch.Tensor
    fat: torch.Tensor
    escapes: int  # elements outside their row's window (their high nibbles in `fat`)

    @property
    def padded_cols(self) -> int:
        return self.words.shape[1] * 4

    def clone(self) -> "OctLayout":
        """A copy in fresh memory (benchmarks cycle through copies so the weights come from HBM)."""
        return OctLayout(self.shape, self.words.clone(), self.codes.clone(), self.base.clone(), self.fat_cells.clone(),
                         self.fat.clone(), self.escapes)

    @property
    def kernel_bytes(self) -> int:
        """What one matmul over the layout reads (high nibbles only for the cells that have them)."""
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
        off = torch.nn.functional.pad((ex - b[:, None]) % 256, (0, Kp - K))  # code + 16 h; pads: 0
        code = (off % WINDOW).to(torch.uint8)
        lo = ((bits >> 8) & 0x80 | (bits & 0x7F)).to(torch.uint8)
        lo = torch.nn.functional.pad(lo, (0, Kp - K))
        # words: [R, nb, 2 halves, 4 bytes q, 32 j] -> [R, nb, 2, 32, 4]: little-endian byte q of word (half, j)
        words[r0:r1] = lo.view(R, nb, 2, 4, 32).transpose(3, 4).contiguous().view(torch.int32).reshape(R, -1)
        codes[r0:r1] = pack_nibbles(code.view(R, nb, 8, 32)).reshape(R, -1)
        h = (off >> 4).view(R, nb, 8, 32)  # [row, block, e, j]: element 32e + j
        has = (h != 0).flatten(2).any(2)  # [R, nb]
        escapes += int((h != 0).sum())
        if bool(has.any()):
            rows, blocks = has.nonzero(as_tuple=True)  # row-major: cells in ascending (row, block) order
            first = sum(f.shape[0] for f in fats)
            fat_cells[rows + r0, blocks] = torch.arange(first, first + rows.numel(), dtype=torch.int32, device=dev)
            fats.append(pack_nibbles(h[rows, blocks]))  # [cells, 32]
    fat = torch.cat(fats) if fats else torch.zeros(0, 32, dtype=torch.int32, device=dev)
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
    """The bf16 [N, K] matrix the layout holds, bit for bit (the reference the kernels decode against)."""
    N, K = layout.shape
    nb = layout.padded_cols // BLOCK
    lo = layout.words.reshape(N, nb, 2, 32, 1).view(torch.uint8)  # [N, nb, 2, 32 j, 4 q]
    lo = lo.transpose(3, 4).reshape(N, nb * BLOCK).to(torch.int64)  # element 128 * half + 32q + j
    code = _nibbles(layout.codes.reshape(N, nb, 32))
    f = layout.fat_cells.to(torch.int64)
    h = torch.zeros(N, nb, 32, dtype=torch.int64, device=f.device)
    if layout.fat.numel():
        h = torch.where((f >= 0)[:, :, None], layout.fat.to(torch.int64)[f.clamp(min=0)], 0)
    ex = (layout.base.to(torch.int64)[:, None] + code + 16 * _nibbles(h)) % 256
    bits = ((lo & 0x80) << 8) | (ex << 7) | (lo & 0x7F)  # sign at bit 15 of the int16 below
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    return bits[:, :K].to(torch.int16).view(torch.bfloat16).contiguous()


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[N, nb, 32] code or high-nibble words -> int64 [N, nb * 256], element order (32e + j)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    N, nb = w.shape[:2]
    vals = w[:, :, _WORD.to(w.device)] >> (4 * _NIBBLE.to(w.device))  # [N, nb, 8 e, 32 j]
    return (vals & 15).reshape(N, nb * BLOCK)
