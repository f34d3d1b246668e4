"""N-gram / suffix lookup drafter (prompt lookup): training-free, reads the prompt and the output so far."""
from __future__ import annotations

from collections import Counter, defaultdict

from specpilot.engines.drafters.base import DraftTree


class NgramDrafter:
    """Matches the longest suffix (ngram_max down to ngram_min tokens) of the context against earlier text and
    proposes the tokens that followed its most recent earlier occurrence. periodic: a continuation that runs into
    the context's end goes on as the text did since the occurrence (its last P tokens again and again, P the
    occurrence's distance): in a loop shorter than the draft, the draft covers several of its turns."""

    def __init__(self, draft_len: int, ngram_max: int, ngram_min: int = 1, periodic: bool = False):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        self.draft_len, self.ngram_max, self.ngram_min = draft_len, ngram_max, ngram_min
        self.periodic = periodic
        self.reset()

    def reset(self) -> None:
        # n -> n-gram -> start positions (ascending); indexed incrementally as the context grows.
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: defaultdict(list) for n in range(self.ngram_min, self.ngram_max + 1)}
        self._indexed = 0
        self._context: list[int] = []

    def _extend(self, context: list[int]) -> None:
        if context[:self._indexed] != self._context[:self._indexed]:
            self.reset()  # a different sequence: start over
        self._context = context
        # An n-gram starting at j is indexed once a token follows it (j + n < len).
        for end in range(self._indexed, len(context)):
            for n, table in self._index.items():
                j = end - n
                if j >= 0:
                    table[tuple(context[j:end])].append(j)
        self._indexed = len(context)

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        k = min(self.draft_len, max_depth)
        if k <= 0 or len(context) < 2:
            return DraftTree()
        self._extend(context[:-1])  # index n-grams that have a following token
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            starts = self._index[n].get(tuple(context[-n:]))
            if not starts:
                continue
            j = starts[-1]  # most recent earlier occurrence
            proposal = context[j + n: j + n + k]
            if not proposal:
                continue
            if self.periodic and len(proposal) < k:  # it ran into the end: the last len(proposal) tokens repeat
                proposal = [proposal[i % len(proposal)] for i in range(k)]
            # Depth-1 candidates weighted by how often each continuation followed this n-gram.
            counts = Counter(context[s + n] for s in starts if s + n < len(context))
            total = sum(counts.values())
            top = counts.most_common(4)
            topk_tokens = [[t for t, _ in top]] + [[t] for t in proposal[1:]]
            topk_probs = [[c / total for _, c in top]] + [[1.0] for _ in proposal[1:]]
            return DraftTree.chain(proposal, [n / self.ngram_max] * len(proposal),
                                   topk_tokens=topk_tokens, topk_probs=topk_probs)
        return DraftTree()
