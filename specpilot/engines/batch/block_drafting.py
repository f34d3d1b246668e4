"""The block drafter for the batched engine: one batched forward drafts every decoding request's block.

Per request (a runner row) the drafter keeps its own context keys/values: each layer's projection of the target
features of the request's tokens, at their positions ([rows + 1, capacity, kv_heads, D]; the extra row is where
padding tokens write). After every step `observe` projects the features of ALL the step's tokens (prompt chunks,
pending tokens, drafts) into their rows: a rejected draft's slot sits at or past the request's next pending
position, so the draft mask hides it until the target's own token overwrites it. No host knowledge of the
acceptance is needed, so nothing waits on the host. `draft` then runs the reference model (BlockDrafterModel, the
trainer's batched forward) over every decoding request's block at once: the pending token and block_size - 1 mask
slots, seeing the context keys before the pending position and the whole block, and returns each request's top-1
token per depth.

Proposals only: verification decides every committed token, so these bits need not match the single-request
drafter's (they do up to rounding: tests/test_batch_block.py checks the top-1 chains are the same).
"""
from __future__ import annotations

import copy

import torch

from specpilot.engines.drafters.block import BlockDrafterModel, lm_head_weight
from specpilot.engines.llama import LlamaModel

CONTEXT_ROUND = 256  # draft over the context rounded up to this: few distinct shapes, little masked work


class BatchBlockDrafter:
    def __init__(self, model: BlockDrafterModel, target: LlamaModel, rows: int, capacity: int,
                 device: str | torch.device):
        c = model.config
        c.check_target(target.shape)
        if rows < 1 or capacity < 1:
            raise ValueError(f"rows={rows}, capacity={capacity}: both must be >= 1")
        self.embed, self.head = target.embed_tokens.weight, lm_head_weight(target)
        if self.embed.device.type != torch.device(device).type:
            raise ValueError(f"the target is on {self.embed.device}, the drafter on {device}")
        self.device = self.embed.device  # "cuda" -> the target's own "cuda:0"
        self.config, self.rows, self.capacity = c, rows, capacity
        dtype = target.embed_tokens.weight.dtype
        # A private copy at the target's dtype and device (the caller's float32 trainer model stays untouched).
        self.model = copy.deepcopy(model).to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.model.inv_freq = self.model._inv_freq().to(self.device)  # rotary frequencies stay float32
        shape = (rows + 1, capacity, c.kv_heads, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.layers)]
        self._block = torch.arange(c.block_size, device=self.device)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    @torch.no_grad()
    def observe(self, features: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Target features [n, feature_dim] of tokens of rows [n] (-1: padding, written nowhere visible) at
        positions [n] -> every layer's context keys/values at (row, position). Device work only."""
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
        all observed): the top-1 token of each of the block's depth = block_size - 1 slots after the pending one."""
        if not rows:
            return []
        if not len(rows) == len(pending) == len(positions):
            raise ValueError("rows, pending and positions differ in length")
        if min(positions) < 0 or max(positions) > self.capacity:
            raise ValueError(f"positions {min(positions)}..{max(positions)} outside 0..{self.capacity}")
        if min(rows) < 0 or max(rows) >= self.rows:
            raise ValueError(f"rows must be in 0..{self.rows - 1}")
        dev, m = self.device, self.model
        ctx = min(self.capacity, -(-max(positions) // CONTEXT_ROUND) * CONTEXT_ROUND)
        r = torch.tensor(rows, device=dev)
        pos = torch.tensor(positions, device=dev)
        x = m.block_inputs(self.embed[torch.tensor(pending, device=dev)])  # [R, B, H]
        block_pos = pos[:, None] + self._block  # [R, B]
        ctx_kv = [(k[r, :ctx].transpose(1, 2), v[r, :ctx].transpose(1, 2)) for k, v in zip(self.keys, self.values)]
        seen = torch.arange(ctx, device=dev)[None, :] < pos[:, None]  # [R, ctx]: keys before the pending token
        mask = torch.cat([seen, torch.ones_like(seen[:, :1]).expand(-1, self._block.numel())], dim=1)
        hidden = m(x, block_pos, ctx_kv, mask[:, None, :].expand(-1, x.shape[1], -1))
        return m.logits(hidden[:, 1:], self.head).argmax(-1).tolist()
