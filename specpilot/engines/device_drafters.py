"""The device halves of drafters the device loop runs (engines.device_loop): each drafts from device state only and
takes the step's outcome on the device, so k steps need no host round trip.

BlockDeviceDrafter: the block drafter's step (draft from the pending token and its position; the accepted path's
target features projected into its cache). NgramDeviceDrafter: prompt lookup over a device copy of the sequence,
NgramDrafter's rule (the longest suffix of ngram_max..ngram_min tokens that occurred before, its most recent
occurrence, the tokens that followed it) as fixed-shape tensor ops over the whole buffer.
"""
from __future__ import annotations

from typing import Protocol

import torch

from specpilot.engines.drafters.block_tree import BlockTreeDrafter
from specpilot.engines.drafters.ngram import NgramDrafter


class DeviceDrafter(Protocol):
    depth: int  # draft depth (rows of candidates a draft returns)
    topk: int  # candidates per depth
    capacity: int  # positions its state can hold: a step must end below it
    needs_features: bool  # commit reads the target's captured features
    use_graph: bool  # may run inside the loop's CUDA graphs

    def begin(self, seq: list[int], base: int) -> None:
        """Host side, before a chunk of steps from the pending token at slot base (seq = prompt + output)."""

    def draft(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """state = (pending token, its slot) -> candidates [depth, topk], their probabilities, and how many
        depths hold a real proposal (a 0-d tensor; depths past it are filler that may still match)."""

    def commit(self, state: torch.Tensor, path_tokens: torch.Tensor, features: torch.Tensor | None,
               positions: torch.Tensor) -> None:
        """The step's outcome, before state moves on: path_tokens [rows] = the target's argmax along the accepted
        path in depth order (tokens of positions base+1..), features of its rows at positions base...."""

    def end(self, base: int) -> None:
        """Host side, after a chunk: the pending token now sits at slot base."""

    def buffers(self) -> list[torch.Tensor]:
        """Device state a graph capture's warm-up steps overwrite (restored after capture)."""


class BlockDeviceDrafter:
    needs_features = True

    def __init__(self, drafter: BlockTreeDrafter):
        self.drafter, self.step = drafter, drafter.step
        self.depth, self.topk, self.capacity = drafter.shape.depth, drafter.topk, drafter.capacity
        self.use_graph = drafter.use_graph

    def begin(self, seq: list[int], base: int) -> None:
        if self.drafter.n_ctx != base:
            raise RuntimeError(f"device loop: the drafter has features for {self.drafter.n_ctx} positions, the "
                               f"pending token sits at {base}")

    def draft(self, state):
        tokens, probs = self.step.draft(state)
        return tokens[:self.depth], probs[:self.depth], state.new_tensor(self.depth)

    def commit(self, state, path_tokens, features, positions) -> None:
        self.step.project(features, positions)

    def end(self, base: int) -> None:
        self.drafter.n_ctx = base

    def buffers(self) -> list[torch.Tensor]:
        return [self.step.cache]


class NgramDeviceDrafter:
    """Proposals equal NgramDrafter's where it proposes; where it finds no match, or its match runs out before
    draft_len tokens, the depths past the proposal hold filler (counted as not proposed)."""
    needs_features = False
    topk = 1
    use_graph = True

    def __init__(self, drafter: NgramDrafter, capacity: int, device: torch.device):
        self.depth, self.ngram_max, self.ngram_min = drafter.draft_len, drafter.ngram_max, drafter.ngram_min
        self.capacity = capacity
        # The sequence (prompt + output) by position; commits write depth + 1 tokens past the pending one.
        self.tokens = torch.zeros(capacity + self.depth + 2, dtype=torch.long, device=device)
        self.synced = 0  # positions 0..synced-1 of the current request hold its tokens
        self.starts = torch.arange(len(self.tokens), device=device)
        self.offsets = torch.arange(self.depth + 1, device=device)
        self.suffix_offsets = {n: torch.arange(n, device=device) for n in range(self.ngram_min, self.ngram_max + 1)}
        self.ones = torch.ones(self.depth, 1, device=device)
        self._seq: list[int] | None = None

    def begin(self, seq: list[int], base: int) -> None:
        if self._seq is not seq:  # a new request: its tokens from the start
            self._seq, self.synced = seq, 0
        if self.synced < base + 1:  # host steps ran since: their tokens (a small copy, not per step)
            self.tokens[self.synced:base + 1].copy_(torch.tensor(seq[self.synced:base + 1]))
        self.synced = base + 1

    def draft(self, state):
        length = state[1] + 1  # tokens 0..base: the context, the pending token last
        best = torch.full((), -1, dtype=torch.long, device=state.device)
        best_n = torch.zeros((), dtype=torch.long, device=state.device)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):  # longest suffix first
            suffix = torch.index_select(self.tokens, 0, (length - n).clamp(min=0) + self.suffix_offsets[n])
            match = (self.tokens.unfold(0, n, 1) == suffix).all(1)
            starts = self.starts[:match.shape[0]]
            # an earlier occurrence followed by a token before the pending one (NgramDrafter indexes the context
            # without its last token), with the suffix fully in context
            ok = match & (starts + n <= length - 2) & (length - 1 >= n)
            latest = torch.where(ok, starts, -1).max()
            take = (best < 0) & (latest >= 0)
            best, best_n = torch.where(take, latest, best), torch.where(take, n, best_n)
        first = torch.where(best >= 0, best + best_n, length)  # no match: filler from past the context
        proposed = torch.where(best >= 0, (length - first).clamp(max=self.depth), 0)
        draft = torch.index_select(self.tokens, 0, first + self.offsets[:self.depth])
        return draft[:, None], self.ones, proposed

    def commit(self, state, path_tokens, features, positions) -> None:
        self.tokens.index_copy_(0, state[1] + 1 + self.offsets[:len(path_tokens)], path_tokens)

    def end(self, base: int) -> None:
        self.synced = base + 1  # the loop wrote every committed token itself

    def buffers(self) -> list[torch.Tensor]:
        return [self.tokens]
