"""Replay: the drafter's head restricted to the N tokens most frequent in the target's own training generations.

python3 scripts/replay_vocab_head.py R SEQUENCES [--rows 4096,8192,16384] [--ar-ms 0.692 --narrow-ms 0.904 --wide-ms 1.066]
(R: a `specpilot drafter replay --out R` directory with the drafter's top-8 candidates of drafter_window 256;
SEQUENCES: a training call's `sequences/train.safetensors`.) The smollm2-135m-h200 switched tree under the lookup
gate, once with the candidates as cached and once per N with the candidates outside the N tokens dropped (prob 0,
never accepted; the cached top-8 filtered, not a restricted softmax's top-8: a lower bound). Prints the share of the
references' output tokens inside, the geometric-mean speedup at those step costs and the mean tokens a step.
"""
import argparse
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from specpilot.drafting.replay import AnchorCandidates, LookupPolicy, replay_speedup, saved_replay
from specpilot.engines.drafters.ngram_prefix import LeadGate

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("sequences", type=Path)
ap.add_argument("--rows", default="4096,8192,16384")
ap.add_argument("--ar-ms", type=float, default=0.692)
ap.add_argument("--narrow-ms", type=float, default=0.904)
ap.add_argument("--wide-ms", type=float, default=1.066)
args = ap.parse_args()

seq = load_file(str(args.sequences))
flat, length, prompt_len = seq["tokens"].long(), seq["length"].long(), seq["prompt_len"].long()
start = torch.cumsum(length, 0) - length
generated = torch.cat([flat[s + p:s + n] for s, p, n in zip(start.tolist(), prompt_len.tolist(), length.tolist())])
refs, cands = saved_replay(args.replay_dir, window=256)
vocab = max(int(generated.max()), max(max(r.output) for r in refs)) + 1
by_frequency = torch.bincount(generated, minlength=vocab).argsort(descending=True)
outputs = torch.cat([torch.tensor(r.output) for r in refs])
WIDE = LookupPolicy(tree_budget=31, tree_width=8, ngram_min=2, ngram_max=8, lookup_depth=31, periodic=True)
POLICY = replace(WIDE, narrow_tree_budget=15, wide_tree_after=8, gate=LeadGate(2, 0.7))


def run(cs: list[AnchorCandidates]) -> tuple[float, float]:
    return replay_speedup(refs, cs, POLICY, args.ar_ms, {15: args.narrow_ms, 31: args.wide_ms})


def restricted(c: AnchorCandidates, keep: torch.Tensor) -> AnchorCandidates:
    inside = keep[c.tokens]
    probs, order = torch.where(inside, c.probs, 0.0).sort(dim=-1, descending=True, stable=True)
    return AnchorCandidates(torch.where(inside, c.tokens, -1).gather(-1, order), probs)


print(f"{generated.numel()} generated tokens, {int((torch.bincount(generated) > 0).sum())} distinct")
print("| head rows | outputs' tokens inside | speedup | tokens/step |\n|---|---|---|---|")
s, t = run(cands)
print(f"| all | 100% | {s:.4f}x | {t:.3f} |", flush=True)
for n in map(int, args.rows.split(",")):
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[by_frequency[:n]] = True
    s, t = run([restricted(c, keep) for c in cands])
    print(f"| {n} | {100 * keep[outputs].float().mean():.1f}% | {s:.4f}x | {t:.3f} |", flush=True)
