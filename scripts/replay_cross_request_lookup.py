"""Replay: prompt lookup that also searches earlier requests (their prompt + output, in the bench's order).

python3 scripts/replay_cross_request_lookup.py R   (R: a `specpilot drafter replay --out R` directory whose
candidates/ hold the drafter's top-8 candidates, e.g. after `--tree-width 8`; notes/cpu-s36-cross-request-lookup.md)
Where the context has no match, the lookup takes the most recent continuation of the longest suffix in the earlier
requests ('fallback'), or the longer of the two matches ('longest'); 'corpus gate' leads with a corpus match only
where the block agrees (LeadGate). Prints tokens/step (mean and geometric mean over requests) per policy.
"""
import statistics
import sys
from pathlib import Path

from specpilot.drafting.replay import LookupPolicy, accepted_length, saved_replay
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.ngram_prefix import LeadGate

R = Path(sys.argv[1])
refs, cands = saved_replay(R)
NMAX = 4


class Corpus:
    """Earlier requests' n-grams -> the most recent continuation."""

    def __init__(self, nmin):
        self.seqs, self.index, self.nmin = [], {}, nmin

    def add(self, seq):
        self.seqs.append(seq)
        for n in range(self.nmin, NMAX + 1):
            for i in range(len(seq) - n):
                self.index[(n, tuple(seq[i:i + n]))] = (len(self.seqs) - 1, i + n)

    def match(self, ctx, k):
        """(suffix length, the k tokens after its most recent occurrence) of the longest suffix found, or (0, [])."""
        for n in range(NMAX, self.nmin - 1, -1):
            hit = self.index.get((n, tuple(ctx[-n:])))
            if hit is not None:
                return n, self.seqs[hit[0]][hit[1]:hit[1] + k]
        return 0, []


def context_match_len(look, ctx):
    for n in range(NMAX, look.ngram_min - 1, -1):
        if look._index[n].get(tuple(ctx[-n:])):
            return n
    return 0


def run(gate, budget, width, nmin, mode, corpus_gate=None):
    corpus, per, shape = Corpus(nmin), [], LookupPolicy(tree_budget=budget, tree_width=width)
    for ref, c in zip(refs, cands):
        tokens_at, probs_at = c.tokens.tolist(), c.probs.tolist()
        seq = list(ref.prompt) + list(ref.output)
        start, end = len(ref.prompt), len(seq) - 1
        depth = len(tokens_at[0])
        look = NgramDrafter(depth, NMAX, nmin)
        a, steps = start, []
        while a < end:
            ctx = seq[:a + 1]
            lead, g = list(look.propose(ctx, depth).tokens), gate
            if mode != "none":
                n_other, other = corpus.match(ctx, depth)
                n_ctx = context_match_len(look, ctx) if lead else 0  # the context's match wins a tie
                if other and (n_ctx == 0 if mode == "fallback" else n_other > n_ctx):
                    lead, g = other, corpus_gate or gate
            accepted = accepted_length(lead, tokens_at[a - start], probs_at[a - start], g, shape,
                                       seq[a + 1:a + 1 + depth])
            steps.append(min(accepted + 1, end - a))
            a += steps[-1]
        per.append(sum(steps) / len(steps))
        if mode != "none":
            corpus.add(seq)
    return statistics.mean(per), statistics.geometric_mean(per)


POLICIES = {"chain, lookup gated top2|p<0.7": (LeadGate(2, 0.7), 0, 4, 1),
            "tree15 width 8, lookup n>=2": (None, 15, 8, 2)}
print("| policy | cross-request lookup | mean | geomean |\n|---|---|---|---|")
for name, (gate, budget, width, nmin) in POLICIES.items():
    for mode, cg in (("none", None), ("fallback", None), ("longest", None), ("fallback", LeadGate(1, 0.0))):
        m, gm = run(gate, budget, width, nmin, mode, cg)
        label = mode + (" (corpus gate top1)" if cg else "")
        print(f"| {name} | {label} | {m:.3f} | {gm:.3f} |", flush=True)
