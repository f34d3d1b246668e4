"""Paged KV cache: one tensor of fixed-size pages, a free list, and per-request page lists.

Layout [2 (k, v), layers, kv_heads, num_pages * PAGE, head_dim]: per layer a [kv_heads, S, D] cache exactly
like the single-request runner's, so the rotary/KV-write kernel is reused as is (a token's slot is the
physical slot of its logical position). PAGE is the attention kernel's split_keys, so each split of the
attention reduction reads one page.

A request reserves every page it can ever need when it is admitted (prompt + max_new_tokens positions; a
verify block never writes past the last position because drafts are capped by the tokens still allowed), so
a running request never waits for memory and nothing is preempted. Pages go back to the free list when the
request finishes. Host-side bookkeeping only: no device work, no sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.engines.batch.paged_attn import PAGE


class OutOfPages(RuntimeError):
    """The cache has too few free pages for a request (the scheduler leaves it waiting)."""


def pages_for(positions: int, page: int = PAGE) -> int:
    return -(-positions // page)


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    num_pages: int
    page: int = PAGE

    @property
    def slots(self) -> int:
        return self.num_pages * self.page

    def bytes(self, elem_size: int) -> int:
        return 2 * self.layers * self.kv_heads * self.slots * self.head_dim * elem_size


class PagedKVCache:
    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device | str):
        if shape.num_pages < 1:
            raise ValueError(f"num_pages={shape.num_pages}: need at least one page")
        self.shape = shape
        # Zeros, not empty: the kernels may load (and then mask) stale slots of a page; they must be finite.
        self.kv = torch.zeros(2, shape.layers, shape.kv_heads, shape.slots, shape.head_dim, dtype=dtype,
                              device=device)
        self._free = list(range(shape.num_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def can_hold(self, positions: int) -> bool:
        return pages_for(positions, self.shape.page) <= len(self._free)

    def allocate(self, positions: int) -> list[int]:
        """Pages for logical positions 0 .. positions-1 (in logical order)."""
        n = pages_for(positions, self.shape.page)
        if n > len(self._free):
            raise OutOfPages(f"{positions} positions need {n} pages; {len(self._free)} of "
                             f"{self.shape.num_pages} are free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages) or any(not 0 <= p < self.shape.num_pages for p in pages):
            raise ValueError(f"bad page list {pages}")
        if set(pages) & set(self._free):
            raise ValueError("releasing a page that is already free")
        self._free.extend(reversed(pages))
