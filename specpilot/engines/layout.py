"""Host-side layouts of a verify block, built once per block shape and cached.

With CUDA graphs a speculative step's device work is a few replays; what the host does between them (ancestor
matrices, depths, the padded verify inputs, their validation) leaves the GPU idle. A block drafter in chain mode
proposes the same shape every step, and best-first trees repeat a few shapes, so these are computed once per
shape instead of once per step (a 16-node chain: an O(n) Python loop of numpy row ops plus five numpy
validations a step before). Cached arrays are shared between steps: they are read-only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


def bucket(n: int) -> int:
    """The smallest power of two >= n: verify widths come in these buckets (one CUDA graph each)."""
    b = 1
    while b < n:
        b *= 2
    return b


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class DraftLayout:
    """A draft tree's verify block: the root (last committed token) at index 0, draft node i at i + 1."""
    parents: tuple[int, ...]  # parents[0] = -1
    depths: tuple[int, ...]  # depths[0] = 0
    anc: np.ndarray  # [n, n] read-only: anc[i, j] = j is an ancestor-or-self of i
    chain: bool  # every node's parent is the one before it: the accepted path is a prefix of the block

    @property
    def max_depth(self) -> int:
        return self.depths[-1] if self.chain else max(self.depths)


def tree_anc(parents: list[int] | tuple[int, ...]) -> np.ndarray:
    """parents[0] = -1 (root); parents[i] < i. anc[i, j] = j is an ancestor-or-self of i."""
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        anc[i, i] = True
        p = parents[i]
        if p >= 0:
            anc[i] |= anc[p]
    return anc


@functools.lru_cache(maxsize=256)  # a 256-node tree's matrices are ~66 KB: bounded
def draft_layout(draft_parents: tuple[int, ...]) -> DraftLayout:
    """The block layout of a draft tree whose node i hangs off draft_parents[i] (-1: the root)."""
    parents = (-1,) + tuple(p + 1 for p in draft_parents)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"draft node {i - 1} has parent {p - 1}: parents must precede their children")
    anc = tree_anc(parents)
    depths = tuple(int(d) - 1 for d in anc.sum(1))  # ancestors-or-self minus one
    chain = all(p == i - 1 for i, p in enumerate(parents))
    return DraftLayout(parents, depths, _frozen(anc), chain)


@dataclass(frozen=True)
class VerifyLayout:
    """A validated block of n rows as one runner pads it: `padded` rows in forwards of `width` rows."""
    n: int
    width: int
    padded: int
    positions: np.ndarray  # [padded] position - base per row (pad rows at their own slot)
    slots: np.ndarray  # [padded] slot - base per row
    anc: np.ndarray  # [padded, block_width]: the block's ancestors; pad rows see themselves


def verify_layout(n: int, anc: np.ndarray, depths, tile: int, block_width: int) -> VerifyLayout:
    """Validates (anc, depths) of an n-token block and pads them for a runner of this tile / block_width. Cached on
    their content: a shape seen before costs a hash of its bytes instead of the numpy checks and padded arrays."""
    anc = np.asarray(anc, dtype=bool)
    return _verify_layout(n, anc.shape, anc.tobytes(), tuple(depths), tile, block_width)


@functools.lru_cache(maxsize=256)  # a 256-node tree's matrices are ~66 KB: bounded
def _verify_layout(n: int, shape: tuple[int, ...], anc_bytes: bytes, depths: tuple[int, ...], tile: int,
                   block_width: int) -> VerifyLayout:
    anc = np.frombuffer(anc_bytes, dtype=bool).reshape(shape)
    if anc.shape != (n, n) or len(depths) != n or np.triu(anc, 1).any() or not anc.diagonal().all() or \
            not np.array_equal(anc.sum(1) - 1, np.asarray(depths)):
        # position_slots reads row i's ancestor at depth e as its (e+1)-th ancestor in block order
        raise ValueError("anc must be ancestor-or-self of a block whose parents precede their children, "
                         "with depths[j] = (ancestors of j) - 1")
    width = tile or bucket(n)
    padded = -(-n // width) * width
    slots = np.arange(padded)
    positions = slots.copy()
    positions[:n] = depths
    anc_full = np.eye(padded, block_width, dtype=bool)  # pad rows see the context and themselves
    anc_full[:n, :n] = anc
    return VerifyLayout(n, width, padded, _frozen(positions), _frozen(slots), _frozen(anc_full))
