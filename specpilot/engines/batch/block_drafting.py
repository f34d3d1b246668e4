"""The block drafter for the batched engine: one batched forward drafts every request's block.

Per runner row the drafter keeps its own context keys/values: each layer's projection of the target features of
the row's tokens, at their positions ([rows + 1, capacity, kv_heads, D]; the extra row is where padding tokens
write). Inside the batched step's own forward (engines.batch.runner, its CUDA graph: no launch from the host, no
host round trip), `observe` projects the features of ALL of the step's tokens (prompt chunks, pending tokens,
drafts) into their rows: no knowledge of the acceptance is needed, as a rejected draft's slot sits at or past its
request's next pending position, hidden by the draft mask until the target's own token overwrites it. Then
`draft_on_device` runs the reference model's layers (BlockDrafterModel's modules, as the trainer runs them) over
one block per row at fixed shapes (the pending token and block_size - 1 mask slots, seeing the keys before the
pending position and the whole block), its pending tokens and positions computed on the device from the
acceptance; rows that do not draft compute on junk nobody reads. `draft` is the same from host lists (one
captured graph; tests and scripts/gpu_batch_draft.py).
Two things differ from the reference's arrangement, both for speed on the H200 (the reference's took 2.3 ms of
GPU time a draft at 24 rows x 2560 keys: fp32 math attention over repeated keys and per-layer concatenations):
the block's keys go to tail slots of each row's cache (read in place, the reference's key order), and the query
heads sharing a key head attend as one longer query (grouped: no repeated keys; the mask is per row), which the
memory-efficient SDPA kernel serves.

Proposals only: verification decides every committed token, so these bits need not match the single-request
drafter's (they do up to rounding: tests/test_batch.py checks the top-1 chains are the same).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specpilot.engines.drafters.block import BlockDrafterModel, drafter_head, runtime_copy
from specpilot.engines.drafters.block_step import check_window
from specpilot.engines.llama import LlamaModel, rotate_half
from specpilot.kernels._common import capture_graph

FUSED_HEAD_MAX_SLOTS = 32  # draft slots (rows x depth) up to which the fused norm + head + argmax kernel serves


class BatchBlockDrafter:
    def __init__(self, model: BlockDrafterModel, target: LlamaModel, rows: int, capacity: int,
                 device: str | torch.device, cuda_graphs: bool = True, triton_head: bool | None = None,
                 window: int = 0, head_rows: int = 0):
        c = model.config
        self.window = check_window(window)
        c.check_target(target.shape)
        if rows < 1 or capacity < 1:
            raise ValueError(f"rows={rows}, capacity={capacity}: both must be >= 1")
        self.embed = target.embed_tokens.weight
        # head_rows: the head restricted to the target's most generated tokens (EngineConfig.drafter_head_rows)
        self.head, self.token_map = drafter_head(model, target, head_rows)
        if self.embed.device.type != torch.device(device).type:
            raise ValueError(f"the target is on {self.embed.device}, the drafter on {device}")
        self.device = dev = self.embed.device  # "cuda" -> the target's own "cuda:0"
        self.config, self.rows, self.capacity, self.depth = c, rows, capacity, c.block_size - 1
        dtype = self.embed.dtype
        self.model = runtime_copy(model, dev, dtype)
        shape = (rows + 1, capacity + c.block_size, c.kv_heads, c.head_dim)  # + the block's tail slots
        self.keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(c.layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(c.layers)]
        self._block = torch.arange(c.block_size, device=dev)
        self._key_slot = torch.arange(capacity + c.block_size, device=dev)
        # The draft's inputs (pending token, its position per row), staged on the host and copied in one go.
        pinned = dev.type == "cuda"
        self._host_in = torch.zeros(2, rows, dtype=torch.int64, pin_memory=pinned)
        self._inputs = torch.zeros(2, rows, dtype=torch.int64, device=dev)
        self._host_out = torch.zeros(rows, c.block_size - 1, dtype=torch.int64, pin_memory=pinned)
        self._graph = None
        self.use_graph = cuda_graphs and dev.type == "cuda"
        # The top-1 of the final norm + LM head: from the engine's fused kernel (argmax in its epilogue, no logits
        # written) for a few rows; for many, a cuBLAS GEMM then argmax. The fused kernel is a decode kernel: each
        # 16-row tile re-reads the whole head (H200, 24 rows x 15 slots: 296 us of a 685 us draft).
        # The logit scale and softcap keep the order of the logits when positive, so the argmax is theirs too.
        fused_ok = c.logit_scale > 0
        few = rows * self.depth <= FUSED_HEAD_MAX_SLOTS
        self.triton_head = (dev.type == "cuda" and fused_ok and few) if triton_head is None else triton_head
        if self.triton_head and not fused_ok:
            raise ValueError(f"logit_scale={c.logit_scale}: the fused head's argmax needs a positive scale")

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    @property
    def columns(self) -> int:
        return self.depth  # draft_on_device's output per row: the top-1 of every depth

    def chain(self, values: list[int]) -> list[int]:
        """A row's draft_on_device output, read on the host -> the chain (every depth is a proposal)."""
        return values

    @torch.no_grad()
    def observe(self, features: torch.Tensor, ids: torch.Tensor | None, rows: torch.Tensor,
                positions: torch.Tensor) -> None:
        """Target features [n, feature_dim] of tokens of rows [n] (-1: padding, written nowhere visible) at
        positions [n] -> every layer's context keys/values at (row, position); the token ids are not read. Device
        work only (capturable)."""
        n = features.shape[0]
        if features.shape != (n, self.config.feature_dim) or rows.shape != (n,) or positions.shape != (n,):
            raise ValueError(f"features {tuple(features.shape)}, rows {tuple(rows.shape)}, positions "
                             f"{tuple(positions.shape)}: need [n, {self.config.feature_dim}], [n], [n]")
        if n == 0:
            return
        rows = torch.where(rows >= 0, rows, self.rows)  # padding -> the spare row
        positions = positions.clamp(0, self.capacity - 1)  # the runner bounds real positions by max_seq_len
        for keys, values, (k, v) in zip(self.keys, self.values,
                                        self.model.context_kv(features[None], positions[None])):
            keys[rows, positions] = k[0].transpose(0, 1)  # [kvh, n, D] -> [n, kvh, D]
            values[rows, positions] = v[0].transpose(0, 1)

    @torch.no_grad()
    def draft(self, rows: list[int], pending: list[int], positions: list[int]) -> list[list[int]]:
        """For each request (its runner row, its pending token, that token's position, whose earlier positions were
        all observed): the top-1 token of each of the block's block_size - 1 slots after the pending one."""
        if not rows:
            return []
        if not len(rows) == len(pending) == len(positions):
            raise ValueError("rows, pending and positions differ in length")
        if min(positions) < 0 or max(positions) > self.capacity:
            raise ValueError(f"positions {min(positions)}..{max(positions)} outside 0..{self.capacity}")
        if min(rows) < 0 or max(rows) >= self.rows:
            raise ValueError(f"rows must be in 0..{self.rows - 1}")
        host = self._host_in.numpy()  # free to rewrite: the last draft's copy was waited for with its result
        host[:] = 0
        host[0, rows], host[1, rows] = pending, positions
        self._inputs.copy_(self._host_in, non_blocking=True)
        if self.use_graph:
            if self._graph is None:
                self._graph = capture_graph(lambda: self.draft_on_device(self._inputs[0], self._inputs[1]), 2)
            self._graph[0].replay()
            out = self._graph[1]
        else:
            out = self.draft_on_device(self._inputs[0], self._inputs[1])
        self._host_out.copy_(out, non_blocking=True)
        if self.use_graph:
            torch.cuda.current_stream().synchronize()  # the step's read of its drafts
        return self._host_out.numpy()[np.asarray(rows)].tolist()

    @torch.no_grad()
    def draft_on_device(self, pending: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor | None = None,
                        drafted: torch.Tensor | None = None) -> torch.Tensor:
        """Pending tokens and their positions [rows] (device; -1: a row outside the step, drafted from junk) ->
        every row's top-1 per depth [rows, depth], at fixed shapes (the whole cache, masked by position):
        capturable, one graph serves every step. (The step's accepted / drafted counts are not read: the host picks
        a block chain's length.)"""
        m, c, rows, width, cap = self.model, self.config, self.rows, self.config.block_size, self.capacity
        if pending.shape != (rows,) or positions.shape != (rows,):
            raise ValueError(f"pending {tuple(pending.shape)}, positions {tuple(positions.shape)}: need [{rows}]")
        kvh, group, d = c.kv_heads, c.heads // c.kv_heads, c.head_dim
        pos = positions.clamp(0, cap)
        x = m.block_inputs(self.embed[pending])  # [rows, B, H]
        cos, sin = (t[:, :, None] for t in m.rotary(pos[:, None] + self._block, x.dtype))  # [rows, B, 1, D]
        # a row's slot is visible iff it holds context before the pending position, or is one of the block's
        context = self._key_slot[None, :] < pos[:, None]
        if self.window:  # the drafter's context window (EngineConfig.drafter_window)
            context = context & (self._key_slot[None, :] >= pos[:, None] - self.window)
        visible = context | (self._key_slot[None, :] >= cap)
        mask = visible[:, None, None, :]  # [rows, 1, 1, slots]: the same for every head and block token
        for layer, keys, values in zip(m.layers, self.keys, self.values):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(rows, width, c.heads, d)
            k = a.k_proj(h).view(rows, width, kvh, d)
            if c.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            keys[:rows, cap:] = k * cos + rotate_half(k) * sin
            values[:rows, cap:] = a.v_proj(h).view(rows, width, kvh, d)
            # query head i * group + g reads key head i (repeat_interleave's order): a key head's group of query
            # heads is one query of group * B rows
            qg = q.view(rows, width, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(rows, kvh, group * width, d)
            o = F.scaled_dot_product_attention(qg, keys[:rows].transpose(1, 2), values[:rows].transpose(1, 2),
                                               attn_mask=mask)
            o = o.view(rows, kvh, group, width, d).permute(0, 3, 1, 2, 4).reshape(rows, width, c.heads * d)
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if self.triton_head:
            from specpilot.kernels import rmsnorm_linear
            flat = x[:, 1:].reshape(rows * (width - 1), -1)  # a copy: the kernel takes contiguous rows
            _, top = rmsnorm_linear(flat, m.norm.weight, self.head, c.rms_eps, argmax=True, store_y=False)
        else:
            top = m.logits(m.norm(x[:, 1:]), self.head).argmax(-1)  # [rows, B - 1]
        top = top.view(rows, width - 1)
        return top if self.token_map is None else self.token_map[top]
