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
from specpilot.engines.fused import check_fusable, fused_forward, rope_tables_for
from specpilot.engines.llama import LlamaModel, ancestor_slots, position_slots, visibility_mask


@dataclass
class StepOutput:
    argmax: list[int]  # target's greedy token after each input token
    margin: torch.Tensor | None  # top1 - top2 logit per token (device), for token forcing's tie log
    topk_tokens: list[list[int]] | None = None  # per token, the model's top-k next tokens (drafters)
    topk_probs: list[list[float]] | None = None
    features: torch.Tensor | None = None  # [rows, len(capture) * hidden] target features (block drafters)


# "global" capture aborts on the Triton launcher's driver queries (seen on the H200 with triton 3.6);
# "thread_local" only forbids unsafe calls made from other threads during capture.
CAPTURE_ERROR_MODE = "thread_local"
VIEW_QUANTUM = 256  # granularity of a request's attention view (slots)


def chain_anc(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def tree_anc(parents: list[int]) -> np.ndarray:
    """parents[0] = -1 (root); parents[i] < i. anc[i, j] = j is an ancestor-or-self of i."""
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        anc[i, i] = True
        p = parents[i]
        if p >= 0:
            anc[i] |= anc[p]
    return anc


class ModelRunner:
    def __init__(self, model: LlamaModel, cfg: EngineConfig, device: torch.device | str, block_width: int = 64,
                 topk: int = 0, capture: tuple[int, ...] = ()):
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.topk = topk
        self.capture = tuple(capture)  # target layers whose outputs a block drafter reads
        sh = model.shape
        self.fused = None
        if cfg.kernel_backend is KernelBackend.TRITON:
            check_fusable(model)
            self.fused = rope_tables_for(model, cfg.max_seq_len + block_width + 64, self.device, cfg.weight_format)
        # Stock kernels are batch-invariant only at one fixed shape; the fused kernels are at any width.
        self.tile = cfg.token_tile if cfg.batch_invariant and self.fused is None else 0
        self.block_width = max(block_width, self.tile)
        self.num_slots = cfg.max_seq_len + self.block_width  # slack: a block may write past the last position
        dtype = next(model.parameters()).dtype
        self.kv = torch.zeros(2, sh.layers, sh.kv_heads, self.num_slots, sh.head_dim, dtype=dtype, device=self.device)
        self.use_graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.view_slots = self.num_slots  # slots the torch attention spans this request (see begin_request)
        step = self._step
        if cfg.compile and self.device.type == "cuda":
            step = torch.compile(step, dynamic=False)
        self._step_fn = step

    # ---- hot path -------------------------------------------------------------------------------
    def _step(self, ids, positions, slots, base, anc):
        if self.fused is not None:
            blk = anc[:, :ids.shape[0]].contiguous()
            # Position-ordered: keys read through each token's ancestors' slots (tree nodes too): bit-exact vs AR.
            block_slots = ancestor_slots(base, blk) if self.cfg.position_ordered_attention else None
            logits, captured = fused_forward(self.model, self.fused, ids, positions, slots, base.reshape(1), blk,
                                             self.kv[0], self.kv[1], self.capture, block_slots=block_slots)
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
        features = torch.cat(captured, dim=-1) if self.capture else logits[:, :0]
        top = torch.topk(logits, max(2, self.topk), dim=-1)
        probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
        return logits.argmax(-1), top.values, top.indices, probs, features

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
        n = len(ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n + 1 > self.cfg.max_seq_len:
            raise ValueError(f"prompt of {n} tokens does not fit max_seq_len={self.cfg.max_seq_len}")
        dev = self.device
        t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        anc = torch.from_numpy(chain_anc(n)).to(dev)
        out = self._step(t, pos, pos, torch.tensor(0, device=dev), anc)
        res = self._output(out, rows=[n - 1])
        if self.capture:
            res.features = out[4]  # every prompt token's features: a block drafter's context
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
        anc = np.asarray(anc, dtype=bool)
        if anc.shape != (n, n) or np.triu(anc, 1).any() or not anc.diagonal().all() or \
                not np.array_equal(anc.sum(1) - 1, np.asarray(depths)):
            # position_slots reads row i's ancestor at depth e as its (e+1)-th ancestor in block order
            raise ValueError("anc must be ancestor-or-self of a block whose parents precede their children, "
                             "with depths[j] = (ancestors of j) - 1")
        width = self.tile or _bucket(n)
        padded = -(-n // width) * width
        ids = np.zeros(padded, dtype=np.int64)
        ids[:n] = tokens
        block = np.arange(padded)
        pos = base + block.copy()
        pos[:n] = base + np.asarray(depths)
        anc_full = np.eye(padded, self.block_width, dtype=bool)  # pad rows see the context and themselves
        anc_full[:n, :n] = anc
        outs = []
        for s in range(0, padded, width):
            o = self._run(width, ids[s:s + width], pos[s:s + width], base + block[s:s + width], base, anc_full[s:s + width])
            # A replayed graph returns its static buffers: the next chunk would overwrite this one's rows.
            outs.append(tuple(t.clone() for t in o) if padded > width and self.use_graphs else o)
        out = tuple(torch.cat([o[i] for o in outs]) for i in range(5))
        return self._output(out, rows=list(range(n)))

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
        host = [torch.from_numpy(np.ascontiguousarray(a)) for a in (ids, pos, slots)]
        base_t = torch.tensor(base, dtype=torch.long)
        anc_t = torch.from_numpy(np.ascontiguousarray(anc))
        if not self.use_graphs:
            d = self.device
            return self._step_fn(*(h.to(d) for h in host), base_t.to(d), anc_t.to(d))
        graph, static_in, static_out = self._graphs.get((width, self.view_slots)) or self._capture(width)
        for dst, src in zip(static_in, (*host, base_t, anc_t)):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out

    def _capture(self, width: int):
        d = self.device
        static_in = (torch.zeros(width, dtype=torch.long, device=d), torch.zeros(width, dtype=torch.long, device=d),
                     torch.arange(width, device=d), torch.tensor(1, device=d),
                     torch.eye(width, self.block_width, dtype=torch.bool, device=d))
        # Warm up on a side stream (compilation, cuBLAS handles) writing only scratch slots, then capture.
        saved = self.kv[:, :, :, :width].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._step_fn(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=CAPTURE_ERROR_MODE):
            static_out = self._step_fn(*static_in)
        self.kv[:, :, :, :width] = saved
        self._graphs[(width, self.view_slots)] = (graph, static_in, static_out)
        return self._graphs[(width, self.view_slots)]

    def _output(self, out, rows: list[int]) -> StepOutput:
        argmax, top_v, top_i, top_p, feats = out
        idx = torch.tensor(rows, device=argmax.device)
        am = argmax[idx].tolist()  # the step's one host sync
        margin = top_v[idx, 0] - top_v[idx, 1]
        features = feats[idx] if self.capture else None
        if not self.topk:
            return StepOutput(am, margin, features=features)
        return StepOutput(am, margin, top_i[idx, :self.topk].tolist(), top_p[idx, :self.topk].tolist(), features)


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b
