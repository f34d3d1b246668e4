"""HybridRunner: the ModelRunner interface (prefill / verify / compact) for hybrid recurrent targets.

Attention layers keep a static KV cache with the Llama runner's slot scheme (block row j at slot base + j; a
row sees the context and its ancestors, packed in sequence order: see PackedKeys). Gated DeltaNet layers keep a
committed recurrent state and conv rows (RecurrentCache); a verify computes every row's state from its
parent's (a tree-structured scan), and `compact` commits the accepted row's state: exact rollback by picking (or
replaying into) the right row, never by cropping.
In batch-invariant mode every forward runs at exactly `token_tile` rows, so autoregressive and speculative steps
run the same kernels at the same shapes and agree bit for bit, for chains and trees alike; blocks longer than a
tile run as several tile-sized forwards (a later chunk resumes its rows' states from stored checkpoints).
CUDA graphs and EngineConfig.kernel_backend (the Llama fused kernels) do not apply here yet; the GDN scan's
implementation is HybridConfig.gdn_backend.
"""
from __future__ import annotations

import numpy as np
import torch

from specpilot.engines.config import EngineConfig
from specpilot.engines.hybrid.config import HybridConfig
from specpilot.engines.hybrid.layers import PackedKeys
from specpilot.engines.hybrid.model import HybridModel
from specpilot.engines.hybrid.state import (BlockSchedule, RecurrentCache, ScanPlan, dfs_order,
                                            parents_from_anc)
from specpilot.engines.runner import StepOutput


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class HybridRunner:
    def __init__(self, model: HybridModel, cfg: EngineConfig, hybrid: HybridConfig, device: torch.device | str,
                 block_width: int = 64):
        self.model, self.cfg, self.hybrid = model, cfg, hybrid
        self.device = torch.device(device)
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
        self._row_of: dict[int, int] = {}  # the last verify's block node -> row (depth-first order permutes rows)

    # ---- public API (ModelRunner's) ---------------------------------------------------------------
    def begin_request(self, total_tokens: int) -> None:
        """The runner protocol's per-request hook; the hybrid runner keeps one fixed attention view."""

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> StepOutput:
        """Runs the prompt as chained chunks (verify + commit of the whole chunk); returns the greedy token after it."""
        n = len(ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n + 1 > self.cfg.max_seq_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_seq_len={self.cfg.max_seq_len}")
        self.rec.reset()
        piece = self.tile or self.rows
        for start in range(0, n, piece):
            chunk = ids[start:start + piece]
            m = len(chunk)
            argmax, margin = self._block(start, chunk, list(range(m)), list(range(-1, m - 1)), keep=(m - 1,))
            self._row_of = {i: i for i in range(m)}
            self.compact(start, list(range(m)))
        return StepOutput([argmax[m - 1]], margin[m - 1:m])

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
        argmax, margin = self._block(base, tokens, depths, parents)
        self._row_of = row_of
        rows = [row_of[i] for i in range(n)]
        return StepOutput([argmax[r] for r in rows], margin[torch.tensor(rows, device=margin.device)])

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

    # ---- internals ----------------------------------------------------------------------------------
    def _block(self, base: int, tokens: list[int], depths: list[int], parents: list[int],
               keep: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
        n = len(tokens)
        width = self.tile or _bucket(n)
        padded = -(-n // width) * width
        if padded > self.rows:
            raise ValueError(f"block of {n} rows pads to {padded} > {self.rows} rows of recurrent scratch")
        sched = BlockSchedule.build(parents, chunk=width, spacing=self.hybrid.state_checkpoint_spacing, keep=keep)
        ids = np.zeros(padded, dtype=np.int64)
        ids[:n] = tokens
        rows = np.arange(padded)
        pos = base + rows
        pos[:n] = base + np.asarray(depths)
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        par_t, store_t = torch.tensor(parents, device=dev), torch.tensor(sched.store, device=dev)
        hold_t = torch.tensor(sched.hold, dtype=torch.long, device=dev)
        windows = t(sched.conv_windows(self.model.shape.conv_kernel, padded))
        argmax, margin = [], []
        for s in range(0, padded, width):
            real = max(0, min(n, s + width) - s)
            plan = ScanPlan(par_t[s:s + real], hold_t[s:s + real], store_t, windows[s:s + width], s, real,
                            self.hybrid.gdn_backend)
            hidden = self.model(t(ids[s:s + width]), t(pos[s:s + width]), t(base + rows[s:s + width]),
                                self._keys(base, sched, s, width), self.kv, self.rec, plan)
            logits = self.model.logits(hidden).float()
            top = torch.topk(logits, 2, dim=-1).values
            argmax.append(logits.argmax(-1))
            margin.append(top[:, 0] - top[:, 1])
        self._pending = sched
        return torch.cat(argmax).tolist(), torch.cat(margin)

    def _keys(self, base: int, sched: BlockSchedule, start: int, width: int) -> PackedKeys:
        """Rows start..start+width-1: the context, then their ancestors root first; padding rows see themselves."""
        index = np.zeros((width, self.num_slots), dtype=np.int64)
        visible = np.zeros((width, self.num_slots), dtype=bool)
        index[:, :base] = np.arange(base)
        for i in range(width):
            row = start + i
            path = sched.path(row) if row < sched.rows else [row]
            index[i, base:base + len(path)] = base + np.asarray(path)
            visible[i, :base + len(path)] = True
        return PackedKeys(torch.from_numpy(index).to(self.device), torch.from_numpy(visible).to(self.device))
