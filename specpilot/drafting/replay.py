"""Replay of a block drafter's lookup-led drafts against recorded greedy outputs, without running verification.

The target's greedy output fixes what every verify step accepts: a draft's accepted length is its longest prefix (a
tree: root path) equal to the output after the pending token. So with the drafter's candidates at every position of
a reference output (one teacher-forced target forward for the features, the drafter's block at each anchor) any
lookup/gate/tree policy can be replayed step by step in Python: tokens per step for many policies from one pass,
where the engine would decode every request again per policy. The replay follows the engine's rules:
NgramDrafter's match (longest suffix, most recent), ngram_prefix.led_by_lookup (the gate), best_first_tree; a test
checks its steps against the engine's on a tiny model. A tree replays the per-step best-first tree: the host loop's
and the device loop's with device_tree=per_step (engines.tree_grow grows the same tree), not a calibrated static
shape. The candidates, the costly part, are kept per drafter and top-k (cached_candidates): policy sweeps over the
same outputs recompute nothing.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from specpilot.costmodel.acceptance import best_first_tree, replay_accepted
from specpilot.drafting.data import recompute
from specpilot.drafting.objective import Batch, block_logits
from specpilot.engines.drafters.block import BlockDrafterModel, lm_head_weight
from specpilot.engines.drafters.block_step import check_window
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.ngram_prefix import LeadGate, led_by_lookup
from specpilot.engines.engine import StepBudgets
from specpilot.engines.llama import LlamaModel
from specpilot.stats import geomean


@dataclass(frozen=True)
class Reference:
    """A request's prompt and its greedy output (the AR engine's), the first output token from the prefill."""
    key: str
    benchmark: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompt or not self.output:
            raise ValueError(f"{self.key}: a reference needs a prompt and an output")


@dataclass(frozen=True)
class AnchorCandidates:
    """The drafter's top-k candidates and probabilities [anchors, depth, k] with the pending token at positions
    len(prompt) .. len(prompt) + len(output) - 2 (one row per position)."""
    tokens: torch.Tensor
    probs: torch.Tensor


@dataclass(frozen=True)
class LookupPolicy:
    """What leads a step's draft: nothing (the block alone), the lookup wherever it matches (gate None), or the
    lookup under a gate; the draft is a chain (tree_budget 0) or a best-first tree of tree_budget nodes."""
    lookup: bool = True
    gate: LeadGate | None = None
    tree_budget: int = 0
    tree_width: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    lookup_depth: int = 0  # EngineConfig.lookup_depth: the lookup leads a tree this deep (0: the block's depth)
    periodic: bool = False  # EngineConfig.lookup_periodic
    # EngineConfig.narrow_tree_budget / wide_tree_after: a step drafts tree_budget nodes where the step two before
    # accepted >= wide_tree_after draft tokens, else narrow_tree_budget (0: tree_budget throughout)
    narrow_tree_budget: int = 0
    wide_tree_after: int = 8
    # EngineConfig.deep_tree_budget / deep_tree_after: a deeper tree where the step two before accepted >= deep_after
    deep_tree_budget: int = 0
    deep_tree_after: int = 16
    deep_tree_chain: bool = False  # EngineConfig.deep_tree_chain: that deep step drafts a chain of its nodes

    def __post_init__(self) -> None:
        if self.gate is not None and not self.lookup:
            raise ValueError("a gate gates the lookup: lookup=False has none")
        if self.tree_budget < 0 or self.tree_width < 1:
            raise ValueError(f"tree_budget={self.tree_budget} must be >= 0, tree_width={self.tree_width} >= 1")
        if self.lookup_depth < 0 or self.lookup_depth and not (self.lookup and self.tree_budget):
            raise ValueError(f"lookup_depth={self.lookup_depth}: >= 0, and past 0 for a lookup-led tree only")
        if self.periodic and not self.lookup:
            raise ValueError("periodic shapes the lookup's match: lookup=False has none")
        if not 0 <= self.narrow_tree_budget < max(self.tree_budget, 1) or self.wide_tree_after < 0:
            raise ValueError(f"narrow_tree_budget={self.narrow_tree_budget}: in 0..tree_budget-1 (a tree's), "
                             f"wide_tree_after={self.wide_tree_after}: >= 0")
        if self.deep_tree_budget and not self.tree_budget < self.deep_tree_budget or self.deep_tree_after < 0:
            raise ValueError(f"deep_tree_budget={self.deep_tree_budget}: 0 or above tree_budget={self.tree_budget}, "
                             f"deep_tree_after={self.deep_tree_after}: >= 0")
        if self.deep_tree_chain and not self.deep_tree_budget:
            raise ValueError("deep_tree_chain makes the deep step a chain: it needs deep_tree_budget")

    def budget_at(self, committed: list[int], j: int) -> int:
        """The tree budget of step j after steps that committed `committed` tokens each (accepted + the bonus), as
        the engine picks it (StepBudgets: switched by narrow_tree_budget / deep_tree_budget, else tree_budget
        throughout)."""
        budgets = StepBudgets.from_config(self)
        return self.tree_budget if budgets is None else budgets.following(committed[j - 2] - 1 if j >= 2 else -1)

    @property
    def label(self) -> str:
        lead = "block" if not self.lookup else "lookup" if self.gate is None else (
            f"lookup gated top{self.gate.agree_topk}|p<{self.gate.doubt_prob:.2g}")
        nmin = f" n>={self.ngram_min}" if self.lookup and self.ngram_min != 1 else ""
        nmax = f" n<={self.ngram_max}" if self.lookup and self.ngram_max != 4 else ""
        deep = f" depth{self.lookup_depth}" if self.lookup_depth else ""
        deep += " periodic" if self.periodic else ""
        deep += f" narrow{self.narrow_tree_budget}>={self.wide_tree_after}" if self.narrow_tree_budget else ""
        deep += f" deep{self.deep_tree_budget}>={self.deep_tree_after}" if self.deep_tree_budget else ""
        deep += " chain" if self.deep_tree_chain else ""
        return f"{'chain' if not self.tree_budget else f'tree{self.tree_budget}'} {lead}{nmin}{nmax}{deep}"


@torch.no_grad()
def anchor_candidates(drafter: BlockDrafterModel, target: LlamaModel, ref: Reference, topk: int = 4,
                      chunk: int = 32, window: int = 0) -> AnchorCandidates:
    """The drafter's depth-1.. candidates at every anchor of ref, from the target's teacher-forced features (window:
    the drafter's context window, EngineConfig.drafter_window)."""
    check_window(window)
    seq = list(ref.prompt) + list(ref.output)
    data = recompute(target, [seq], [len(ref.prompt)], drafter.config.target_layers, batch=1)
    embed, head = target.embed_tokens.weight, lm_head_weight(target)
    anchors = torch.arange(len(ref.prompt), len(seq) - 1, device=data.tokens.device)
    tokens, probs = [], []
    for s in range(0, len(anchors), chunk):
        batch = Batch(data.tokens, data.features, anchors[s:s + chunk][None], None, None)
        p = block_logits(drafter, embed, head, batch, window)[0].float().softmax(-1)  # [anchors, B - 1, vocab]
        top_p, top_t = p.topk(topk, -1)
        tokens.append(top_t.cpu())
        probs.append(top_p.cpu())
    return AnchorCandidates(torch.cat(tokens), torch.cat(probs))


def drafter_digest(drafter: BlockDrafterModel) -> str:
    """The drafter's weights and config, hashed: which drafter a candidates cache belongs to."""
    h = hashlib.sha256(json.dumps(drafter.config.__dict__, sort_keys=True, default=str).encode())
    for name, t in sorted(drafter.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cached_candidates(drafter: BlockDrafterModel, target: LlamaModel, refs: list[Reference], cache: Path,
                      topk: int = 4, progress: bool = True, window: int = 0) -> list[AnchorCandidates]:
    """anchor_candidates of every reference, each kept as a file under cache/<drafter digest>-k<topk>[-w<window>]/
    (a stopped run resumes; a reference whose prompt or output changed is recomputed)."""
    folder = cache / (drafter_digest(drafter) + _cache_suffix(topk, window))
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for ref in tqdm(refs, desc="drafter candidates", unit="req", disable=not progress):
        path = candidates_file(folder, ref)
        if path.is_file():
            out.append(_load_candidates(path))
            continue
        c = anchor_candidates(drafter, target, ref, topk=topk, window=window)
        tmp = path.with_suffix(".tmp")
        torch.save({"key": ref.key, "tokens": c.tokens, "probs": c.probs}, tmp)
        tmp.replace(path)  # whole files only: a run stopped mid-write leaves no half record
        out.append(c)
    return out


def accepted_length(lead: list[int], tokens: list[list[int]], probs: list[list[float]], gate: LeadGate | None,
                    policy: LookupPolicy, truth: list[int]) -> int:
    """Draft tokens one step accepts: the block's candidates tokens / probs [depth][k] led by `lead` under `gate`,
    drafted as policy's chain or tree, against the output's next tokens `truth`."""
    tokens, probs = led_by_lookup(lead, tokens, probs, gate)
    if policy.tree_budget:
        w = policy.tree_width
        return replay_accepted(best_first_tree([t[:w] for t in tokens], [p[:w] for p in probs], policy.tree_budget),
                               truth)
    return next((d for d, (t, want) in enumerate(zip(tokens, truth)) if t[0] != want), len(truth))


def _cache_suffix(topk: int, window: int) -> str:
    """A candidates folder's name after the drafter's digest: its top-k and, past 0, its context window."""
    return f"-k{topk}" + (f"-w{check_window(window)}" if window else "")


def _load_candidates(path: Path) -> AnchorCandidates:
    saved = torch.load(path)
    return AnchorCandidates(saved["tokens"], saved["probs"])


def saved_replay(replay_dir: Path, topk: int = 8, window: int = 0) -> tuple[list[Reference], list[AnchorCandidates]]:
    """The references and cached top-`topk` candidates (of drafter context window `window`) a `specpilot drafter
    replay --out replay_dir` run left, for policy studies that need no model (scripts/replay_*.py). One drafter's
    cache only: which one is ambiguous else."""
    refs = load_references(replay_dir / "references.jsonl")
    folders = sorted((replay_dir / "candidates").glob("*" + _cache_suffix(topk, window)))
    if len(folders) != 1:
        raise ValueError(f"{replay_dir / 'candidates'}: {len(folders)} caches of top-{topk} candidates, want one "
                         f"(`specpilot drafter replay --tree-width {topk}` writes it)")
    missing = [r.key for r in refs if not candidates_file(folders[0], r).is_file()]
    if missing:
        raise ValueError(f"{folders[0]}: no candidates for {len(missing)} references (first {missing[0]}); rerun "
                         "`specpilot drafter replay` to complete the cache")
    return refs, [_load_candidates(candidates_file(folders[0], r)) for r in refs]


def candidates_file(folder: Path, ref: Reference) -> Path:
    """Where cached_candidates keeps ref's candidates inside one drafter's folder."""
    return folder / f"{hashlib.sha256(json.dumps([ref.key, ref.prompt, ref.output]).encode()).hexdigest()[:24]}.pt"


def replay(ref: Reference, cands: AnchorCandidates, policy: LookupPolicy, depth: int | None = None) -> list[int]:
    """Tokens committed by each verify step (accepted + the bonus token) when `policy` drafts ref's output."""
    seq = list(ref.prompt) + list(ref.output)
    start, end = len(ref.prompt), len(seq) - 1  # the prefill commits seq[start]; steps run while a token is due
    depth = depth or cands.tokens.shape[1]
    all_tokens, all_probs = cands.tokens[:, :depth].tolist(), cands.probs[:, :depth].tolist()
    # a lookup leads past the block to here
    deepest = max(depth, min(policy.lookup_depth, max(policy.tree_budget, policy.deep_tree_budget)))
    lookup = NgramDrafter(deepest, policy.ngram_max, policy.ngram_min, policy.periodic) if policy.lookup else None
    a, steps = start, []
    while a < end:
        lead = lookup.propose(seq[:a + 1], deepest).tokens if lookup is not None else []
        shape = policy
        if policy.narrow_tree_budget or policy.deep_tree_budget:  # a tree is never deeper than its budget
            b = policy.budget_at(steps, len(steps))
            chain = StepBudgets.from_config(policy).is_chain(b)  # (deepest: that chain's depth)
            shape = replace(policy, tree_budget=0 if chain else b, narrow_tree_budget=0, deep_tree_budget=0,
                            deep_tree_chain=False, lookup_depth=0 if chain else policy.lookup_depth)
        accepted = accepted_length(lead, all_tokens[a - start], all_probs[a - start], policy.gate, shape,
                                   seq[a + 1:a + 1 + deepest])
        step = min(accepted + 1, end - a)
        steps.append(step)
        a += step
    return steps


@dataclass(frozen=True)
class PolicyResult:
    policy: LookupPolicy
    tokens_per_step: dict[str, float]  # by request key

    def overall(self) -> float:
        """Geometric mean over requests (the bench's aggregate for speedups; per request, steps cost alike)."""
        return geomean(self.tokens_per_step.values(), empty=float("nan"))

    def mean(self) -> float:
        """Arithmetic mean over requests (the bench's tokens/step column)."""
        v = list(self.tokens_per_step.values())
        return sum(v) / len(v) if v else float("nan")

    def by_benchmark(self, refs: list[Reference]) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for r in refs:
            if r.key in self.tokens_per_step:
                groups.setdefault(r.benchmark, []).append(self.tokens_per_step[r.key])
        return {b: geomean(v, empty=float("nan")) for b, v in sorted(groups.items())}


def replay_all(refs: list[Reference], cands: list[AnchorCandidates], policies: list[LookupPolicy]
               ) -> list[PolicyResult]:
    """Every policy over every reference that has a verify step (an output of one token has none)."""
    out = []
    for policy in policies:
        per = {}
        for ref, c in zip(refs, cands):
            steps = replay(ref, c, policy)
            if steps:
                per[ref.key] = sum(steps) / len(steps)
        out.append(PolicyResult(policy, per))
    return out


def replay_speedup(refs: list[Reference], cands: list[AnchorCandidates], policy: LookupPolicy, ar_ms: float,
                   step_ms: dict[int, float]) -> tuple[float, float]:
    """(geometric-mean speedup, mean tokens a step) of `policy` over the references at fixed step costs: per request
    AR's ms/token x its tokens / its steps' summed costs, each step priced by its tree budget (step_ms[budget]; a
    chain's budget is 0), as scripts/replay_*.py price a switched tree with a device's measured step times."""
    speedups, per_step = [], []
    for ref, c in zip(refs, cands):
        steps = replay(ref, c, policy)
        if steps:
            speedups.append(sum(steps) * ar_ms / sum(step_ms[policy.budget_at(steps, j)] for j in range(len(steps))))
            per_step.append(sum(steps) / len(steps))
    return geomean(speedups, empty=float("nan")), sum(per_step) / len(per_step) if per_step else float("nan")


def load_references(path: Path) -> list[Reference]:
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            d = json.loads(line)
            out.append(Reference(d["key"], d["benchmark"], tuple(d["prompt"]), tuple(d["output"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a reference record ({e})") from None
    return out


def record_references(generate: Callable[[list[int]], list[int]], prompts: list[tuple[str, str, tuple[int, ...]]],
                      path: Path, progress: bool = True) -> list[Reference]:
    """The greedy outputs of (key, benchmark, prompt ids) by `generate`, appended to path as JSON lines one request
    at a time (a stopped run resumes where it was; records of other prompts or other prompt ids are refused)."""
    have = {r.key: r for r in load_references(path)}
    for key, _, ids in prompts:
        if key in have and have[key].prompt != tuple(ids):
            raise ValueError(f"{path}: {key} was recorded for other prompt ids (another tokenizer or template?)")
    todo = [p for p in prompts if p[0] not in have]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for key, bench, ids in tqdm(todo, desc="AR references", unit="req", disable=not progress or not todo):
            out = generate(list(ids))
            rec = {"key": key, "benchmark": bench, "prompt": list(ids), "output": out}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            have[key] = Reference(key, bench, tuple(ids), tuple(out))
    return [have[key] for key, _, _ in prompts]
