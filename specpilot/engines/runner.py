"""ModelRunner: owns the static KV cache, persistent step buffers, CUDA graphs and greedy sampling.

The hot path is one small tensor-in tensor-out function (`_step`): ids, positions, slots, base, anc ->
argmax and top-2 logits. On CUDA it is captured once per token count as a CUDA graph over persistent
buffers. In batch-invariant mode every decode/verify forward runs at exactly `token_tile` tokens, so every
kernel sees one shape and reduces each row in one order: AR and speculative steps agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specpilot.engines.config import EngineConfig, KernelBackend
from specpilot.engines.fused import check_fusable, feature_rows, fused_forward, rope_tables_for
from specpilot.engines.graphs import StepGraph, capture_decode, capture_step
from specpilot.engines.layout import bucket as _bucket, verify_layout
from specpilot.engines.llama import LlamaModel, ancestor_slots, position_slots, visibility_mask
from specpilot.weights.model import OctWeights


def check_prompt(ids: list[int], max_seq_len: int) -> int:
    """The prompt's length, once it is known to leave room for the first generated token."""
    n = len(ids)
    if n == 0:
        raise ValueError("empty prompt")
    if n + 1 > max_seq_len:
        raise ValueError(f"prompt of {n} tokens does not fit max_seq_len={max_seq_len}")
    return n


@dataclass
class StepOutput:
    argmax: list[int]  # target's greedy token after each input token
    margin: torch.Tensor | None  # top1 - top2 logit per token (device), for token forcing's tie log
    topk_tokens: list[list[int]] | None = None  # per token, the model's top-k next tokens (drafters)
    topk_probs: list[list[float]] | None = None
    # [rows, len(capture) * hidden] target features (block drafters); with CUDA graphs a view of the step's output
    # buffer, valid until the next step (clone to keep)
    features: torch.Tensor | None = None


STEP_FEATURES = 4  # the features' place in a step's outputs (ModelRunner._step)
VIEW_QUANTUM = 256  # granularity of a request's attention view (slots)


def chain_anc(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


class ModelRunner:
    def __init__(self, model: LlamaModel, cfg: EngineConfig, device: torch.device | str, block_width: int = 64,
                 topk: int = 0, capture: tuple[int, ...] = (), w12_layouts: OctWeights | None = None):
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.topk = topk
        self.capture = tuple(capture)  # target layers whose outputs a block drafter reads
        sh = model.shape
        self.fused = None
        if cfg.kernel_backend is KernelBackend.TRITON:
            check_fusable(model)
            self.fused = rope_tables_for(model, cfg.max_seq_len + block_width + 64, self.device, cfg.weight_format,
                                         kernel_table=cfg.kernel_table, layouts=w12_layouts)
        # Stock kernels are batch-invariant only at one fixed shape; the fused kernels are at any width.
        self.tile = cfg.token_tile if cfg.batch_invariant and self.fused is None else 0
        # Blocks pad to the fixed tile, or else to a power of two (a graph per bucket): the widest bucket must fit.
        self.block_width = max(block_width, self.tile) if self.tile else _bucket(block_width)
        self.num_slots = cfg.max_seq_len + self.block_width  # slack: a block may write past the last position
        dtype = next(model.parameters()).dtype
        self.kv = torch.zeros(2, sh.layers, sh.kv_heads, self.num_slots, sh.head_dim, dtype=dtype, device=self.device)
        self.use_graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self._graphs: dict[tuple, StepGraph] = {}  # (width, view) steps and ("decode", k) chains
        # Stop ids a chained decode checks (stop_decodes_on): on the device for the graphs, a host copy for the rest.
        self.decode_stop: torch.Tensor | None = None
        self._decode_stop_ids: frozenset[int] = frozenset()
        self._host_buf: torch.Tensor | None = None  # pinned landing buffer of each step's argmax
        self._fetched = torch.cuda.Event() if self.device.type == "cuda" else None
        self.view_slots = self.num_slots  # slots the torch attention spans this request (see begin_request)
        step = self._step
        if cfg.compile and self.device.type == "cuda":
            step = torch.compile(step, dynamic=False)
        self._step_fn = step

    # ---- hot path -------------------------------------------------------------------------------
    def _step(self, ids, positions, slots, base, anc, block_slots=None, on_features=None, in_order=False):
        """-> (argmax [T], top-k values, top-k indices, top-k probs, features [len(capture), T, H]); the top-k
        entries are None unless this runner serves top-k (drafters, token forcing's margins): the decode hot path
        needs only the argmax.
        block_slots: ancestor_slots(base, anc) precomputed by a caller whose block shape is static (the device
        loop), for the fused path with position-ordered attention; derived here when None. in_order: the block is a
        chain at slots base.. (row i at position base + i), so keys in slot order are in position order: the
        fused path reads them so, without block slots (the same keys, order and dots; a chain of 128 rows at 1024
        keys: 13.8 against 22.6 us of attention a layer on an H100).
        on_features(features [len(capture), T, H]): called as soon as the captured layers are written (the fused
        path: before the layers after the last of them; the torch path: after the forward)."""
        need_logits = self.topk > 0
        if self.fused is not None:
            blk = anc[:, :ids.shape[0]].contiguous()
            # Position-ordered: keys read through each token's ancestors' slots (tree nodes too): bit-exact vs AR.
            if not self.cfg.position_ordered_attention or in_order:
                block_slots = None
            elif block_slots is None:
                block_slots = ancestor_slots(base, blk)
            logits, argmax, captured = fused_forward(self.model, self.fused, ids, positions, slots, base.reshape(1),
                                                     blk, self.kv[0], self.kv[1], self.capture,
                                                     block_slots=block_slots, want_logits=need_logits,
                                                     on_features=on_features)
        else:
            if self.cfg.position_ordered_attention:
                # Every row reads its keys in position order (tree nodes through their ancestors' slots), so a
                # tree verify and AR attend to bit-identical keys in the same order and layout.
                slot_of, mask = position_slots(base, anc, self.view_slots)
            else:  # one SDPA over the slots: fast; chains are bit-exact, trees token-exact up to near-ties
                slot_of, mask = None, visibility_mask(base, anc, self.view_slots)
            kv = self.kv[..., :self.view_slots, :]
            args = (ids, positions, slots, mask, kv[0], kv[1])
            hidden, captured = (self.model(*args, capture=self.capture, slot_of=slot_of) if self.capture
                                else (self.model(*args, slot_of=slot_of), []))
            logits = self.model.logits(hidden).float()
            argmax = logits.argmax(-1)
        # layer-major [len(capture), T, H] (the fused forward's down projections write it in place); StepOutput's
        # rows come from feature_rows
        features = (captured if self.fused is not None else torch.stack(captured)) if self.capture else None
        if on_features is not None and self.fused is None and features is not None:
            on_features(features)
        if not need_logits:
            return argmax, None, None, None, features
        top = torch.topk(logits, max(2, self.topk), dim=-1)
        probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
        return argmax, top.values, top.indices, probs, features

    # ---- public API -------------------------------------------------------------------------------
    def begin_request(self, total_tokens: int) -> None:
        """Sizes this request's attention view: the torch path attends over a fixed number of slots per request
        (AR and speculative runs of one request see the same shapes, so exactness holds), rounded up to 256 so
        short requests do not pay for the whole cache."""
        need = total_tokens + self.block_width
        self.view_slots = min(self.num_slots, -(-need // VIEW_QUANTUM) * VIEW_QUANTUM)

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> StepOutput:
        """Writes slots 0..n-1; returns the greedy token after the last prompt token."""
        n = check_prompt(ids, self.cfg.max_seq_len)
        dev = self.device
        t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        anc = torch.from_numpy(chain_anc(n)).to(dev)
        out = self._step(t, pos, pos, torch.tensor(0, device=dev), anc)
        res = self._output(out, n, rows=[n - 1])
        if self.capture:
            res.features = feature_rows(out[4])  # every prompt token's features: a block drafter's context
        return res

    @torch.no_grad()
    def verify(self, base: int, tokens: list[int], depths: list[int], anc: np.ndarray) -> StepOutput:
        """One forward over a block: token j at slot base+j, position base+depths[j], seeing slots < base and
        its ancestors (anc). Returns the greedy token after each block token."""
        n = len(tokens)
        if n > self.block_width:
            raise ValueError(f"block of {n} tokens exceeds block_width={self.block_width}")
        if base + self.block_width > self.view_slots:
            raise ValueError(f"sequence position {base} + block exceeds this request's attention view "
                             f"({self.view_slots} of {self.num_slots} slots; see begin_request)")
        lay = verify_layout(n, anc, depths, self.tile, self.block_width)  # validated + padded once per shape
        width, padded, anc_full = lay.width, lay.padded, lay.anc
        ids = np.zeros(padded, dtype=np.int64)
        ids[:n] = tokens
        slots, pos = base + lay.slots, base + lay.positions
        if self.use_graphs and padded == width:  # the common case: one replay, its argmax already on the host
            g = self._replay(width, ids, pos, slots, base, anc_full)
            self._fetched.record()
            self._fetched.synchronize()
            return self._output(g.out, n, argmax=g.host_argmax.numpy()[:n].tolist())
        outs = []
        for s in range(0, padded, width):
            o = self._run(width, ids[s:s + width], pos[s:s + width], slots[s:s + width], base, anc_full[s:s + width])
            # A replayed graph returns its static buffers: the next chunk would overwrite this one's rows.
            outs.append(tuple(None if t is None else t.clone() for t in o) if padded > width and self.use_graphs
                        else o)
        # chunks' rows one after another (the features' rows are their dim 1: layer-major)
        out = outs[0] if len(outs) == 1 else tuple(
            None if o0 is None else torch.cat([o[i] for o in outs], dim=1 if i == STEP_FEATURES else 0)
            for i, o0 in enumerate(outs[0]))
        return self._output(out, n)

    @torch.no_grad()
    def decode(self, base: int, token: int, steps: int) -> list[int]:
        """`steps` greedy AR steps from `token` at slot base: the argmax after token, then after that one, ... (up to
        the first stop id, with stop_decodes_on).

        Every step is the same one-token forward as verify(base + i, [token_i], [0], [[True]]), so the tokens are
        identical; with CUDA graphs and the fused kernels all steps are one replay (each step's token is fed on
        the device) and one host sync, instead of one per step.
        """
        if not 1 <= steps <= self.block_width:
            raise ValueError(f"steps={steps} must be in 1..block_width={self.block_width}")
        if base + self.block_width > self.view_slots:
            raise ValueError(f"sequence position {base} + block exceeds this request's attention view "
                             f"({self.view_slots} of {self.num_slots} slots; see begin_request)")
        stop = self._decode_stop_ids
        if not self._decodes_in_one_graph:
            out = []
            for i in range(steps):
                token = self.verify(base + i, [token], [0], _ONE).argmax[0]
                out.append(token)
                if token in stop:
                    break
            return out
        g = self._graphs.get(("decode", steps)) or self._keep(("decode", steps), capture_decode(self, steps))
        g.staged.synchronize()
        g.host_ints.numpy()[:2] = (token, base)
        g.graph.replay()
        g.staged.record()
        g.staged.synchronize()
        out = g.host_argmax.numpy().tolist()
        if -1 in out:  # skipped steps (a guarded chain): they follow a stop id
            out = out[:out.index(-1)]
            if not out or out[-1] not in stop:
                raise RuntimeError(f"AR decode: steps were skipped after {out[-1:]}, which is no stop id")
        return out

    def stop_decodes_on(self, stop_ids: frozenset[int]) -> None:
        """Chained AR decodes skip their steps after one that produced a stop id (on the device: engines.graph_if;
        eagerly: the loop ends there). Only for a caller that stops there anyway (EnginePolicy.commit's EOS rule):
        decode then returns fewer tokens than asked, the last one a stop id."""
        ids = sorted(stop_ids)
        self.decode_stop = torch.tensor(ids, dtype=torch.long, device=self.device) if ids else None
        self._decode_stop_ids = frozenset(ids)
        for key in [k for k in self._graphs if k[0] == "decode"]:
            del self._graphs[key]

    @torch.no_grad()
    def capture_all(self, decode_steps: int = 0) -> int:
        """Captures every graph a request can replay: each verify width (powers of two up to block_width, or the
        fixed tile) and the chained AR decodes of 2^i <= decode_steps steps. Kernel compilation and capture then
        never land inside a timed generation (a build with a new kernel table would be billed for them). Call
        between requests. Returns how many graphs it captured."""
        if not self.use_graphs:
            return 0
        widths = [self.tile] if self.tile else [1 << i for i in range(self.block_width.bit_length())
                                                if 1 << i <= self.block_width]
        keys = [(self._graph_key(w), lambda w=w: capture_step(self, w)) for w in widths]
        if self._decodes_in_one_graph:
            keys += [(("decode", k), lambda k=k: capture_decode(self, k))
                     for k in (1 << i for i in range(decode_steps.bit_length())) if 2 <= k <= self.block_width]
        todo = [(key, capture) for key, capture in keys if key not in self._graphs]
        for key, capture in todo:
            self._keep(key, capture())
        return len(todo)

    @torch.no_grad()
    def compact(self, base: int, path: list[int]) -> None:
        """Moves the accepted path's KV (block indices `path`, depth order) to slots base+0..base+len-1."""
        if all(node == d for d, node in enumerate(path)):
            return  # a chain: KV already sits at its final slots
        src = torch.tensor([base + p for p in path], device=self.device)
        dst = torch.arange(base, base + len(path), device=self.device)
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]

    # ---- internals ----------------------------------------------------------------------------------
    def _run(self, width, ids, pos, slots, base, anc):
        if not self.use_graphs:
            d = self.device
            host = [torch.from_numpy(np.ascontiguousarray(a)).to(d) for a in (ids, pos, slots)]
            return self._step_fn(*host, torch.tensor(base, dtype=torch.long, device=d),
                                 torch.from_numpy(np.array(anc)).to(d))  # a copy: cached layouts are read-only
        return self._replay(width, ids, pos, slots, base, anc).out

    def _replay(self, width, ids, pos, slots, base, anc) -> StepGraph:
        """Fills the graph's pinned inputs and replays it. The graph itself copies them in and the argmax out, so a
        step costs the host one replay and one sync instead of four copy launches. The previous replay of this
        graph must have read the pinned inputs before they are refilled."""
        key = self._graph_key(width)
        g = self._graphs.get(key) or self._keep(key, capture_step(self, width))
        g.staged.synchronize()
        h = g.host_ints.numpy()
        h[:width], h[width:2 * width], h[2 * width:3 * width], h[3 * width] = ids, pos, slots, base
        g.host_anc.numpy()[:] = anc
        g.graph.replay()
        g.staged.record()
        return g

    @property
    def _decodes_in_one_graph(self) -> bool:
        # chained steps feed each argmax on the device: the fused kernels' epilogue argmax, no top-k to serve
        return self.use_graphs and self.fused is not None and self.topk == 0

    def _keep(self, key: tuple, g: StepGraph) -> StepGraph:
        self._graphs[key] = g
        return g

    def _graph_key(self, width: int) -> tuple[int, int]:
        # The fused kernels read the whole cache (splits past the context exit at once): no per-request view.
        return width, (0 if self.fused is not None else self.view_slots)

    def _host_rows(self, t: torch.Tensor) -> list:
        """t's rows as Python values: the step's one host sync (a pinned copy on CUDA)."""
        if t.device.type != "cuda":
            return t.tolist()
        if self._host_buf is None or self._host_buf.numel() < t.numel():
            self._host_buf = torch.empty(max(t.numel(), 4 * self.block_width), dtype=torch.long).pin_memory()
        h = self._host_buf[:t.numel()].view(t.shape)
        h.copy_(t, non_blocking=True)
        self._fetched.record()
        self._fetched.synchronize()
        return h.tolist()

    def _output(self, out, n: int, rows: list[int] | None = None, argmax: list[int] | None = None) -> StepOutput:
        """The StepOutput of rows 0..n-1 of a step's outputs (or of `rows`); `argmax`: those rows' argmax, when
        the step already brought it to the host."""
        sel = (lambda t: t[:n]) if rows is None else (lambda t: t[torch.tensor(rows, device=t.device)])
        am = self._host_rows(sel(out[0])) if argmax is None else argmax
        _, top_v, top_i, top_p, feats = out
        features = sel(feature_rows(feats)) if self.capture else None
        if not self.topk:
            return StepOutput(am, None, features=features)
        top_v, top_i, top_p = sel(top_v), sel(top_i), sel(top_p)
        margin = top_v[:, 0] - top_v[:, 1]
        return StepOutput(am, margin, top_i[:, :self.topk].tolist(), top_p[:, :self.topk].tolist(), features)


_ONE = np.ones((1, 1), dtype=bool)
