"""HybridRunner: the ModelRunner interface (prefill / verify / compact) for hybrid recurrent targets.

Attention layers keep a static KV cache with the Llama runner's slot scheme (block row j at slot base + j; a
row sees the context and its ancestors, packed in sequence order: see PackedKeys). Gated DeltaNet layers keep a
committed recurrent state and conv rows (RecurrentCache); a verify computes every row's state from its
parent's (a tree-structured scan), and `compact` commits the accepted row's state: exact rollback by picking (or
replaying into) the right row, never by cropping.
In batch-invariant mode every forward runs at exactly `token_tile` rows, so autoregressive and speculative steps
run the same kernels at the same shapes and agree bit for bit, for chains and trees alike; blocks longer than a
tile run as several tile-sized forwards (a later chunk resumes its rows' states from stored checkpoints).
On CUDA with the Triton scan and cfg.cuda_graphs, every forward is a CUDA graph captured per (width, chunk
offset) over static inputs (graphs.py), with an eager fallback; the torch reference scan always runs eagerly. The
GDN scan's implementation is HybridConfig.gdn_backend (HybridConfig.from_engine maps kernel_backend=triton to it).
Like ModelRunner, every step returns each row's greedy token and top1-top2 logit margin; with topk > 0 also each
row's top-k tokens and probabilities (token forcing reads the runner-up; see engines/target_runner.py).
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from specpilot.engines.config import EngineConfig
from specpilot.engines.hybrid.config import GdnBackend, HybridConfig
from specpilot.engines.hybrid.graphs import BlockInputs, ChunkGraphs, ChunkOut, DeviceBlock
from specpilot.engines.hybrid.layers import PackedKeys
from specpilot.engines.hybrid.model import HybridModel
from specpilot.engines.hybrid.state import (BlockSchedule, RecurrentCache, ScanPlan, dfs_order,
                                            parents_from_anc)
from specpilot.engines.runner import StepOutput, check_prompt


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class HybridRunner:
    def __init__(self, model: HybridModel, cfg: EngineConfig, hybrid: HybridConfig, device: torch.device | str,
                 block_width: int = 64, topk: int = 0):
        self.model, self.cfg, self.hybrid = model, cfg, hybrid
        self.device = torch.device(device)
        self.topk = topk  # > 0: steps also return each row's top-k tokens and probabilities
        self.tile = cfg.token_tile if cfg.batch_invariant else 0
        self.block_width = max(block_width, self.tile)  # rows a verify block may hold: root + draft nodes
        # Rows a block may occupy once padded: whole tiles, or the power-of-two bucket in fast-shapes mode.
        self.rows = -(-self.block_width // self.tile) * self.tile if self.tile else _bucket(self.block_width)
        self.num_slots = cfg.max_seq_len + self.rows
        sh = model.shape
        dtype = next(model.parameters()).dtype
        self.kv = torch.zeros(2, len(sh.attn_layers), sh.kv_heads, self.num_slots, sh.head_dim, dtype=dtype,
                              device=self.device)
        self.rec = RecurrentCache(sh, self.rows, self.device, dtype)
        self._pending: BlockSchedule | None = None  # the last verify's schedule, until compact commits from it
        self._last_runs: list[Callable[[], ChunkOut]] = []  # the last block's forwards (see replay_verify)
        # CUDA graphs need the Triton scan: the torch reference reads parents on the host (a sync per chunk). Without
        # CUDA (the Triton interpreter) the graphs' static-buffer path still runs, uncaptured: tests check it on CPU.
        use_graphs = cfg.cuda_graphs and hybrid.gdn_backend is GdnBackend.TRITON
        self.graphs = ChunkGraphs(self.rows, self.num_slots, sh.conv_kernel, self.device,
                                  capture=self.device.type == "cuda") if use_graphs else None
        self._row_of: dict[int, int] = {}  # the last verify's block node -> row (depth-first order permutes rows)

    # ---- public API (ModelRunner's) ---------------------------------------------------------------
    def begin_request(self, total_tokens: int) -> None:
        """The runner protocol's per-request hook; the hybrid runner keeps one fixed attention view."""

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> StepOutput:
        """Runs the prompt as chained chunks (verify + commit of the whole chunk); returns the greedy token after it."""
        n = check_prompt(ids, self.cfg.max_seq_len)
        self.rec.reset()
        piece = self.tile or self.rows
        for start in range(0, n, piece):
            chunk = ids[start:start + piece]
            m = len(chunk)
            out = self._block(start, chunk, list(range(m)), list(range(-1, m - 1)), keep=(m - 1,))
            self._row_of = {i: i for i in range(m)}
            self.compact(start, list(range(m)))
        return self._output(out, [m - 1])

    @torch.no_grad()
    def verify(self, base: int, tokens: list[int], depths: list[int], anc: np.ndarray) -> StepOutput:
        """One block: row j at slot base + j, position base + depths[j], seeing slots < base and its ancestors
        (anc); each row's recurrent state follows its parent. Returns the greedy token after each row."""
        n = len(tokens)
        if n > self.block_width:
            raise ValueError(f"block of {n} tokens exceeds block_width={self.block_width}")
        if base + self.rows > self.num_slots:
            raise ValueError(f"sequence position {base} + block exceeds the KV cache ({self.num_slots} slots)")
        parents = parents_from_anc(anc)
        order = dfs_order(parents) if self.hybrid.dfs_order else list(range(n))
        row_of = {node: r for r, node in enumerate(order)}  # block node -> row it runs at
        if order != list(range(n)):
            tokens, depths = [tokens[i] for i in order], [depths[i] for i in order]
            parents = [row_of[parents[i]] if parents[i] >= 0 else -1 for i in order]
        out = self._block(base, tokens, depths, parents)
        self._row_of = row_of
        return self._output(out, [row_of[i] for i in range(n)])

    @torch.no_grad()
    def compact(self, base: int, path: list[int]) -> None:
        """Commits the accepted path (block rows, root first): its KV moves to slots base.., and the recurrent
        state and conv rows become those of its last row."""
        if self._pending is None:
            raise RuntimeError("compact() without a verify() to commit from")
        path = [self._row_of[node] for node in path]
        if any(node != d for d, node in enumerate(path)):
            src = torch.tensor([base + p for p in path], device=self.device)
            dst = torch.arange(base, base + len(path), device=self.device)
            self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        self.rec.commit(self._pending, path[-1], self.hybrid.gdn_backend)
        self._pending = None

    def pending_commit(self, node: int) -> tuple[BlockSchedule, int]:
        """The last verify's schedule and the row block node `node` ran at: what compact would commit from."""
        if self._pending is None:
            raise RuntimeError("no verify() is pending")
        return self._pending, self._row_of[node]

    @torch.no_grad()
    def replay_verify(self) -> None:
        """Runs the last verify's forwards again on the inputs already on the device (graph replays when captured):
        for timing the device work alone. Harmless: a forward writes only the block's scratch, never the committed
        state, and commits read nothing it writes differently."""
        for run in self._last_runs:
            run()

    # ---- internals ----------------------------------------------------------------------------------
    def _block(self, base: int, tokens: list[int], depths: list[int], parents: list[int],
               keep: tuple[int, ...] = ()) -> ChunkOut:
        """Runs the block's chunks; returns ChunkOut over every row it ran (padding included), on the device."""
        n = len(tokens)
        width = self.tile or _bucket(n)
        padded = -(-n // width) * width
        if padded > self.rows:
            raise ValueError(f"block of {n} rows pads to {padded} > {self.rows} rows of recurrent scratch")
        sched = BlockSchedule.build(parents, chunk=width, spacing=self.hybrid.state_checkpoint_spacing, keep=keep)
        host = BlockInputs.build(base, tokens, depths, sched, padded, self.num_slots, self.model.shape.conv_kernel)
        block = self.graphs.load(host) if self.graphs else host.to(self.device)
        runs: list[Callable[[], ChunkOut]] = []
        for s in range(0, padded, width):
            real = width if self.graphs else min(n, s + width) - s  # a graph scans its padding rows too (graphs.py)
            forward = functools.partial(self._chunk, block, s, width, real)
            runs.append(functools.partial(self.graphs.run, (width, s), forward) if self.graphs else forward)
        outs = [run() for run in runs]
        self._last_runs, self._pending = runs, sched
        # cat copies: a replayed graph's outputs are overwritten by the next replay
        return tuple(torch.cat(column) for column in zip(*outs))

    def _output(self, out: ChunkOut, rows: list[int]) -> StepOutput:
        """The StepOutput of block rows `rows` (in that order): one host copy of their argmax (and top-k)."""
        sel = torch.tensor(rows, device=out[0].device)
        argmax, margin, *top = (t[sel] for t in out)
        if not self.topk:
            return StepOutput(argmax.tolist(), margin)
        return StepOutput(argmax.tolist(), margin, top[0].tolist(), top[1].tolist())

    def _chunk(self, block: DeviceBlock, start: int, width: int, real: int) -> ChunkOut:
        """One forward over rows start..start+width-1; its scan runs the first `real` of them."""
        end = start + width
        plan = ScanPlan(block.parents[start:start + real], block.hold[start:start + real], block.store,
                        block.windows[start:end], start, real, self.hybrid.gdn_backend)
        keys = PackedKeys(block.key_index[start:end], block.key_visible[start:end])
        hidden = self.model(block.ids[start:end], block.pos[start:end], block.slots[start:end], keys, self.kv,
                            self.rec, plan)
        logits = self.model.logits(hidden).float()
        top = torch.topk(logits, max(2, self.topk), dim=-1)
        out = (logits.argmax(-1), top.values[:, 0] - top.values[:, 1])
        if not self.topk:
            return out
        probs = torch.exp(top.values[:, :self.topk] - torch.logsumexp(logits, dim=-1, keepdim=True))
        return out + (top.indices[:, :self.topk], probs)
