"""The block drafter's training objective, batched over many anchors per sequence.

An anchor is a pending token at position a (a generated token). Its block is [token a, B-1 mask slots] at
positions a..a+B-1; it sees the target features of positions < a and, non-causally, its own block; slot j
must predict the target's greedy token at a+j. All anchors of a sequence share one projected context, and
their blocks are laid side by side as queries with a mask that keeps each block to its own context prefix
and to itself: the exact visibility the drafter has at run time, for K anchors in one forward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specpilot.drafting.data import DraftData
from specpilot.engines.drafters.block import BlockDrafterModel, drafter_head


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [N, T]
    features: torch.Tensor  # [N, T, F]
    anchors: torch.Tensor  # [N, K] positions of the pending tokens
    targets: torch.Tensor  # [N, K, B-1] the target's tokens at anchor + 1..B-1
    weight: torch.Tensor  # [N, K, B-1] float: 0 where the target lies past the sequence or the anchor is void
    soft_ids: torch.Tensor | None = None  # [N, K, B-1, S] the target's S likeliest tokens there (DraftData's)
    soft_logits: torch.Tensor | None = None  # [N, K, B-1, S] and their logits


def sample_batch(data: DraftData, rows: torch.Tensor, anchors: int, block_size: int, gen: torch.Generator) -> Batch:
    """`anchors` random anchors (with replacement) in each of the sequences `rows`."""
    dev = data.tokens.device
    rows = rows.to(dev)
    tokens, plen, length = data.tokens[rows], data.prompt_len[rows], data.length[rows]
    span = (length - 1 - plen).clamp(min=0)  # anchors a in [prompt_len, length-2]
    u = torch.rand(len(rows), anchors, generator=gen, device="cpu").to(dev)
    a = plen[:, None] + (u * span[:, None]).long()
    offsets = torch.arange(1, block_size, device=dev)
    pos = a[..., None] + offsets  # [N, K, B-1]
    inside = (pos < length[:, None, None]) & (span[:, None, None] > 0)
    at = pos.clamp(max=tokens.shape[1] - 1).flatten(1)
    targets = torch.gather(tokens, 1, at).view_as(pos)
    if data.soft_ids is None:
        return Batch(tokens, data.features[rows], a, targets, inside.float())
    pick = lambda x: torch.gather(x[rows], 1, at[..., None].expand(-1, -1, x.shape[-1])).view(*pos.shape, -1)  # noqa: E731
    return Batch(tokens, data.features[rows], a, targets, inside.float(), pick(data.soft_ids).long(),
                 pick(data.soft_logits))


def block_logits(model: BlockDrafterModel, embed: torch.Tensor, head: torch.Tensor, batch: Batch,
                 window: int = 0) -> torch.Tensor:
    """Drafter logits [N, K, B-1, vocab] for every anchor's mask slots; window > 0: each block sees the features of
    its context's last `window` positions only (EngineConfig.drafter_window)."""
    n, t = batch.tokens.shape
    k = batch.anchors.shape[1]
    b = model.config.block_size
    dev = batch.tokens.device
    ctx_pos = torch.arange(t, device=dev).expand(n, t)
    ctx_kv = model.context_kv(batch.features, ctx_pos)
    first = F.embedding(torch.gather(batch.tokens, 1, batch.anchors), embed)  # [N, K, H]
    x = model.block_inputs(first.to(model.mask_embed.dtype)).flatten(1, 2)  # [N, K*B, H]
    pos = (batch.anchors[..., None] + torch.arange(b, device=dev)).flatten(1)  # [N, K*B]
    ctx = torch.arange(t, device=dev)
    sees_ctx = ctx < batch.anchors[..., None]  # [N, K, T]
    if window:
        sees_ctx = sees_ctx & (ctx >= batch.anchors[..., None] - window)
    sees_ctx = sees_ctx[:, :, None].expand(n, k, b, t).reshape(n, k * b, t)
    same_block = torch.arange(k, device=dev).repeat_interleave(b)
    sees_block = (same_block[:, None] == same_block[None]).expand(n, k * b, k * b)
    hidden = model(x, pos, ctx_kv, torch.cat([sees_ctx, sees_block], dim=-1))
    # contiguous: a strided slice makes F.linear fall back to a broadcast bmm (3x slower on CPU)
    hidden = hidden.view(n, k, b, -1)[:, :, 1:].contiguous()
    return model.logits(hidden, head.to(hidden.dtype))


@dataclass(frozen=True)
class LossHead:
    """The LM head a drafter is scored with: the target's whole head, or at drafter_head_rows = N the N rows it
    drafts from (engines.drafters.block.drafter_head) with each token id's row there (-1: not kept). Restricted, the
    softmax runs over those rows alone, as in the engine, and a target token outside them counts as a miss the
    drafter cannot avoid (weight 0; it also ends the accepted run): the loss spends nothing on tokens it will never
    propose, and the head's GEMMs shrink with it (SmolLM2, 8192 of 49152 rows: a CPU step 0.41 -> 0.16 s)."""
    head: torch.Tensor  # [rows, hidden]
    row_of: torch.Tensor | None = None  # [vocab] int64; None: the whole head

    @classmethod
    def of(cls, model: BlockDrafterModel, target: torch.nn.Module, rows: int = 0) -> "LossHead":
        head, kept = drafter_head(model, target, rows)
        if kept is None:
            return cls(head)
        row_of = torch.full((model.config.vocab,), -1, dtype=torch.long, device=kept.device)
        row_of[kept] = torch.arange(kept.numel(), device=kept.device)
        return cls(head, row_of)

    def batch(self, batch: Batch) -> Batch:
        """batch with its targets as rows of this head."""
        if self.row_of is None:
            return batch
        if batch.soft_ids is not None:
            raise ValueError("soft labels over a restricted LM head are not supported: drop soft_topk or head_rows")
        rows = self.row_of[batch.targets]
        return replace(batch, targets=rows.clamp(min=0), weight=batch.weight * (rows >= 0))


def slot_weights(block_size: int, decay: float, device) -> torch.Tensor:
    """Loss weight per mask slot: exp(-(j-1)/decay). Early slots matter most (a miss ends the accepted
    path), as in DFlash's position-decayed loss; decay <= 0 weighs all slots equally."""
    j = torch.arange(block_size - 1, device=device, dtype=torch.float32)
    return torch.exp(-j / decay) if decay > 0 else torch.ones_like(j)


@dataclass(frozen=True)
class BlockMetrics:
    loss: torch.Tensor  # scalar (differentiable)
    slot_accuracy: list[float]  # top-1 accuracy per mask slot (over valid anchors)
    accepted: float  # teacher-forced accepted length: mean over anchors of the leading run of correct slots


def block_loss(model: BlockDrafterModel, embed: torch.Tensor, head: torch.Tensor, batch: Batch,
               decay: float, window: int = 0, soft_weight: float = 0.0) -> BlockMetrics:
    """Position-decayed cross-entropy on the target's greedy tokens; soft_weight > 0 mixes in the cross-entropy
    against the target's own distribution over its likeliest tokens (the batch's soft labels, softmaxed), as
    EAGLE-style drafters are distilled: (1 - w) * hard + w * soft per slot."""
    logits = block_logits(model, embed, head, batch, window)
    if soft_weight:
        if batch.soft_ids is None:
            raise ValueError("soft_weight > 0 needs soft labels: data generated with soft_topk > 0")
        logp = logits.float().log_softmax(-1)
        hard = -logp.gather(-1, batch.targets[..., None])[..., 0]
        q = batch.soft_logits.float().softmax(-1)
        soft = -(q * logp.gather(-1, batch.soft_ids)).sum(-1)
        ce = (1 - soft_weight) * hard + soft_weight * soft
    else:
        ce = F.cross_entropy(logits.float().flatten(0, 2), batch.targets.flatten(), reduction="none").view_as(batch.weight)
    w = batch.weight * slot_weights(model.config.block_size, decay, ce.device)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == batch.targets).float() * batch.weight
        seen = batch.weight.sum(dim=(0, 1)).clamp(min=1)
        acc = (hit.sum(dim=(0, 1)) / seen).tolist()
        valid = batch.weight[..., 0] > 0
        run = torch.cumprod(hit, dim=-1).sum(-1)[valid]
        accepted = float(run.mean()) if run.numel() else 0.0
    return BlockMetrics(loss, acc, accepted)
