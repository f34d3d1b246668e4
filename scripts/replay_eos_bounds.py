"""Replay: how far above the 16-row tree a step of the EOS-stopped answers could get with the same drafter.

python3 scripts/replay_eos_bounds.py R [--window 256] [--beta 0.3 --lam 0.3] [--leak]
(R: a `specpilot drafter replay --out R` directory whose candidates/ hold the drafter's top-8 candidates;
notes/h200.md, session 47.) Over the steps of the references that stop before 2048 tokens, walked as the gated
16-row tree led by lookup accepts them (smollm2-135m-h200's narrow steps), mean draft tokens a step accepted by:
- `tree15` / `tree31` / `tree63`: best-first trees of that budget over the same lattice;
- `top{k}`: the longest prefix of the output whose every token is among the lattice's top k at its depth (a bound
  no tree of the lattice passes at any budget; top1 is the chain);
- `second_lookup`: the better of the tree and the best continuation of another occurrence of the context's suffix
  n-grams whose first token differs from the lookup's (a second lookup chain, chosen by an oracle);
- `bigram`: the tree with each child's probability reweighted by a bigram model of the target's text (p * (bigram +
  lam) ** beta, renormalised to the depth's mass), fitted on the other half of the references (two folds; --leak:
  on all of them, the test text included): the conditional signal a parallel drafter's marginals lack.
"""
import argparse
import collections
import heapq
from pathlib import Path

from specpilot.costmodel.acceptance import Tree, best_first_tree, replay_accepted
from specpilot.drafting.replay import saved_replay
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.ngram_prefix import LeadGate, led_by_lookup

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("--window", type=int, default=256)
ap.add_argument("--beta", type=float, default=0.3)
ap.add_argument("--lam", type=float, default=0.3)
ap.add_argument("--leak", action="store_true")
args = ap.parse_args()
refs, cands = saved_replay(args.replay_dir, window=args.window)
GATE, DEPTH, WIDTH = LeadGate(2, 0.7), 15, 8


def matched(proposal: list[int], truth: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(proposal, truth)) if a != b), min(len(proposal), len(truth)))


def bigram_tree(tok, pr, pending: int, budget: int, big) -> Tree:
    """best_first_tree with each node's children rescored by big(parent token, child token)."""
    def kids(t, d):
        if d >= len(tok):
            return []
        mass = sum(p for p in pr[d] if p > 0)
        w = [p * (big(t, c) + args.lam) ** args.beta if p > 0 else 0.0 for c, p in zip(tok[d], pr[d])]
        total = sum(w) or 1.0
        return sorted(((x / total * mass, c) for x, c in zip(w, tok[d]) if x > 0), reverse=True)
    tokens, parents, scores, heap, tie = [], [], [], [], 0
    first = kids(pending, 0)
    if first:
        heap.append((-first[0][0], tie, first, 0, -1, 1.0, 0))
    while heap and len(tokens) < budget:
        neg, _, kl, r, parent, pscore, d = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(kl[r][1]), parents.append(parent), scores.append(-neg)
        if r + 1 < len(kl):
            tie += 1
            heapq.heappush(heap, (-pscore * kl[r + 1][0], tie, kl, r + 1, parent, pscore, d))
        children = kids(kl[r][1], d + 1)
        if children:
            tie += 1
            heapq.heappush(heap, (neg * children[0][0], tie, children, 0, node, -neg, d + 1))
    return Tree(tuple(tokens), tuple(parents), tuple(scores))


sums = collections.Counter()
for fold in (0, 1):
    counts, seen = collections.Counter(), collections.Counter()
    for i, r in enumerate(refs):
        if args.leak or i % 2 != fold:
            s = list(r.prompt) + list(r.output)
            counts.update(zip(s, s[1:]))
            seen.update(s[:-1])
    big = lambda a, b: counts[a, b] / (seen[a] + 1)  # noqa: E731
    for i, (ref, c) in enumerate(zip(refs, cands)):
        if i % 2 != fold or len(ref.output) >= 2000:
            continue
        seq = list(ref.prompt) + list(ref.output)
        start, end = len(ref.prompt), len(seq) - 1
        T, P = c.tokens[:, :DEPTH, :WIDTH].tolist(), c.probs[:, :DEPTH, :WIDTH].tolist()
        look, a = NgramDrafter(DEPTH, 8, 2, True), start
        while a < end:
            ctx, truth = seq[:a + 1], seq[a + 1:a + 1 + DEPTH]
            tok, pr = led_by_lookup(look.propose(ctx, DEPTH).tokens, T[a - start], P[a - start], GATE)
            acc = replay_accepted(best_first_tree(tok, pr, 15), truth)
            sums["tree15"] += acc
            for budget in (31, 63):
                sums[f"tree{budget}"] += replay_accepted(best_first_tree(tok, pr, budget), truth)
            for k in (1, 2, 4, 8):
                sums[f"top{k}"] += next((d for d, (t, cand) in enumerate(zip(truth, tok)) if t not in cand[:k]),
                                        min(len(truth), len(tok)))
            conts = [ctx[j + n:j + n + DEPTH] for n in range(8, 1, -1)
                     for j in reversed(look._index[n].get(tuple(ctx[-n:]), []))]
            others = [x for x in conts if x[:1] != conts[0][:1]] if conts else []
            sums["second_lookup"] += max(acc, max((matched(x, truth) for x in others), default=0))
            sums["bigram"] += replay_accepted(bigram_tree(tok, pr, ctx[-1], 15, big), truth)
            sums["steps"] += 1
            a += min(acc + 1, end - a)
n = sums.pop("steps")
print(f"{n} steps of the EOS-stopped answers; draft tokens accepted a step:")
for name, v in sums.items():
    print(f"  {name:>14}: {v / n:.3f}")
