"""A verify block's inputs (host and device) and the hybrid runner's CUDA graphs over them.

The runner splits a block into forwards ("chunks") of one width. Every chunk reads the block's inputs (token ids,
positions, KV slots, packed attention keys, the recurrent scan's parents/hold/store and conv windows) as slices of
one DeviceBlock. On CUDA with the Triton scan, the DeviceBlock is a set of static buffers written in place, and
each (width, offset) chunk is captured once as a CUDA graph over its slices: the offset selects which checkpoint
slots and saved rows a chunk touches, so it is part of the key, like the width (a block of W tiles has W chunk
graphs per width). Graphs are captured on the live inputs: a forward writes only the block's own scratch (its KV
slots, saved scan inputs, checkpoint slots) and never the committed state, so running it again is harmless.

A captured chunk scans all its rows, padding included, where the eager path scans only the real rows: a row's
scan arithmetic does not depend on the rows after it (see specpilot.kernels.gdn), and padding rows continue from
the on-chip state without loading or storing any, so both paths give the real rows the same bits and move the same
state bytes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
import torch

from specpilot.engines.hybrid.state import BlockSchedule
from specpilot.kernels._common import capture_graph

# Per row: greedy token, top-1 minus top-2 logit; with a runner's topk > 0 also its top-k tokens and probabilities.
ChunkOut = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class BlockInputs:
    """One block's inputs on the host, `padded` rows (whole chunks); padding rows follow the real ones."""

    ids: np.ndarray  # [padded] int64
    pos: np.ndarray  # [padded] rotary positions: base + depth (padding: base + row)
    slots: np.ndarray  # [padded] KV slots: base + row
    parents: np.ndarray  # [padded] block row of the parent, -1 = the committed state (padding: see build)
    hold: np.ndarray  # [padded] 1 = the row leaves its parent's state on chip (padding rows: 1)
    store: np.ndarray  # [padded] checkpoint slot per row, -1 = not stored (padding rows: -1)
    windows: np.ndarray  # [padded, K-1] conv windows into [committed conv rows ; block rows]
    key_index: np.ndarray  # [padded, slots] per row: the context slots, then its ancestors' slots root first
    key_visible: np.ndarray  # [padded, slots] bool

    @classmethod
    def build(cls, base: int, tokens: list[int], depths: list[int], sched: BlockSchedule, padded: int,
              num_slots: int, conv_kernel: int) -> "BlockInputs":
        n = len(tokens)
        rows = np.arange(padded, dtype=np.int64)
        ids = np.zeros(padded, dtype=np.int64)
        ids[:n] = tokens
        pos = base + rows
        pos[:n] = base + np.asarray(depths, dtype=np.int64)
        # Padding rows continue from the state the scan holds after the last real row and are held themselves:
        # scanned (graphs scan whole chunks), they load and store no state.
        last = n - 1
        owner = sched.parents[last] if sched.hold[last] else last
        parents, hold, store = (np.full(padded, fill, dtype=np.int64) for fill in (owner, 1, -1))
        parents[:n], hold[:n], store[:n] = sched.parents, sched.hold, sched.store
        index = np.zeros((padded, num_slots), dtype=np.int64)
        visible = np.zeros((padded, num_slots), dtype=bool)
        index[:, :base] = np.arange(base)
        for row in range(padded):  # padding rows see the context and themselves
            path = sched.path(row) if row < n else [row]
            index[row, base:base + len(path)] = base + np.asarray(path)
            visible[row, :base + len(path)] = True
        return cls(ids, pos, base + rows, parents, hold, store, sched.conv_windows(conv_kernel, padded), index,
                   visible)

    def to(self, device: torch.device) -> "DeviceBlock":
        return DeviceBlock(**{f.name: torch.from_numpy(np.ascontiguousarray(getattr(self, f.name))).to(device)
                              for f in fields(self)})


@dataclass(frozen=True)
class DeviceBlock:
    """BlockInputs as device tensors (fresh per block in eager mode; the graphs' static buffers otherwise, whose
    rows past the block hold stale values no chunk reads)."""

    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    parents: torch.Tensor
    hold: torch.Tensor
    store: torch.Tensor
    windows: torch.Tensor
    key_index: torch.Tensor
    key_visible: torch.Tensor


class ChunkGraphs:
    """Static input buffers for blocks of up to `rows` rows and one captured graph per (width, offset). With
    capture off (no CUDA: the Triton interpreter on CPU) chunks run eagerly on the same buffers and padding, which
    is what lets CPU tests check this path's inputs against the plain eager one."""

    def __init__(self, rows: int, num_slots: int, conv_kernel: int, device: torch.device, capture: bool = True):
        self.capture = capture
        long = dict(dtype=torch.long, device=device)
        self.static = DeviceBlock(
            ids=torch.zeros(rows, **long), pos=torch.zeros(rows, **long), slots=torch.zeros(rows, **long),
            parents=torch.full((rows,), -1, **long), hold=torch.ones(rows, **long),
            store=torch.full((rows,), -1, **long), windows=torch.zeros(rows, conv_kernel - 1, **long),
            key_index=torch.zeros(rows, num_slots, **long),
            key_visible=torch.zeros(rows, num_slots, dtype=torch.bool, device=device))
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, ChunkOut] | None] = {}
        self._pool = None  # one memory pool for every chunk graph: they never run concurrently

    def load(self, block: BlockInputs) -> DeviceBlock:
        """Copies the block into the static buffers' first rows; returns the buffers."""
        for f in fields(block):
            src = torch.from_numpy(np.ascontiguousarray(getattr(block, f.name)))
            getattr(self.static, f.name)[:src.shape[0]].copy_(src, non_blocking=True)
        return self.static

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(k for k, v in self._graphs.items() if v is not None)

    def run(self, key: tuple[int, int], forward: Callable[[], ChunkOut]) -> ChunkOut:
        """Replays the graph of `key` (capturing it on first use); eager when its capture failed."""
        if key not in self._graphs:
            self._graphs[key] = self._capture(key, forward) if self.capture else None
        entry = self._graphs[key]
        if entry is None:
            return forward()
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, key: tuple[int, int], forward: Callable[[], ChunkOut]):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            graph, out = capture_graph(forward, 2, self._pool)
        except Exception as e:  # noqa: BLE001 - any capture failure: this chunk shape stays eager, still exact
            torch.cuda.synchronize()
            warnings.warn(f"hybrid runner: CUDA graph capture of chunk (width, offset)={key} failed ({e!r}); "
                          "running it eagerly", RuntimeWarning, stacklevel=3)
            return None
        return graph, out
