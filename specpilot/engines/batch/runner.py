"""BatchRunner: owns the paged KV cache, the persistent step buffers, the CUDA graphs and greedy acceptance.

A step is a list of StepEntry (one per request in it): its tokens (a verify block = the pending token + its
draft, or a prompt chunk), the logical position of the first one, and the request's row in the runner's
per-request tables (a row is bound to a request, with its pages, for the request's whole life). The runner
packs every entry's tokens into one forward (engines.batch.model.batch_forward) and, on the device, turns the
target's argmax into each row's accepted count and committed tokens: out[row] = [accepted, argmax of the
block's tokens...]. Reading that small array is the step's one host sync.

Inputs live in one int64 buffer (pinned on CUDA) mirrored on the device: a step is one host->device copy.
On CUDA, steps of up to BatchConfig.graph_max_tokens tokens replay a CUDA graph captured once per token
bucket (padding tokens write no KV and belong to no request; every kernel is row-invariant, so padding
changes no bit); larger steps (long prefill chunks) run eagerly. On CPU everything runs eagerly at the exact
token count (emulate_graphs=True runs the graph path's buckets and static buffers, for tests).

With `drafters` (StepDrafters: the batched block drafter, prompt lookup on the device), a step launched with
draft=<one of them> also, inside the same forward (its CUDA graph; a separate set of graphs per drafter, so steps
without one pay nothing): hands every token of the step (its id, and the drafter's target layers' outputs) to
drafter.observe, then drafts every row's next chain from the row's pending token (the bonus after the accepted
drafts, or a prompt's first output token) at its position, all on the device; the drafts come back with the result
(out[row, 1 + W:]): no host round trip between verify and draft.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from specpilot.engines.batch.config import BatchConfig
from specpilot.engines.batch.model import attention_params, batch_forward
from specpilot.engines.batch.paged_attn import PagedMeta, max_tiles, tile_map, tiles_for
from specpilot.engines.batch.paged_cache import CacheShape, PagedKVCache, pages_for
from specpilot.engines.config import ConfigError, EngineConfig, KernelBackend
from specpilot.engines.fused import check_fusable, feature_rows, rope_tables_for
from specpilot.engines.llama import LlamaModel
from specpilot.kernels._common import capture_graph


class StepDrafter(Protocol):
    """What the runner drives inside a step's forward: engines.batch.block_drafting.BatchBlockDrafter (from the
    target's features), engines.batch.ngram_drafting.BatchNgramDrafter (prompt lookup over the token ids)."""
    target_layers: tuple[int, ...]  # whose outputs observe gets (none: features is None)
    columns: int  # draft_on_device's output values per row
    rows: int

    def observe(self, features: torch.Tensor | None, ids: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor) -> None: ...

    def draft_on_device(self, pending: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor | None = None,
                        drafted: torch.Tensor | None = None) -> torch.Tensor: ...

    def chain(self, values: list[int]) -> list[int]: ...


@dataclass(frozen=True)
class StepEntry:
    row: int  # the request's row in the per-request tables (bound with its pages)
    tokens: Sequence[int]
    start: int  # logical position of tokens[0] (= the request's keys already in the cache)
    last_only: bool = False  # a prompt chunk: only the greedy token after its last token is read


class StepHandle:
    """A launched step; result() waits for it (the step's one host sync)."""

    def __init__(self, out: torch.Tensor, done: "torch.cuda.Event | None" = None):
        self._out, self._done = out, done  # done: out is a pinned host copy, complete once `done` fires

    def result(self) -> np.ndarray:
        """[max_batch, 1 + block width (+ the drafter's columns)] int64: per row, accepted draft tokens, then the
        argmax after each block token (the committed tokens are the first accepted + 1 of them), then (launched
        with draft=True) the row's next draft. On CUDA a view of the runner's pinned buffer: valid until the next
        launch."""
        if self._done is not None:
            self._done.synchronize()
            return self._out.numpy()
        return self._out.cpu().numpy()


class _EmulatedGraph:
    """CPU stand-in for a CUDA graph: replays the captured function into one static output tensor."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self) -> torch.Tensor:
        self.out.copy_(self.fn())
        return self.out


class BatchRunner:
    def __init__(self, model: LlamaModel, cfg: EngineConfig, batch: BatchConfig, device: torch.device | str,
                 max_block: int, emulate_graphs: bool = False, drafters: Sequence[StepDrafter] = ()):
        if cfg.kernel_backend is not KernelBackend.TRITON:
            raise ConfigError("the batched engine runs the batch-invariant Triton kernels: kernel_backend=triton")
        check_fusable(model, cfg.weight_format)
        self.model, self.cfg, self.batch = model, cfg, batch
        self.drafters = tuple(drafters)
        for drafter in self.drafters:
            _check_drafter(drafter, model, batch)
        self.device = torch.device(device)
        sh = model.shape
        self.group = sh.heads // sh.kv_heads
        self.vocab = sh.vocab
        self.B, self.W = batch.max_batch, max(1, max_block)
        self.tables = rope_tables_for(model, cfg.max_seq_len + 64, self.device, cfg.weight_format,
                                      kernel_table=cfg.kernel_table)
        # One page per split of the attention reduction, as the single-request engine launches it.
        self.page = attention_params(model, self.tables).split_keys
        self.pages_per_request = pages_for(cfg.max_seq_len, self.page)
        num_pages = batch.num_pages or self.B * self.pages_per_request
        dtype = next(model.parameters()).dtype
        self.cache = PagedKVCache(CacheShape(sh.layers, sh.kv_heads, sh.head_dim, num_pages, self.page), dtype,
                                  self.device)
        self.max_tokens = max(batch.prefill_chunk + self.B * self.W, batch.graph_max_tokens)
        self.use_graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self.emulate = emulate_graphs and not self.use_graphs
        self.graph_max = batch.graph_max_tokens if (self.use_graphs or self.emulate) else 0
        self._graphs: dict[tuple[int, int], object] = {}  # (token bucket, 1 + the drafter's index, 0: none)
        self._pool = None
        # The host buffer is pinned and copied asynchronously: it is rewritten only once the last copy ran.
        self._staged = torch.cuda.Event() if self.device.type == "cuda" else None
        # The result comes back through a pinned buffer, copied as soon as the forward ends (on the H200 a
        # synchronous .cpu() of the small result took 36-49 us of host time a step; scripts/gpu_batch_host.py).
        self._result_ready = torch.cuda.Event() if self.device.type == "cuda" else None
        pin = self._result_ready is not None
        self._host_out = {width: torch.empty((self.B, width), dtype=torch.int64, pin_memory=pin)
                          for width in {1 + self.W} | {1 + self.W + d.columns for d in self.drafters}}
        self._alloc_buffers()

    # ---- buffers ----------------------------------------------------------------------------------
    def _alloc_buffers(self) -> None:
        N, B, W, P = self.max_tokens, self.B, self.W, self.pages_per_request
        T = max_tiles(N, self.group, B)
        layout = (("ids", N), ("tok_req", N), ("pos", N), ("tok_kv_len", N), ("tile_req", T), ("tile_row", T),
                  ("q_start", B), ("q_len", B), ("kv_len", B), ("nvalid", B), ("gather", B * W),
                  ("page_table", B * P))
        total = sum(n for _, n in layout)
        pin = self.device.type == "cuda"
        self._host_all = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self._dev_all = torch.zeros(total, dtype=torch.int64, device=self.device)
        host_np = self._host_all.numpy()
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, torch.Tensor] = {}
        off = 0
        for name, n in layout:
            self.h[name], self.d[name] = host_np[off:off + n], self._dev_all[off:off + n]
            off += n
        for name, cols in (("gather", W), ("page_table", P)):
            self.h[name] = self.h[name].reshape(B, cols)
            self.d[name] = self.d[name].view(B, cols)
        self.h["page_table"][:] = -1
        self._cols = torch.arange(1, W, device=self.device)

    def bind(self, row: int, pages: list[int]) -> None:
        """Row `row` now belongs to a request holding `pages` (logical order); written on the next step."""
        if len(pages) > self.pages_per_request:
            raise ValueError(f"{len(pages)} pages exceed the {self.pages_per_request} a request may hold")
        self._wait_staged()
        self.h["page_table"][row] = -1
        self.h["page_table"][row, :len(pages)] = pages

    def unbind(self, row: int) -> None:
        self._wait_staged()
        self.h["page_table"][row] = -1

    def _wait_staged(self) -> None:
        if self._staged is not None:
            self._staged.synchronize()  # normally long done: the step's result was read after it

    def _fill(self, entries: Sequence[StepEntry], nb: int, n_tiles: int) -> int:
        """Writes the step into the host buffer; returns the largest kv length of the step."""
        self._wait_staged()
        h = self.h
        n = len(entries)
        rows = np.fromiter((e.row for e in entries), np.int64, n)
        lens = np.fromiter((len(e.tokens) for e in entries), np.int64, n)
        starts = np.fromiter((e.start for e in entries), np.int64, n)
        last = np.fromiter((e.last_only for e in entries), bool, n)
        total = int(lens.sum())
        qs = np.cumsum(lens) - lens
        h["ids"][:total] = np.fromiter(itertools.chain.from_iterable(e.tokens for e in entries), np.int64, total)
        h["tok_req"][:total] = np.repeat(rows, lens)
        h["pos"][:total] = np.repeat(starts - qs, lens) + np.arange(total)
        h["tok_kv_len"][:total] = np.repeat(starts + lens, lens)
        h["ids"][total:nb] = 0
        h["tok_req"][total:nb] = -1  # padding: no request, no KV write, no attention
        h["pos"][total:nb] = 0
        h["tok_kv_len"][total:nb] = 0
        for name in ("q_start", "q_len", "kv_len", "nvalid"):
            h[name][:] = 0
        h["q_start"][rows], h["q_len"][rows], h["kv_len"][rows] = qs, lens, starts + lens
        h["nvalid"][rows] = np.where(last, 1, lens)
        first = h["q_start"] + h["q_len"] - h["nvalid"]  # a prompt chunk gathers only its last token
        last_col = np.maximum(h["nvalid"] - 1, 0)[:, None]
        h["gather"][:] = first[:, None] + np.minimum(np.arange(self.W)[None, :], last_col)
        h["tile_req"][:], h["tile_row"][:] = -1, 0
        h["tile_req"][:n_tiles], h["tile_row"][:n_tiles] = tile_map(h["q_len"], self.group, n_tiles)
        return int((starts + lens).max()) if n else 0

    # ---- the step ---------------------------------------------------------------------------------
    def _forward(self, nb: int, n_tiles: int, max_kv: int | None, which: int = 0) -> torch.Tensor:
        """The step; which = 1 + the index of the drafter that drafts in it (0: none)."""
        drafter = self.drafters[which - 1] if which else None
        d, P, size = self.d, self.pages_per_request, self.page
        ids, tok_req, pos = d["ids"][:nb], d["tok_req"][:nb], d["pos"][:nb]
        page = d["page_table"].view(-1)[tok_req.clamp(min=0) * P + pos // size]
        slots = torch.where((tok_req >= 0) & (page >= 0), page * size + pos % size, -1)
        meta = PagedMeta(d["page_table"], d["q_start"], d["q_len"], d["kv_len"], d["tile_req"][:n_tiles],
                         d["tile_row"][:n_tiles], d["tok_kv_len"][:nb])
        kv = self.cache.kv
        _, am, captured = batch_forward(self.model, self.tables, ids, pos, slots, meta, kv[0], kv[1], size,
                                        max_kv_len=max_kv, capture=drafter.target_layers if drafter else ())
        if drafter:  # per step token: features [nb, layers * hidden] (None: no layers), id, row (-1: padding), position
            drafter.observe(None if captured is None else feature_rows(captured), ids, tok_req, pos)
        block_argmax = am[d["gather"]]  # [B, W]: target's token after each block token
        block_ids = ids[d["gather"]]
        # Draft token j+1 is accepted iff it equals the argmax after token j and every earlier one was.
        match = (block_ids[:, 1:] == block_argmax[:, :-1]) & (self._cols[None, :] < d["nvalid"][:, None])
        accepted = match.long().cumprod(1).sum(1)
        if drafter is None:
            return torch.cat([accepted[:, None], block_argmax], dim=1)
        # Each row's pending token is the target's token after its last accepted one (a prompt chunk: after its
        # last token), at the position after it; rows outside the step (position -1) draft junk nobody reads.
        pending = block_argmax.gather(1, accepted[:, None])[:, 0]
        positions = torch.where(d["nvalid"] > 0, d["kv_len"] - d["nvalid"] + accepted + 1, -1)
        drafts = drafter.draft_on_device(pending, positions, accepted, (d["nvalid"] - 1).clamp(min=0))
        return torch.cat([accepted[:, None], block_argmax, drafts], dim=1)

    def _which(self, draft: "StepDrafter | bool | None") -> int:
        if draft is None or draft is False:
            return 0
        if draft is True:
            if len(self.drafters) != 1:
                raise ValueError(f"draft=True names the runner's one drafter; it has {len(self.drafters)}")
            return 1
        for i, d in enumerate(self.drafters):
            if d is draft:
                return i + 1
        raise ValueError("draft= names a drafter this runner was not built with")

    @torch.no_grad()
    def launch(self, entries: Sequence[StepEntry], draft: "StepDrafter | bool | None" = None) -> StepHandle:
        """The step over `entries`; draft: the drafter (one of the runner's; True: its only one) that drafts every
        row's next chain inside it."""
        if not entries:
            raise ValueError("a step needs at least one entry")
        which = self._which(draft)
        total = sum(len(e.tokens) for e in entries)
        if total > self.max_tokens:
            raise ValueError(f"a step of {total} tokens exceeds the runner's {self.max_tokens}")
        for e in entries:
            if not e.last_only and len(e.tokens) > self.W:
                raise ValueError(f"a verify block of {len(e.tokens)} tokens exceeds the block width {self.W}")
        if 0 < total <= self.graph_max:
            nb = bucket(total)
            graph = self._graph(nb, which)  # captured before the buffers are filled: capture runs a null step
            self._fill(entries, nb, max_tiles(nb, self.group, self.B))
            self._upload()
            return self._handle(graph.replay() if self.emulate else _replay(graph))
        lens = np.fromiter((len(e.tokens) for e in entries), np.int64, len(entries))
        n_tiles = tiles_for(lens, self.group)
        max_kv = self._fill(entries, total, n_tiles)
        self._upload()
        return self._handle(self._forward(total, n_tiles, max_kv, which))

    def _handle(self, out: torch.Tensor) -> StepHandle:
        if self._result_ready is None:
            return StepHandle(out)
        self._result_ready.synchronize()  # the previous step's copy has been read (normally long done)
        host = self._host_out[out.shape[1]]
        host.copy_(out, non_blocking=True)
        self._result_ready.record()
        return StepHandle(host, self._result_ready)

    def _upload(self) -> None:
        self._dev_all.copy_(self._host_all, non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    # ---- graphs -------------------------------------------------------------------------------------
    def _graph(self, nb: int, which: int = 0):
        if (nb, which) not in self._graphs:
            self._graphs[nb, which] = self._capture(nb, which)
        return self._graphs[nb, which]

    def _capture(self, nb: int, which: int):
        # A null step (no request, every token padding) so warm-up and capture write nothing to the cache.
        self._fill([], nb, 0)
        self._upload()
        n_tiles = max_tiles(nb, self.group, self.B)
        fn = lambda: self._forward(nb, n_tiles, None, which)  # noqa: E731 - every split of the table: fixed grid
        if self.emulate:
            return _EmulatedGraph(fn)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(fn, 2, self._pool)

    def capture_all(self, draft: bool = False) -> int:
        """Captures every token bucket up front, largest first (they share one memory pool), and with draft=True
        every bucket's variant for each drafter too; returns the count."""
        if not (self.use_graphs or self.emulate):
            return 0
        with torch.no_grad():
            for nb in sorted(graph_buckets(self.graph_max), reverse=True):
                for which in range(1 + len(self.drafters)) if draft else (0,):
                    self._graph(nb, which)
        return len(self._graphs)


def _check_drafter(drafter: StepDrafter, model: LlamaModel, batch: BatchConfig) -> None:
    if any(layer >= model.shape.layers for layer in drafter.target_layers):
        raise ValueError(f"the drafter reads target layers {list(drafter.target_layers)}; the target has layers "
                         f"0..{model.shape.layers - 1}")
    if drafter.rows != batch.max_batch:
        raise ValueError(f"the drafter has {drafter.rows} rows, the runner {batch.max_batch}")


def _replay(graph_and_out) -> torch.Tensor:
    graph, out = graph_and_out
    graph.replay()
    return out


def graph_buckets(graph_max: int) -> list[int]:
    """Token counts a graph is captured for: 1, 2, 4, 8, then every multiple of 16 (one BLOCK_M tile)."""
    return [n for n in (1, 2, 4, 8) if n < 16] + list(range(16, graph_max + 1, 16))


def bucket(n: int) -> int:
    for b in (1, 2, 4, 8):
        if n <= b:
            return b
    return -(-n // 16) * 16
