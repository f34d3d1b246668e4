"""The device halves of drafters the device loop runs (engines.device_loop): each drafts from device state only and
takes the step's outcome on the device, so k steps need no host round trip.

BlockDeviceDrafter: the block drafter's step (draft from the pending token and its position; the accepted path's
target features projected into its cache). NgramDeviceDrafter: prompt lookup over a device copy of the sequence,
NgramDrafter's rule (the longest suffix of ngram_max..ngram_min tokens that occurred before, its most recent
occurrence, the tokens that followed it) as fixed-shape tensor ops over the whole buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from specpilot.engines.drafters.block_tree import BlockTreeDrafter
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.ngram_prefix import LeadGate
from specpilot.engines.side_stream import SideStream
from specpilot.kernels._common import check_launchable, check_tensor
from specpilot.kernels.pdl import pdl_launch, release_successor, wait_for_predecessor


@dataclass(frozen=True)
class DeviceDraft:
    """A draft on the device: candidates [depth, topk] per depth and their probabilities, how many depths hold a real
    proposal (a one-element tensor; depths past it are filler that may still match), and optionally a token per
    depth that goes first at the depths below lead_depths (prompt lookup's match leading a block drafter's
    candidates; the device loop leads them in the same launch that gathers the block's tokens)."""
    tokens: torch.Tensor
    probs: torch.Tensor
    proposed: torch.Tensor
    lead: torch.Tensor | None = None
    lead_depths: torch.Tensor | None = None
    # The lookup's LeadGate when it is still to be applied (the lookup ran beside the block's draft: the grow launch
    # applies it, writing the gated lead_depths in place)
    gate: LeadGate | None = None


class DeviceDrafter(Protocol):
    depth: int  # draft depth (rows of candidates a draft returns)
    # Depths whose candidates are ranked (the block drafter's); past them one candidate a depth at most (prompt
    # lookup's match running deeper than the block: EngineConfig.lookup_depth)
    ranked_depth: int
    topk: int  # candidates per depth
    capacity: int  # positions its state can hold: a step must end below it
    needs_features: bool  # commit reads the target's captured features
    use_graph: bool  # may run inside the loop's CUDA graphs
    # A device copy of the sequence by position (prompt lookup reads it), or None: the loop writes each step's
    # committed tokens into it (in its commit launch), so commit need not.
    sequence: torch.Tensor | None

    def begin(self, seq: list[int], base: int) -> None:
        """Host side, before a chunk of steps from the pending token at slot base (seq = prompt + output)."""

    # Block drafters: their cache of context keys/values by slot (slot = position), whose rows a tree step's move
    # places like the target's when the drafter observed every tree row (EngineConfig.observe_overlap); else None.
    cache: torch.Tensor | None

    def draft(self, state: torch.Tensor) -> DeviceDraft:
        """state = (pending token, its slot) -> the step's draft."""

    def commit(self, features: torch.Tensor | None, slots: torch.Tensor,
               positions: torch.Tensor | None = None) -> None:
        """The step's outcome: the target's features of the accepted path's rows (slots base.., in depth order, at
        their positions), or of every tree row at the tree's slots and positions (observe_overlap)."""

    def end(self, base: int) -> None:
        """Host side, after a chunk: the pending token now sits at slot base."""

    def buffers(self) -> list[torch.Tensor]:
        """Device state a graph capture's warm-up steps overwrite (restored after capture)."""


class BlockDeviceDrafter:
    needs_features = True
    sequence = None

    def __init__(self, drafter: BlockTreeDrafter):
        self.drafter, self.step = drafter, drafter.step
        self.depth, self.topk, self.capacity = drafter.shape.depth, drafter.topk, drafter.capacity
        self.ranked_depth = self.depth
        self.use_graph = drafter.use_graph
        # Every depth is a proposal. A device constant: a tensor made from a Python int inside a graph capture
        # would be a pageable host-to-device copy, which capture refuses.
        self.proposed = torch.tensor(self.depth, device=drafter.device)

    def begin(self, seq: list[int], base: int) -> None:
        if self.drafter.n_ctx != base:
            raise RuntimeError(f"device loop: the drafter has features for {self.drafter.n_ctx} positions, the "
                               f"pending token sits at {base}")

    @property
    def cache(self) -> torch.Tensor:
        return self.step.cache

    def draft(self, state) -> DeviceDraft:
        tokens, probs = self.step.draft(state)
        return DeviceDraft(tokens[:self.depth], probs[:self.depth], self.proposed)

    def commit(self, features, slots, positions=None) -> None:
        self.step.project(features, slots, positions)

    def end(self, base: int) -> None:
        self.drafter.n_ctx = base

    def buffers(self) -> list[torch.Tensor]:
        return [self.step.cache]


class NgramPrefixDeviceDrafter:
    """NgramPrefixDrafter's device half: the lookup's token leads the block's candidates at the depths it covers (the
    lookup's gate, if any, reads the block's draft). A lookup deeper than the block (EngineConfig.lookup_depth)
    drafts the depths past the block's alone: there the block's candidates are padding at probability 0."""
    needs_features = True

    def __init__(self, block: BlockDeviceDrafter, lookup: "NgramDeviceDrafter"):
        if lookup.depth < block.depth:
            raise ValueError(f"the lookup drafts {lookup.depth} tokens, the block {block.depth}: at least as many")
        self.block, self.lookup = block, lookup
        # EngineConfig.lookup_overlap: the device loop's second stream, where the lookup runs beside the block's draft
        # (ungated: the draft's gate goes to the grow launch)
        self.side: SideStream | None = None
        self.depth, self.ranked_depth, self.topk = lookup.depth, block.depth, block.topk
        self.capacity, self.use_graph = min(block.capacity, lookup.capacity), block.use_graph
        self.sequence = lookup.sequence
        pad = lookup.depth - block.depth
        self._pad = (torch.zeros(pad, self.topk, dtype=torch.long, device=lookup.sequence.device),
                     torch.zeros(pad, self.topk, dtype=torch.float32, device=lookup.sequence.device)) if pad else None

    def begin(self, seq: list[int], base: int) -> None:
        self.block.begin(seq, base)
        self.lookup.begin(seq, base)

    @property
    def cache(self) -> torch.Tensor:
        return self.block.cache

    def draft(self, state) -> DeviceDraft:
        gate = None
        if self.side is None:
            block = self.block.draft(state)
            lookup = self.lookup.draft(state, block)
        else:
            with self.side.fork(state, self.lookup.sequence):
                lookup = self.lookup.draft(state)
            block = self.block.draft(state)
            self.side.join()
            gate = self.lookup.gate
        tokens, probs = block.tokens, block.probs
        if self._pad is not None:
            tokens, probs = torch.cat([tokens, self._pad[0]]), torch.cat([probs, self._pad[1]])
        return DeviceDraft(tokens, probs, block.proposed, lookup.tokens[:, 0], lookup.proposed, gate)

    def commit(self, features, slots, positions=None) -> None:
        self.block.commit(features, slots, positions)

    def end(self, base: int) -> None:
        self.block.end(base)
        self.lookup.end(base)

    def buffers(self) -> list[torch.Tensor]:
        return self.block.buffers() + self.lookup.buffers()


class NgramDeviceDrafter:
    """Proposals equal NgramDrafter's where it proposes; where it finds no match, or its match runs out before
    draft_len tokens, the depths past the proposal hold filler (counted as not proposed)."""
    needs_features = False
    topk = 1
    use_graph = True
    cache = None

    def __init__(self, drafter: NgramDrafter, capacity: int, device: torch.device, gate: LeadGate | None = None):
        self.depth, self.ngram_max, self.ngram_min = drafter.draft_len, drafter.ngram_max, drafter.ngram_min
        self.periodic, self.ranked_depth = drafter.periodic, self.depth
        self.gate = gate  # NgramPrefixDrafter's: its draft then needs the block's
        self.capacity = capacity
        # The sequence (prompt + output) by position; the loop writes depth + 1 tokens past the pending one a step.
        self.sequence = torch.zeros(capacity + self.depth + 2, dtype=torch.long, device=device)
        self.synced = 0  # positions 0..synced-1 of the current request hold its tokens
        self.ones = torch.ones(self.depth, 1, device=device)
        self._seq: list[int] | None = None

    def begin(self, seq: list[int], base: int) -> None:
        if self._seq is not seq:  # a new request: its tokens from the start
            self._seq, self.synced = seq, 0
        if self.synced < base + 1:  # host steps ran since: their tokens (a small copy, not per step)
            self.sequence[self.synced:base + 1].copy_(torch.tensor(seq[self.synced:base + 1]))
        self.synced = base + 1

    def draft(self, state, block: DeviceDraft | None = None) -> DeviceDraft:
        """block: the block's draft, whose depth-1 candidates the gate reads; None: ungated (the caller applies the
        gate: NgramPrefixDeviceDrafter beside the block's draft)."""
        # CPU: the torch reference (the interpreted kernel takes ~10 ms a lookup; tests run it directly)
        lookup = ngram_lookup if self.sequence.is_cuda else ngram_lookup_ref
        gated = {} if self.gate is None or block is None else {"gate": self.gate, "candidates": block.tokens[0],
                                                               "candidate_probs": block.probs[0]}
        draft, proposed = lookup(self.sequence, state, self.ngram_min, self.ngram_max, self.depth, **gated,
                                 periodic=self.periodic)
        return DeviceDraft(draft[:, None], self.ones, proposed[0])

    def commit(self, features, slots, positions=None) -> None:
        pass  # the loop writes the committed tokens into `sequence`

    def end(self, base: int) -> None:
        self.synced = base + 1  # the loop wrote every committed token itself

    def buffers(self) -> list[torch.Tensor]:
        return [self.sequence]


# ---- prompt lookup on the device: one kernel (a single program scans the context), and its torch reference ----
# A match's (length, continuation start) packed in one int32, length in the high bits: one max finds the longest
# match and, among those, the most recent. Contexts stay below 2**24 tokens (check_lookup_args).
MATCH_BITS = 24
MATCH_SHIFT = tl.constexpr(MATCH_BITS)  # (constexpr globals only, in kernels)
MATCH_START = tl.constexpr((1 << MATCH_BITS) - 1)  # the low bits: the continuation start


@triton.jit
def lookup_into(tok_ptr, length, draft_ptr, NMAX: tl.constexpr, NMIN: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, BLOCK: tl.constexpr, PERIODIC: tl.constexpr):
    """NgramDrafter's proposal for the context tok_ptr[0..length-1] (the pending token last): K tokens from where
    the match continues into draft_ptr -> (where the continuation starts: `length` without a match, how many of the
    K tokens are the proposal).

    One pass over continuation starts e (1 <= e <= length - 2: a token after the match, before the pending one):
    m(e) = how many tokens before e equal the context's last ones, up to NMAX. The longest suffix with an earlier
    occurrence is max m(e) (if >= NMIN), its most recent occurrence the last e reaching it: NgramDrafter's
    longest-suffix-first rule with NMAX loads a position, not one scan per suffix length (NMAX=8, NMIN=2: 8, not 35)."""
    best = length * 0 - 1
    for start in range(0, length, BLOCK):
        e = start + tl.arange(0, BLOCK)
        alive = (e >= 1) & (e <= length - 2)
        m = tl.zeros([BLOCK], dtype=tl.int32)
        for t in tl.static_range(NMAX):
            suffix = tl.load(tok_ptr + tl.maximum(length - 1 - t, 0))  # (past a short context: alive is false)
            alive = alive & (t < e) & (t < length - 1)
            alive = alive & (tl.load(tok_ptr + e - 1 - t, mask=alive, other=-1) == suffix)
            m += alive.to(tl.int32)
        best = tl.maximum(best, tl.max(tl.where(m >= NMIN, (m << MATCH_SHIFT) + e, -1), 0))
    first = tl.where(best >= 0, best & MATCH_START, length)
    k = tl.arange(0, KP)
    n = tl.minimum(length - first, K)
    if PERIODIC:  # NgramDrafter(periodic): past the context's end the last length - first tokens repeat
        tl.store(draft_ptr + k, tl.load(tok_ptr + first + k % tl.maximum(length - first, 1), mask=k < K), mask=k < K)
        n = tl.maximum(n, K)  # (one return, one type: the compiler refuses int32 in one branch, int64 in the other)
    else:
        tl.store(draft_ptr + k, tl.load(tok_ptr + first + k, mask=k < K), mask=k < K)
    return first, tl.where(best >= 0, n, 0)


@triton.jit
def gate_leads(lead, tok_ptr, prob_ptr, doubt, GATE_K: tl.constexpr, GKP: tl.constexpr):
    """LeadGate.leads in a kernel: the lead among the block's first GATE_K depth-1 candidates (tok_ptr, best first;
    GKP: a power of two >= GATE_K), or the block's top-1 probability there (prob_ptr[0]) below doubt."""
    j = tl.arange(0, GKP)
    agree = tl.max((tl.load(tok_ptr + j, mask=j < GATE_K, other=-1) == lead).to(tl.int32), 0) > 0
    return agree | (tl.load(prob_ptr) < doubt)


@triton.jit
def _ngram_kernel(tok_ptr, state_ptr, draft_ptr, proposed_ptr, gate_tok_ptr, gate_prob_ptr, doubt,
                  NMAX: tl.constexpr, NMIN: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                  GATE_K: tl.constexpr, GKP: tl.constexpr, PERIODIC: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the state is the last commit's, the gate's candidates the drafter's
    length = tl.load(state_ptr + 1) + 1  # tokens 0..base: the context, the pending token last
    first, proposed = lookup_into(tok_ptr, length, draft_ptr, NMAX, NMIN, K, KP, BLOCK, PERIODIC)
    if GATE_K > 0:  # LeadGate: no proposal where the block's depth-1 candidates contradict the match's first token
        lead = tl.load(tok_ptr + first)  # without a match: filler, and proposed is 0 anyway
        proposed = tl.where(gate_leads(lead, gate_tok_ptr, gate_prob_ptr, doubt, GATE_K, GKP), proposed, 0)
    tl.store(proposed_ptr, proposed.to(tl.int64))
    release_successor(PDL)


def check_lookup_args(width: int, ngram_min: int, ngram_max: int, k: int) -> None:
    """What lookup_into takes, for the single-request and batched lookups: a buffer row of `width` tokens."""
    if width >= 1 << MATCH_BITS:
        raise ValueError(f"a lookup buffer of {width} tokens: the device lookup takes fewer than {1 << MATCH_BITS}")
    if not 1 <= ngram_min <= ngram_max or k < 1:
        raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max}) and k ({k}) >= 1")


def _check_lookup(tokens, state, ngram_min, ngram_max, k, gate, candidates, candidate_probs):
    check_tensor("tokens", tokens, (None,), torch.int64)
    check_tensor("state", state, (2,), torch.int64, tokens.device)
    check_lookup_args(tokens.shape[0], ngram_min, ngram_max, k)
    if (gate is None) != (candidates is None) or (candidates is None) != (candidate_probs is None):
        raise ValueError("a gate comes with the block's depth-1 candidates and their probabilities, and only with one")
    if gate is not None:
        check_tensor("candidates", candidates, (None,), torch.int64, tokens.device)
        check_tensor("candidate_probs", candidate_probs, candidates.shape, torch.float32, tokens.device)


def ngram_lookup(tokens: torch.Tensor, state: torch.Tensor, ngram_min: int, ngram_max: int, k: int,
                 gate: LeadGate | None = None, candidates: torch.Tensor | None = None,
                 candidate_probs: torch.Tensor | None = None, periodic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """NgramDrafter's proposal for the context tokens[0..state[1]] (state = (pending token, its slot)), read on the
    device -> (k tokens from where the match continues, [1] how many of them are its proposal). tokens must hold
    state[1] + k + 1 entries (the filler past the context is read, not proposed). With a gate: nothing is proposed
    where it refuses the match, given the block's candidates at depth 1 (best first) and their probabilities.
    periodic: NgramDrafter(periodic)'s proposal (a continuation reaching the context's end repeats)."""
    _check_lookup(tokens, state, ngram_min, ngram_max, k, gate, candidates, candidate_probs)
    check_launchable(_ngram_kernel, tokens.device)
    draft = torch.empty(k, dtype=torch.long, device=tokens.device)
    proposed = torch.empty(1, dtype=torch.long, device=tokens.device)
    gate_k = 0 if gate is None else min(gate.agree_topk, candidates.shape[0])
    _ngram_kernel[(1,)](tokens, state, draft, proposed, tokens if gate is None else candidates,
                        draft if gate is None else candidate_probs, 0.0 if gate is None else gate.doubt_prob,
                        NMAX=ngram_max, NMIN=ngram_min, K=k, KP=triton.next_power_of_2(k), BLOCK=1024,
                        GATE_K=gate_k, GKP=triton.next_power_of_2(max(gate_k, 1)), PERIODIC=periodic, num_warps=4,
                        **pdl_launch(tokens.device))
    return draft, proposed


def ngram_lookup_ref(tokens, state, ngram_min, ngram_max, k, gate=None, candidates=None, candidate_probs=None,
                     periodic=False):
    """Plain torch (fixed-shape ops over the whole buffer, no host sync): ngram_lookup's results."""
    _check_lookup(tokens, state, ngram_min, ngram_max, k, gate, candidates, candidate_probs)
    draft, proposed, _ = lookup_rows_ref(tokens[None], state[1:2], ngram_min, ngram_max, k, periodic)
    if gate is not None:
        proposed = torch.where(gate.leads_on_device(draft[0, 0], candidates, candidate_probs), proposed, 0)
    return draft[0], proposed


def lookup_rows_ref(tokens: torch.Tensor, positions: torch.Tensor, ngram_min: int, ngram_max: int, k: int,
                    periodic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NgramDrafter's proposal for every row of tokens [rows, width] at once (row r's context 0..positions[r], its
    pending token last) -> (k tokens from where each match continues [rows, k], how many are proposed [rows], where
    the continuation starts [rows] (the context's length without a match));
    fixed-shape ops, no host sync. width must exceed every position by k + 1 (filler is read, not proposed)."""
    width = tokens.shape[1]
    length = positions + 1
    starts = torch.arange(width, device=tokens.device)
    best, best_n = torch.full_like(length, -1), torch.zeros_like(length)
    for n in range(ngram_max, ngram_min - 1, -1):  # longest suffix first
        suffix = tokens.gather(1, (length[:, None] - n).clamp(min=0) + starts[None, :n])  # [rows, n]
        match = (tokens.unfold(1, n, 1) == suffix[:, None, :]).all(2)  # [rows, width - n + 1]
        j = starts[None, :match.shape[1]]
        # an earlier occurrence followed by a token before the pending one (NgramDrafter indexes the context
        # without its last token), with the suffix fully in context
        ok = match & (j + n <= length[:, None] - 2) & (length[:, None] - 1 >= n)
        latest = torch.where(ok, j, -1).max(1).values
        take = (best < 0) & (latest >= 0)
        best, best_n = torch.where(take, latest, best), torch.where(take, n, best_n)
    first = torch.where(best >= 0, best + best_n, length)  # no match: filler from past the context
    if periodic:
        proposed = torch.where(best >= 0, k, 0)
        return tokens.gather(1, first[:, None] + starts[None, :k] % (length - first).clamp(min=1)[:, None]), \
            proposed, first
    proposed = torch.where(best >= 0, (length - first).clamp(max=k), 0)
    return tokens.gather(1, first[:, None] + starts[None, :k]), proposed, first
