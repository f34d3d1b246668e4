"""Prompt lookup for the batched engine on the device, inside the step's own forward (BatchConfig.device_draft).

The host n-gram drafter (drafting.NgramChainDrafter) costs the batched engine's host ~5 us a request a step (its
index grows by every committed token, then a lookup), and the host's share of a batched step is 30-45% on the H200
(notes/h200.md, session 17): the forward waits for it. Here each runner row keeps its request's tokens by position
on the device; `observe` writes every token of the step at its position (the verify block's rejected drafts
included: they sit past the row's next pending position, never read until overwritten), and `draft_on_device`
writes each row's pending token (the bonus after the accepted drafts, computed on the device) and looks up every
row at once: NgramDrafter's rule (the longest suffix of ngram_max..ngram_min tokens that occurred before, its most
recent occurrence, up to `depth` tokens that followed it), the proposals NgramChainDrafter makes. The drafts come
back with the step's result; no host drafting at all. With a DevicePolicy (device_policy.py) the chains' lengths are
then chosen on the device too (goodput draft lengths, the verify budget).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.engines.batch.device_policy import DevicePolicy
from specpilot.engines.batch.drafting import AGREE_TENTHS, PERIOD_MIN, STEP_MAX
from specpilot.engines.device_drafters import check_lookup_args, lookup_into, lookup_rows_ref
from specpilot.kernels._common import check_launchable, check_tensor


class BatchNgramDrafter:
    """A StepDrafter (engines.batch.runner): no target features, the step's token ids."""
    target_layers: tuple[int, ...] = ()

    def __init__(self, rows: int, capacity: int, depth: int, ngram_min: int, ngram_max: int,
                 device: str | torch.device, policy: DevicePolicy | None = None, extrapolate: bool = False,
                 vocab: int = 0, compiled: bool | None = None):
        """compiled: torch.compile extrapolate_rows (default: on CUDA; ~40 small kernels eager, see
        device_policy.py)."""
        if rows < 1 or capacity < 1 or depth < 1:
            raise ValueError(f"rows={rows}, capacity={capacity}, depth={depth}: all must be >= 1")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        self.rows, self.capacity, self.depth = rows, capacity, depth
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        if policy is not None and (policy.rows, policy.depth) != (rows, depth):
            raise ValueError(f"the policy has {policy.rows} rows x {policy.depth} tokens, the lookup {rows} x {depth}")
        self.policy = policy  # trims every chain to the length mechanisms a / b choose (None: the whole match)
        if extrapolate and vocab < 1:
            raise ValueError("extrapolate needs the vocabulary size (its ids bound the extrapolated tokens)")
        self.extrapolate, self.vocab = extrapolate, vocab  # drafting.extrapolate_period's rule, on every row
        fused = torch.device(device).type == "cuda" if compiled is None else compiled
        self._extrapolate_rows = torch.compile(extrapolate_rows, fullgraph=True, dynamic=False) if fused \
            else extrapolate_rows
        self.columns = 1 + depth  # per row: how many tokens are proposed, then the tokens
        # [rows + 1, ...]: the extra row takes padding tokens and rows outside the step; the tail past capacity
        # is read (not proposed) when a match's continuation runs to the end of the context
        self.tokens = torch.zeros(rows + 1, capacity + depth + 2, dtype=torch.int64, device=device)
        self._row = torch.arange(rows, device=device)

    @torch.no_grad()
    def observe(self, features: torch.Tensor | None, ids: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor) -> None:
        """The step's token ids [n] of rows [n] (-1: padding) at positions [n]. Device work only (capturable)."""
        rows = torch.where(rows >= 0, rows, self.rows)
        self.tokens[rows, positions.clamp(0, self.capacity - 1)] = ids

    @torch.no_grad()
    def draft_on_device(self, pending: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor | None = None,
                        drafted: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's pending token and its position [rows] (-1: the row is not in the step; its output is junk),
        and the step's accepted / verified draft tokens [rows] (for the policy) -> [rows, 1 + depth]: the count of
        proposed tokens, then the proposal (filler past the count)."""
        if pending.shape != (self.rows,) or positions.shape != (self.rows,):
            raise ValueError(f"pending {tuple(pending.shape)}, positions {tuple(positions.shape)}: need "
                             f"[{self.rows}]")
        active = (positions >= 0) & (positions < self.capacity)
        pos = torch.where(active, positions, 0)
        self.tokens[torch.where(active, self._row, self.rows), pos] = pending
        drafts, proposed, first = batch_ngram_lookup(self.tokens[:self.rows], pos, self.ngram_min, self.ngram_max,
                                                     self.depth)
        proposed = torch.where(active, proposed, 0)
        if self.extrapolate:
            drafts, proposed = self._extrapolate_rows(self.tokens[:self.rows], pos + 1, first, drafts, proposed,
                                                      self.vocab)
        if self.policy is not None:
            if accepted is None or drafted is None:
                raise ValueError("a lookup with a policy needs the step's accepted and drafted counts")
            proposed = self.policy.apply(proposed, accepted, drafted, torch.where(active, positions, -1))
        return torch.cat([proposed[:, None], drafts], dim=1)

    def chain(self, values: list[int]) -> list[int]:
        """A row's draft_on_device output, read on the host -> the proposed tokens."""
        return values[1:1 + values[0]]


# ---- the lookup: one program per row (kernels next to their caller), and its torch reference ----------------
@triton.jit
def _batch_ngram_kernel(tok_ptr, row_stride, pos_ptr, draft_ptr, proposed_ptr, first_ptr, NMAX: tl.constexpr,
                        NMIN: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    length = tl.load(pos_ptr + row) + 1  # tokens 0..pos: the context, the pending token last
    first, proposed = lookup_into(tok_ptr + row.to(tl.int64) * row_stride, length, draft_ptr + row * K, NMAX, NMIN,
                                  K, KP, BLOCK, False)
    tl.store(proposed_ptr + row, proposed.to(tl.int64))
    tl.store(first_ptr + row, first.to(tl.int64))


def batch_ngram_lookup(tokens: torch.Tensor, positions: torch.Tensor, ngram_min: int, ngram_max: int, k: int,
                       kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [rows, L] (row r's context at positions 0..positions[r], its pending token last), positions [rows]
    -> (drafts [rows, k], proposed [rows], first [rows]: where each continuation starts): per row NgramDrafter's
    proposal (ngram_lookup's). L must exceed every position by k + 1 (filler past the context is read, not
    proposed). kernel=None: one kernel on CUDA, on CPU the torch reference (the interpreted kernel takes ~10 ms a
    row; tests run it with True)."""
    rows, length = check_tensor("tokens", tokens, (None, None), torch.int64, contiguous=False).shape
    check_tensor("positions", positions, (rows,), torch.int64, tokens.device)
    if tokens.stride(1) != 1:
        raise ValueError("tokens must be contiguous along a row")
    check_lookup_args(length, ngram_min, ngram_max, k)
    if not (tokens.is_cuda if kernel is None else kernel):
        return lookup_rows_ref(tokens, positions, ngram_min, ngram_max, k)
    check_launchable(_batch_ngram_kernel, tokens.device)
    drafts = torch.empty(rows, k, dtype=torch.int64, device=tokens.device)
    proposed = torch.empty(rows, dtype=torch.int64, device=tokens.device)
    first = torch.empty(rows, dtype=torch.int64, device=tokens.device)
    _batch_ngram_kernel[(rows,)](tokens, tokens.stride(0), positions, drafts, proposed, first, NMAX=ngram_max,
                                 NMIN=ngram_min, K=k, KP=triton.next_power_of_2(k), BLOCK=1024, num_warps=4)
    return drafts, proposed, first


def extrapolate_rows(tokens: torch.Tensor, length: torch.Tensor, first: torch.Tensor, drafts: torch.Tensor,
                     proposed: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """drafting.extrapolate_period for every row at once (fixed shapes, no host sync): tokens [rows, L] (row r's
    context 0..length[r]-1), each lookup's continuation start `first`, drafts [rows, k] (the first proposed[r] of
    them proposed) -> (drafts, proposed): counts continued, and a whole period proposed repeated up to k tokens,
    where the last two periods mostly agree."""
    p = length - first
    last_col = tokens.shape[1] - 1
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    in_period = (cols[None, :] >= first[:, None]) & (cols[None, :] < length[:, None])
    before = tokens.gather(1, (cols[None, :] - p[:, None]).clamp(min=0))
    agree = ((tokens == before) & in_period).sum(1)
    periodic = (p >= PERIOD_MIN) & (first >= p) & (10 * agree >= AGREE_TENTHS * p) & (proposed > 0)
    k = drafts.shape[1]
    j = torch.arange(k, device=drafts.device)
    period = p.clamp(min=1)[:, None]  # (rows that are not periodic read junk here, then keep their drafts)
    at = (first[:, None] + j[None, :] % period).clamp(0, last_col)  # the last period's token j % p
    base = tokens.gather(1, at)
    d = base - tokens.gather(1, (at - period).clamp(0, last_col))
    new = base + (j[None, :] // period + 1) * d
    moved = (d != 0) & (d.abs() <= STEP_MAX) & (new >= 0) & (new < vocab)
    count = torch.where(periodic & (proposed == p), k, proposed)  # a whole period: the loop goes on
    keep = periodic[:, None] & (j[None, :] < count[:, None])
    return torch.where(keep, torch.where(moved, new, base), drafts), count

