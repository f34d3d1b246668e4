"""Recurrent state of the Gated DeltaNet layers: the per-verify schedule, the committed state, and the commit.

A verify block is a tree of rows (row 0 = the pending root, whose parent -1 is the committed state). A row's
recurrent state follows its parent (see specpilot.kernels.gdn): the scan keeps one state on chip, and leaf rows
are *held* (they leave their parent's state there for their siblings). The schedule stores a row's state when
 - a later row resumes from it (its parent's state is not on chip, e.g. the row starts a forward chunk);
 - it is a rollback checkpoint: depth % spacing == spacing - 1 (the committed state acts as depth -1);
 - the caller asks for it (`keep`: prefill stores its last row so its commit is a copy).
Committing row e then takes e's stored state, or replays the rows between e's nearest stored ancestor and e
(at most spacing - 1 of them) from their saved inputs with the same arithmetic: exact, never a crop.
The causal conv1d reads the K-1 inputs before a row along its ancestor path; the window indexes
[committed conv rows (K-1) ; block rows], oldest first, so index r < K-1 is a committed row.

Per GDN layer the runner owns (RecurrentCache) the committed state [v_heads, d_k, d_v] (fp32) and the last K-1
conv inputs, the checkpoint slots the tree scan writes during a verify, and the verify's per-row scan inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specpilot.engines.hybrid.config import GdnBackend, HybridShape
from specpilot.kernels import gdn as gdn_kernels


def parents_from_anc(anc: np.ndarray) -> list[int]:
    """anc[i, j]: j is an ancestor-or-self of i (rows in topological order). The parent is the nearest ancestor."""
    out = []
    for i in range(anc.shape[0]):
        above = np.flatnonzero(anc[i, :i])
        out.append(int(above[-1]) if above.size else -1)
    return out


def dfs_order(parents: list[int]) -> list[int]:
    """Rows in depth-first order, leaf children first (then the others, each in block order): leaves and the
    first inner child continue from their parent's on-chip state; only later inner children resume from memory."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    for kids in children.values():
        kids.sort(key=lambda c: (c in children, c))
    order, stack = [], list(reversed(children.get(-1, [])))
    while stack:
        row = stack.pop()
        order.append(row)
        stack.extend(reversed(children.get(row, [])))
    return order


@dataclass(frozen=True)
class BlockSchedule:
    parents: tuple[int, ...]  # per real row; -1 = the committed state
    depths: tuple[int, ...]  # root rows have depth 0
    hold: tuple[bool, ...]  # leaf rows: the scan keeps their parent's state on chip
    resume: tuple[bool, ...]  # rows whose parent's state is loaded from memory
    store: tuple[int, ...]  # checkpoint slot per row, -1 = not stored
    chunk: int  # rows per forward; each forward's first row resumes from memory
    spacing: int

    @classmethod
    def build(cls, parents: list[int], chunk: int, spacing: int, keep: tuple[int, ...] = ()) -> "BlockSchedule":
        if chunk < 1 or spacing < 1:
            raise ValueError(f"chunk={chunk} and spacing={spacing} must be >= 1")
        depths: list[int] = []
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"row {i} has parent {p}: parents must precede their rows")
            depths.append(0 if p < 0 else depths[p] + 1)
        need = [(d + 1) % spacing == 0 for d in depths]
        hold = [True] * len(parents)
        for p in parents:
            if p >= 0:
                hold[p] = False
        resume, owner = [], -2  # as the scan runs: the row owning the on-chip state (-1 committed, -2 none)
        for i, p in enumerate(parents):
            if i % chunk == 0:
                owner = -2
            resume.append(p != owner)
            if resume[-1] and p >= 0:
                need[p] = True
            owner = p if hold[i] else i
        for k in keep:
            need[k] = True
        store, slots = [], 0
        for flag in need:
            store.append(slots if flag else -1)
            slots += flag
        return cls(tuple(parents), tuple(depths), tuple(hold), tuple(resume), tuple(store), chunk, spacing)

    @property
    def rows(self) -> int:
        return len(self.parents)

    @property
    def stored(self) -> int:
        return sum(s >= 0 for s in self.store)

    def resumes(self) -> int:
        """Rows whose parent's state is loaded from memory (committed state or a checkpoint)."""
        return sum(self.resume)

    def path(self, row: int) -> list[int]:
        out = []
        while row >= 0:
            out.append(row)
            row = self.parents[row]
        return out[::-1]

    def replay(self, row: int) -> tuple[int, list[int]]:
        """(slot to start from, -1 = the committed state; rows to replay in order) to rebuild `row`'s state."""
        todo = []
        while row >= 0 and self.store[row] < 0:
            todo.append(row)
            row = self.parents[row]
        return (self.store[row] if row >= 0 else -1), todo[::-1]

    def conv_windows(self, kernel: int, rows: int) -> np.ndarray:
        """[rows, K-1] int64 windows; rows past the real ones (padding) hang off the committed state."""
        win = np.empty((rows, kernel - 1), dtype=np.int64)
        for i in range(rows):
            seq, j, r = [], (self.parents[i] if i < self.rows else -1), kernel - 2
            while len(seq) < kernel - 1:
                if j >= 0:
                    seq.append(kernel - 1 + j)
                    j = self.parents[j]
                else:
                    seq.append(r)
                    r -= 1
            win[i] = seq[::-1]
        return win

    def conv_after(self, kernel: int, row: int) -> np.ndarray:
        """Indices of the K-1 conv rows committed with `row`: its window's newest K-2 entries, then itself."""
        return np.append(self.conv_windows(kernel, row + 1)[row, 1:], kernel - 1 + row)


@dataclass(frozen=True)
class ScanPlan:
    """What one forward (one chunk of a verify block) tells the GDN layers, as device tensors."""

    parents: torch.Tensor  # [real] global row indices, -1 = committed state
    hold: torch.Tensor  # [real] 1 = the row leaves its parent's state on chip
    store: torch.Tensor  # [block rows] checkpoint slot per row, -1 = not stored
    windows: torch.Tensor  # [width, K-1] conv windows into [committed conv rows ; block rows]
    offset: int  # global index of the chunk's first row
    real: int  # rows of this chunk that are block rows (the rest is padding)
    backend: GdnBackend


def run_scan(backend: GdnBackend, *args, offset: int = 0) -> torch.Tensor:
    if backend is GdnBackend.TRITON:
        return gdn_kernels.tree_gdn(*args, offset=offset)
    return gdn_kernels.tree_gdn_ref(*args, offset=offset)


class RecurrentCache:
    """Committed state, conv rows, checkpoint slots and saved scan inputs of every GDN layer (runner-owned)."""

    def __init__(self, shape: HybridShape, rows: int, device: torch.device, dtype: torch.dtype):
        g, f32 = len(shape.gdn_layers), torch.float32
        hk, hv, dk, dv = shape.lin_k_heads, shape.lin_v_heads, shape.lin_k_dim, shape.lin_v_dim
        self.kernel = shape.conv_kernel
        self.state = torch.zeros(g, hv, dk, dv, dtype=f32, device=device)
        self.conv = torch.zeros(g, shape.conv_kernel - 1, shape.conv_dim, dtype=dtype, device=device)
        self.nodes = torch.zeros(g, rows, hv, dk, dv, dtype=f32, device=device)  # at most one checkpoint per row
        self.mixed = torch.zeros(g, rows, shape.conv_dim, dtype=dtype, device=device)  # conv inputs of block rows
        self.k = torch.zeros(g, rows, hk, dk, dtype=f32, device=device)
        self.v = torch.zeros(g, rows, hv, dv, dtype=f32, device=device)
        self.g = torch.zeros(g, rows, hv, dtype=f32, device=device)
        self.beta = torch.zeros(g, rows, hv, dtype=f32, device=device)

    def reset(self) -> None:
        """A new sequence starts from the zero state (as transformers' cache does)."""
        self.state.zero_()
        self.conv.zero_()

    def save_inputs(self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> None:
        """Keeps a chunk's scan inputs: a commit may replay rows from them."""
        end = offset + k.shape[0]
        self.k[layer, offset:end] = k
        self.v[layer, offset:end] = v
        self.g[layer, offset:end] = g
        self.beta[layer, offset:end] = beta

    @torch.no_grad()
    def commit(self, sched: BlockSchedule, row: int, backend: GdnBackend) -> None:
        """Make `row`'s state (and conv window) the committed one, for every GDN layer."""
        slot = sched.store[row]
        if slot >= 0:
            self.state.copy_(self.nodes[:, slot])
        else:
            self._replay(sched, row, backend)
        dev = self.conv.device
        idx = torch.from_numpy(sched.conv_after(self.kernel, row)).to(dev)
        src = torch.cat([self.conv, self.mixed[:, :sched.rows]], dim=1)
        self.conv.copy_(src[:, idx])

    def _replay(self, sched: BlockSchedule, row: int, backend: GdnBackend) -> None:
        start, todo = sched.replay(row)
        dev = self.state.device
        idx = torch.tensor(todo, device=dev)
        n = len(todo)
        parents = torch.arange(-1, n - 1, device=dev)  # a chain from the start state
        hold = torch.zeros(n, dtype=torch.long, device=dev)
        store = torch.full((n,), -1, dtype=torch.long, device=dev)
        store[-1] = 0
        out = torch.empty(1, *self.state.shape[1:], dtype=torch.float32, device=dev)
        for layer in range(self.state.shape[0]):
            init = self.state[layer] if start < 0 else self.nodes[layer, start]
            k = self.k[layer, idx]
            # q only feeds the scan's outputs, which a replay discards: k stands in for it.
            run_scan(backend, k, k, self.v[layer, idx], self.g[layer, idx], self.beta[layer, idx], parents, hold,
                     store, init.contiguous(), out)
            self.state[layer].copy_(out[0])
