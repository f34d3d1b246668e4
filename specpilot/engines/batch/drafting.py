"""Per-request drafters of the batched engine: chains of token ids, one drafter object per request.

NgramChainDrafter proposes exactly what engines.drafters.ngram.NgramDrafter proposes (test_batch checks it)
without its per-call costs that grow with the context (it re-compares the whole context to detect a new
sequence and copies it; here a request's sequence only ever grows) and without the trace statistics. It also
drafts AHEAD (mechanism c): given the draft being verified, it proposes the tokens after "every draft token
accepted", from its index of committed text alone (the index only ever holds committed tokens). With extrapolate,
proposals inside periodic text continue its counts (extrapolate_period).
"""
from __future__ import annotations

import operator
from typing import Callable, Protocol, Sequence

from specpilot.engines.drafters.base import Drafter


class ChainDrafter(Protocol):
    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing seq (prompt + committed output; seq[-1] is not yet in the cache)."""
        ...


# extrapolate_period's rule: a period of at least PERIOD_MIN tokens whose previous two repeats agree on at least
# AGREE_TENTHS tenths of their tokens; tokens that moved by at most STEP_MAX ids between them move once more.
PERIOD_MIN, AGREE_TENTHS, STEP_MAX = 4, 7, 9


def extrapolate_period(context: Sequence[int], first: int, proposal: list[int], vocab: int,
                       k: int | None = None) -> list[int]:
    """A lookup's proposal (context[first:], the text after the matched n-gram's last occurrence) continued period by
    period: the period is p = len(context) - first (the match sits p tokens back); where the last two periods agree
    mostly (PERIOD_MIN, AGREE_TENTHS), the token m periods on from one that changed between them by 0 < |d| <=
    STEP_MAX ids is token + m * d (digits are consecutive ids: a count goes on counting), if that is an id below
    `vocab`. A proposal that ran to the context's end (all p tokens) goes on repeating the period up to k tokens (the
    lookup alone proposes one period a step in a loop). Else the proposal."""
    p = len(context) - first
    if p < PERIOD_MIN or first < p:
        return proposal
    last, prev = context[first:], context[first - p:first]
    agree = sum(map(operator.eq, last, prev))  # C loops: ~10x a generator
    if 10 * agree < AGREE_TENTHS * p:
        return proposal
    count = max(len(proposal), k or 0) if len(proposal) == p else len(proposal)
    out = []
    for j in range(count):
        m, base = j // p + 1, last[j % p]  # the proposal's token j is the last period's (j % p), m periods on
        d = base - prev[j % p]
        out.append(base + m * d if 0 < abs(d) <= STEP_MAX and 0 <= base + m * d < vocab else base)
    return out


class NgramChainDrafter:
    """Longest suffix (ngram_max down to ngram_min tokens) of the sequence matched against its earlier text;
    proposes what followed the most recent earlier occurrence (extrapolate, with `vocab`: extrapolate_period's)."""

    def __init__(self, draft_len: int, ngram_max: int, ngram_min: int = 1, extrapolate: bool = False,
                 vocab: int = 0):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        if extrapolate and vocab < 1:
            raise ValueError("extrapolate needs the vocabulary size (its ids bound the extrapolated tokens)")
        self.draft_len, self.ngram_max, self.ngram_min = draft_len, ngram_max, ngram_min
        self.extrapolate, self.vocab = extrapolate, vocab
        # n -> n-gram -> start positions (ascending), for n-grams followed by a token already indexed
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self._indexed = 0

    def _extend(self, seq: Sequence[int], upto: int) -> None:
        for end in range(self._indexed, upto):
            for n, table in self._index.items():
                j = end - n
                if j >= 0:
                    table.setdefault(tuple(seq[j:end]), []).append(j)
        self._indexed = max(self._indexed, upto)

    def _lookup(self, seq: Sequence[int], tail: Sequence[int], k: int) -> list[int]:
        """Match the last n tokens of seq + tail; continuation read from seq + tail."""
        length = len(seq) + len(tail)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            if n > len(tail):
                suffix = tuple(seq[len(seq) - (n - len(tail)):]) + tuple(tail)
            else:
                suffix = tuple(tail[len(tail) - n:])
            starts = self._index[n].get(suffix)
            if not starts:
                continue
            a = starts[-1] + n  # most recent earlier occurrence; its continuation starts at a
            prop = list(seq[a:a + k])
            if len(prop) < k and a + len(prop) >= len(seq):
                prop += list(tail[max(0, a - len(seq)):max(0, a - len(seq)) + k - len(prop)])
            if prop and self.extrapolate:  # (the lookup never reaches past the context: at most one period)
                context = seq if not tail else list(seq) + list(tail)  # (no copy of the context a step)
                return extrapolate_period(context, a, prop, self.vocab, k)
            if prop:
                return prop
        return []

    def propose(self, seq: list[int], k: int) -> list[int]:
        k = min(self.draft_len, k)
        if k <= 0 or len(seq) < 2:
            return []
        self._extend(seq, len(seq) - 1)  # n-grams that have a following token
        return self._lookup(seq, (), k)

    def propose_ahead(self, seq: list[int], draft: list[int], k: int) -> list[int]:
        """Tokens after seq + draft + (bonus): k + 1 of them, the first being the guess of the bonus token.
        Reads the index as it is (committed text), never extends it with the unverified draft."""
        if k < 0 or len(seq) + len(draft) < 2:
            return []
        self._extend(seq, len(seq) - 1)
        return self._lookup(seq, draft, min(self.draft_len, k) + 1)


class TreeDrafterAdapter:
    """Any engines.drafters Drafter whose proposals are chains, as a ChainDrafter (e.g. test oracles)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        drafter.reset()

    def propose(self, seq: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        tree = self.drafter.propose(seq, k)
        if any(p != i - 1 for i, p in enumerate(tree.parents)):
            raise ValueError("the batched engine verifies chains; this drafter proposed a tree")
        return list(tree.tokens[:k])


DrafterFactory = Callable[[object], ChainDrafter]  # request -> its drafter (the request carries id and prompt)
