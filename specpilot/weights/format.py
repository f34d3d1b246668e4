"""W12: lossless 12-bit storage of bf16 tensors (a sign+mantissa byte and a 4-bit exponent code, rare escapes).

A bf16 value is sign(1) exponent(8) mantissa(7). Trained weights use few exponents (about 2.6 bits of entropy), so
each row group keeps a table of its 15 most frequent exponents and a tensor viewed as [N, K] stores per element:
- `lo`     uint8 [N, K]: sign << 7 | mantissa, every bit the exponent does not hold (NaN payloads included);
- `codes`  uint8 [N, ceil(K/2)]: element 2j's code in the low nibble of byte j, element 2j+1's in the high one
  (a pad nibble, for odd K, is 0); code c < 15 means exponent tables[group][c];
- code 15 escapes: the element's exponent byte is the next entry of `escapes` (uint8 [E], in row-major order of
  the escaped elements), so a decoder finds it by counting escapes, with no stored positions and no search.
Row groups: `tables` uint8 [G, 16] (entry 15 unused) and `group_ends` int32 [G] (exclusive end row of each group).
G = 1 per tensor; `concat_rows` (q|k|v, gate|up) keeps each part's own table, so fusing stays exact.
Derived when a W12Tensor is built, for the kernels: `row_table` int32 [N] (each row's table) and `row_esc`
int32 [N + 1] (index in `escapes` of each row's first escape; row_esc[N] = E).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

ESCAPE = 15  # the code whose exponent lives in `escapes`
TABLE_SIZE = 16
_CHUNK_ELEMS = 1 << 24  # rows are encoded/decoded in chunks of about this many elements, to bound host memory


class W12Error(ValueError):
    """A W12 tensor or file is malformed, or does not decode to the bf16 tensor it came from."""


@dataclass(frozen=True)
class W12Stats:
    numel: int
    escapes: int
    groups: int
    stored_bytes: int  # lo + codes + escapes + tables + group ends: what the file holds
    kernel_bytes: int  # what one matmul reads: stored_bytes + the derived per-row table id and escape offset

    @property
    def escape_rate(self) -> float:
        return self.escapes / self.numel

    @property
    def bytes_per_weight(self) -> float:
        return self.stored_bytes / self.numel

    @property
    def kernel_bytes_per_weight(self) -> float:
        return self.kernel_bytes / self.numel

    def as_dict(self) -> dict[str, float | int]:
        return {"numel": self.numel, "escapes": self.escapes, "groups": self.groups,
                "stored_bytes": self.stored_bytes, "kernel_bytes": self.kernel_bytes,
                "escape_rate": self.escape_rate, "bytes_per_weight": self.bytes_per_weight,
                "kernel_bytes_per_weight": self.kernel_bytes_per_weight}


def sum_stats(stats: Iterable[W12Stats]) -> W12Stats:
    rows = list(stats)
    return W12Stats(*(sum(getattr(s, f) for s in rows) for f in ("numel", "escapes", "groups", "stored_bytes",
                                                                  "kernel_bytes")))


@dataclass(frozen=True, eq=False)
class W12Tensor:
    shape: tuple[int, ...]  # the source tensor's shape; stored as [N, K] = [prod(shape[:-1]), shape[-1]]
    lo: torch.Tensor
    codes: torch.Tensor
    tables: torch.Tensor
    group_ends: torch.Tensor
    escapes: torch.Tensor
    row_table: torch.Tensor = field(init=False, repr=False)
    row_esc: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        N, K = self.rows, self.cols
        if N < 1 or K < 1:
            raise W12Error(f"W12 tensors hold at least one element, got shape {self.shape}")
        if N * K >= 2 ** 31:
            raise W12Error(f"shape {self.shape}: {N * K} elements exceed the int32 escape offsets (< 2**31)")
        if not isinstance(self.lo, torch.Tensor):
            raise W12Error(f"W12 lo must be a torch.Tensor, got {type(self.lo).__name__}")
        dev = self.lo.device
        for name, dtype, shape in (("lo", torch.uint8, (N, K)), ("codes", torch.uint8, (N, (K + 1) // 2)),
                                   ("tables", torch.uint8, (None, TABLE_SIZE)), ("group_ends", torch.int32, (None,)),
                                   ("escapes", torch.uint8, (None,))):
            t = getattr(self, name)
            if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(shape) or t.device != dev
                    or not t.is_contiguous() or any(s is not None and s != d for s, d in zip(shape, t.shape))):
                got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise W12Error(f"W12 {name} must be a contiguous {dtype} tensor of shape {shape} on {dev}, got {got}")
        G = self.tables.shape[0]
        ends = self.group_ends.tolist()
        if G < 1 or len(ends) != G or ends[-1] != N or any(b <= a for a, b in zip([0] + ends, ends)):
            raise W12Error(f"group_ends {ends} must increase strictly to N={N}, one per table ({G})")
        if K % 2 and bool((self.codes[:, -1] >> 4).any()):
            raise W12Error("the pad nibble of odd-K codes must be 0")
        counts = torch.zeros(N, dtype=torch.int64, device=dev)
        for r0, r1 in _row_chunks(0, N, K):
            c = self.codes[r0:r1]
            counts[r0:r1] = ((c & 15) == ESCAPE).sum(1) + ((c >> 4) == ESCAPE).sum(1)
        row_esc = torch.zeros(N + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=row_esc[1:])
        if int(row_esc[-1]) != self.escapes.numel():
            raise W12Error(f"codes hold {int(row_esc[-1])} escapes but the escape list has {self.escapes.numel()}")
        sizes = torch.diff(self.group_ends, prepend=self.group_ends.new_zeros(1))
        object.__setattr__(self, "row_esc", row_esc.to(torch.int32))
        object.__setattr__(self, "row_table", torch.repeat_interleave(
            torch.arange(G, dtype=torch.int32, device=dev), sizes.to(torch.int64)))

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if self.shape else 1

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def device(self) -> torch.device:
        return self.lo.device

    @property
    def stats(self) -> W12Stats:
        parts = (self.lo, self.codes, self.escapes, self.tables, self.group_ends)
        stored = sum(t.numel() * t.element_size() for t in parts)
        derived = sum(t.numel() * t.element_size() for t in (self.row_table, self.row_esc))
        return W12Stats(self.lo.numel(), self.escapes.numel(), self.tables.shape[0], stored, stored + derived)

    def components(self) -> dict[str, torch.Tensor]:
        """The stored arrays, by component name (what a file holds; the derived arrays are rebuilt on load)."""
        return {"lo": self.lo, "codes": self.codes, "tables": self.tables, "group_ends": self.group_ends,
                "escapes": self.escapes}

    @classmethod
    def from_components(cls, shape: Sequence[int], parts: dict[str, torch.Tensor]) -> "W12Tensor":
        missing = {"lo", "codes", "tables", "group_ends", "escapes"} - set(parts)
        if missing:
            raise W12Error(f"W12 components missing: {sorted(missing)}")
        return cls(tuple(shape), parts["lo"], parts["codes"], parts["tables"], parts["group_ends"], parts["escapes"])

    def to(self, device: torch.device | str) -> "W12Tensor":
        return W12Tensor.from_components(self.shape, {k: v.to(device) for k, v in self.components().items()})


def _row_chunks(r0: int, r1: int, K: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMS // K)
    for a in range(r0, r1, step):
        yield a, min(a + step, r1)


def _group_ends(N: int, group_rows: int | None) -> list[int]:
    if group_rows is None:
        return [N]
    if isinstance(group_rows, bool) or not isinstance(group_rows, int) or group_rows < 1:
        raise W12Error(f"group_rows must be a positive int or None (one table per tensor), got {group_rows!r}")
    return [min(e, N) for e in range(group_rows, N + group_rows, group_rows)]


def _fixed_table(exponents: Sequence[int]) -> torch.Tensor:
    ex = [int(e) for e in exponents]
    if len(ex) != ESCAPE or len(set(ex)) != ESCAPE or not all(0 <= e <= 255 for e in ex):
        raise W12Error(f"exponents must be {ESCAPE} distinct ints in 0..255, got {list(exponents)}")
    return torch.tensor(ex + [0], dtype=torch.uint8)


def _exponents(v: torch.Tensor) -> torch.Tensor:
    """The exponent byte of bf16 values viewed as int16 (int16 arithmetic: half the memory traffic of int32)."""
    return ((v >> 7) & 0xFF).to(torch.uint8)


def encode(t: torch.Tensor, *, group_rows: int | None = None, exponents: Sequence[int] | None = None) -> W12Tensor:
    """Encode a bf16 tensor (any shape, viewed as [N, K] over its last dim) exactly into W12.

    group_rows: rows per exponent table (None: one table for the tensor). exponents: use these 15 exponents as
    every group's table instead of each group's 15 most frequent ones (ties broken by the lower exponent).
    """
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
        raise W12Error(f"W12 encodes bf16 tensors, got {getattr(t, 'dtype', type(t).__name__)}")
    shape = tuple(t.shape)
    K = shape[-1] if shape else 1
    if t.numel() == 0:
        raise W12Error(f"cannot encode an empty tensor of shape {shape}")
    x = t.detach().contiguous().reshape(-1, K)
    N, dev = x.shape[0], x.device
    ends = _group_ends(N, group_rows)
    starts = [0] + ends[:-1]
    if exponents is not None:
        tables = _fixed_table(exponents).to(dev).repeat(len(ends), 1)
    else:
        tables = torch.zeros(len(ends), TABLE_SIZE, dtype=torch.uint8, device=dev)
        for g, (a, b) in enumerate(zip(starts, ends)):
            hist = torch.zeros(256, dtype=torch.int64, device=dev)
            for r0, r1 in _row_chunks(a, b, K):
                hist += torch.bincount(_exponents(x[r0:r1].view(torch.int16)).flatten(), minlength=256)
            # stable sort: among equal counts the lower exponent comes first, so encoding is deterministic
            tables[g, :ESCAPE] = torch.sort(hist, descending=True, stable=True).indices[:ESCAPE].to(torch.uint8)
    luts = torch.full((len(ends), 256), ESCAPE, dtype=torch.uint8, device=dev)
    codes_of = torch.arange(ESCAPE, dtype=torch.uint8, device=dev).expand(len(ends), -1)
    luts.scatter_(1, tables[:, :ESCAPE].long(), codes_of)  # exponent -> code; any other exponent escapes
    lo = torch.empty(N, K, dtype=torch.uint8, device=dev)
    codes = torch.empty(N, (K + 1) // 2, dtype=torch.uint8, device=dev)
    escapes = []
    for g, (a, b) in enumerate(zip(starts, ends)):
        for r0, r1 in _row_chunks(a, b, K):
            v = x[r0:r1].view(torch.int16)
            ex = _exponents(v)
            lo[r0:r1] = (((v >> 8) & 0x80) | (v & 0x7F)).to(torch.uint8)
            c = luts[g][ex.long()]
            escapes.append(ex[c == ESCAPE])
            if K % 2:
                c = torch.cat([c, c.new_zeros(r1 - r0, 1)], dim=1)
            codes[r0:r1] = c[:, 0::2] | (c[:, 1::2] << 4)
    return W12Tensor(shape, lo, codes, tables, torch.tensor(ends, dtype=torch.int32, device=dev), torch.cat(escapes))


def decode(w: W12Tensor) -> torch.Tensor:
    """The bf16 tensor `w` encodes, bit for bit, with w's shape, on w's device."""
    N, K = w.rows, w.cols
    out = torch.empty(N, K, dtype=torch.int16, device=w.device)
    ends = w.group_ends.tolist()
    for g, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        table = w.tables[g]
        for r0, r1 in _row_chunks(a, b, K):
            packed = w.codes[r0:r1]
            c = torch.stack([packed & 15, packed >> 4], dim=2).reshape(r1 - r0, -1)[:, :K]
            ex = table[c.long()]
            ex[c == ESCAPE] = w.escapes[int(w.row_esc[r0]):int(w.row_esc[r1])]
            lo = w.lo[r0:r1]
            # sign bit from the int8 view (negative iff lo >= 128); exponent << 7 | mantissa fits in 15 bits
            sign = lo.view(torch.int8).to(torch.int16) & -32768
            out[r0:r1] = sign | (ex.to(torch.int16) << 7) | (lo & 0x7F).to(torch.int16)
    return out.view(torch.bfloat16).reshape(w.shape)


def concat_rows(parts: Sequence[W12Tensor]) -> W12Tensor:
    """The W12 tensor of torch.cat([decode(p) for p in parts]) along dim 0 (2-D parts), each part's tables kept."""
    if not parts:
        raise W12Error("concat_rows needs at least one tensor")
    K = parts[0].cols
    if any(len(p.shape) != 2 or p.cols != K or p.device != parts[0].device for p in parts):
        raise W12Error(f"concat_rows needs 2-D tensors of one width on one device, got {[p.shape for p in parts]}")
    offsets, ends = 0, []
    for p in parts:
        ends.append(p.group_ends.long() + offsets)
        offsets += p.rows
    return W12Tensor((offsets, K), torch.cat([p.lo for p in parts]), torch.cat([p.codes for p in parts]),
                     torch.cat([p.tables for p in parts]), torch.cat(ends).to(torch.int32),
                     torch.cat([p.escapes for p in parts]))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (so NaN payloads, -0 and +0 count; plain == would not)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    iview = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(iview), b.contiguous().view(iview))


def sha256_bf16(t: torch.Tensor) -> str:
    """sha256 of a bf16 tensor's row-major bytes (the content hash the manifest records for each source tensor)."""
    data = t.detach().contiguous().view(torch.int16).reshape(-1).cpu().numpy()
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()
