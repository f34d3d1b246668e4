"""Token forcing: prove a candidate build lossless against the stock build on held-out prompts.

Both builds run in the same call on prompts the candidate has never seen. (1) Free-running: the candidate's
output must equal stock's token for token. (2) Forced: the candidate's target (its config and its weight
transform) is fed the stock sequence in its own verify shape and its argmax at every position is compared
with the stock token, so one early flip cannot hide later ones. Every position's top1-top2 logit margin is
logged for both builds; a flip where both builds see the same two tokens within `tie_epsilon` is a
numerical TIE, never a silent PASS. Suspiciously large speedups are measured a second time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, Sequence

from tqdm import tqdm

from specpilot.bench.session import TokenizedPrompt
from specpilot.engines.config import EngineConfig
from specpilot.engines.engine import GenerationResult, SpecEngine
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.runner import chain_anc
from specpilot.engines.target_runner import TargetRunner, fresh_runner
from specpilot.stages.candidate import Candidate
from specpilot.stats import geomean

DECODE_FLOOR_S = 1e-6  # a response served without decoding (0 s) still gets a finite, huge speedup


class EngineFactory(Protocol):
    """What validate needs from a deployment session: engines over one shared, already loaded target."""

    def engine(self, cfg: EngineConfig, drafter_label: str | None = None, policy: EnginePolicy = STOCK) -> SpecEngine: ...


class VerdictKind(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    TIE = "tie"  # every divergence is a near-tie within tie_epsilon: not proven lossless, not proven lossy


class DivergenceKind(str, Enum):
    FREE_RUNNING = "free_running"  # the candidate's own output differs from stock's (first index per prompt)
    RERUN = "rerun"  # the candidate's re-measured output differs from stock's
    FORCED = "forced"  # fed the stock sequence, the candidate's argmax differs from the stock token
    REFERENCE = "reference"  # stock's own forced pass disagrees with stock's output: the reference is unstable


@dataclass(frozen=True)
class Divergence:
    kind: DivergenceKind
    prompt: str
    index: int  # output token index (0 = the first generated token)
    stock_token: int | None  # None: that output ended before this index
    candidate_token: int | None
    stock_margin: float | None = None  # top1 - top2 logit of the stock forced pass here
    candidate_margin: float | None = None
    stock_runner_up: int | None = None
    candidate_runner_up: int | None = None
    tie: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Divergence":
        return cls(**{**d, "kind": DivergenceKind(d["kind"])})


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    prompt_tokens: int
    stock_tokens: int
    candidate_tokens: int
    stock_stop: str
    candidate_stop: str
    first_divergence: int | None  # free-running
    forced_flips: int
    ties: int
    min_stock_margin: float  # the closest call the reference itself made on this prompt
    speedup: float  # stock decode time / candidate decode time


@dataclass(frozen=True)
class PromptMargins:
    prompt: str
    stock: tuple[float, ...]  # per output position, from the forced passes
    candidate: tuple[float, ...]


@dataclass(frozen=True)
class SpeedupCheck:
    threshold: float
    first: tuple[float, ...]  # per prompt
    remeasured: tuple[float, ...] | None = None  # present when the first geomean exceeded the threshold

    @property
    def geomean(self) -> float:
        return geomean(self.first)

    @property
    def remeasured_geomean(self) -> float | None:
        return None if self.remeasured is None else geomean(self.remeasured)


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    stock: str
    candidate: str
    tie_epsilon: float
    max_new_tokens: int
    prompts: tuple[PromptRow, ...]
    divergences: tuple[Divergence, ...]  # first free-running/rerun per prompt, every forced/reference flip
    margins: tuple[PromptMargins, ...]
    speedup: SpeedupCheck
    reasons: tuple[str, ...]
    forced_by: str = ""  # the runner class of the forced passes (ModelRunner, HybridRunner: the target's family)

    @property
    def ties(self) -> tuple[Divergence, ...]:
        return tuple(d for d in self.divergences if d.tie and d.kind in (DivergenceKind.FORCED, DivergenceKind.REFERENCE))

    @property
    def forced_flips(self) -> int:
        return sum(d.kind is DivergenceKind.FORCED for d in self.divergences)

    @property
    def first_divergence(self) -> Divergence | None:
        """The first output mismatch (prompt order); else the first flip outside epsilon; else the first tie."""
        order = (lambda d: d.kind in (DivergenceKind.FREE_RUNNING, DivergenceKind.RERUN), lambda d: not d.tie,
                 lambda d: True)
        return next((d for pick in order for d in self.divergences if pick(d)), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"kind": self.kind.value, "stock": self.stock, "candidate": self.candidate,
                "tie_epsilon": self.tie_epsilon, "max_new_tokens": self.max_new_tokens,
                "counts": {"prompts": len(self.prompts), "diverged_prompts": sum(p.first_divergence is not None for p in self.prompts),
                           "forced_flips": self.forced_flips, "ties": len(self.ties)},
                "first_divergence": first.to_dict() if first else None,
                "prompts": [{f.name: getattr(p, f.name) for f in fields(p)} for p in self.prompts],
                "divergences": [d.to_dict() for d in self.divergences],
                "margins": [{"prompt": m.prompt, "stock": list(m.stock), "candidate": list(m.candidate)} for m in self.margins],
                "speedup": {"threshold": self.speedup.threshold, "first": list(self.speedup.first),
                            "remeasured": None if self.speedup.remeasured is None else list(self.speedup.remeasured),
                            "geomean": self.speedup.geomean, "remeasured_geomean": self.speedup.remeasured_geomean},
                "reasons": list(self.reasons), "forced_by": self.forced_by}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Verdict":
        s = d["speedup"]
        return cls(VerdictKind(d["kind"]), d["stock"], d["candidate"], d["tie_epsilon"], d["max_new_tokens"],
                   tuple(PromptRow(**p) for p in d["prompts"]), tuple(Divergence.from_dict(x) for x in d["divergences"]),
                   tuple(PromptMargins(m["prompt"], tuple(m["stock"]), tuple(m["candidate"])) for m in d["margins"]),
                   SpeedupCheck(s["threshold"], tuple(s["first"]), None if s["remeasured"] is None else tuple(s["remeasured"])),
                   tuple(d["reasons"]), d.get("forced_by", ""))


def write_verdict(verdict: Verdict, out_dir: str | Path) -> Path:
    """verdict.json (all but the per-position margins), ties.jsonl (the tie log), margins.jsonl (one line per prompt)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    body = verdict.to_dict()
    margins = body.pop("margins")
    (out / "verdict.json").write_text(json.dumps(body, indent=2))
    (out / "ties.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in verdict.ties))
    (out / "margins.jsonl").write_text("".join(json.dumps(m) + "\n" for m in margins))
    return out / "verdict.json"


def read_verdict(out_dir: str | Path) -> Verdict:
    out = Path(out_dir)
    body = json.loads((out / "verdict.json").read_text())
    body["margins"] = [json.loads(line) for line in (out / "margins.jsonl").read_text().splitlines() if line]
    return Verdict.from_dict(body)


@dataclass(frozen=True)
class ForcedPass:
    argmax: tuple[int, ...]  # per output position: the model's greedy token given the stock prefix
    runner_up: tuple[int, ...]
    margin: tuple[float, ...]


def forced_runner(engine: SpecEngine) -> TargetRunner:
    """A runner of the engine's kind (either family) over its target's own (transformed) weights, config and verify
    width, plus each position's runner-up token, with caches of its own so the engine's stay untouched."""
    return fresh_runner(engine.target, topk=2)


def forced_pass(runner: TargetRunner, prompt: Sequence[int], output: Sequence[int], max_new_tokens: int) -> ForcedPass:
    """Feeds prompt + output in the runner's verify shape: a prefill, then chain blocks of its verify width, each
    committed whole (a no-op for a KV cache; a recurrent target's state advances through it).
    max_new_tokens: the request's limit, which sizes its attention view exactly as generate() did."""
    runner.begin_request(len(prompt) + max_new_tokens)
    first = runner.prefill(list(prompt))  # the same prefill the engine runs: one forward over the prompt
    argmax, runner_up, margin = list(first.argmax), [first.topk_tokens[0][1]], first.margin.tolist()
    feed = list(output[:-1])  # the last output token predicts nothing that stock produced
    for s in range(0, len(feed), runner.block_width):
        chunk = feed[s:s + runner.block_width]
        out = runner.verify(len(prompt) + s, chunk, list(range(len(chunk))), chain_anc(len(chunk)))
        runner.compact(len(prompt) + s, list(range(len(chunk))))
        argmax += out.argmax
        runner_up += [t[1] for t in out.topk_tokens]
        margin += out.margin.tolist()
    return ForcedPass(tuple(argmax), tuple(runner_up), tuple(margin))


def validate(factory: EngineFactory, stock: Candidate, candidate: Candidate, prompts: Sequence[TokenizedPrompt],
             max_new_tokens: int, tie_epsilon: float, *, candidate_policy: EnginePolicy | None = None,
             speedup_threshold: float = 20.0) -> Verdict:
    """Token forcing of `candidate` against `stock` on held-out `prompts`. `candidate_policy` is the loaded
    policy instance to validate (default: a fresh `candidate.load_policy()`), e.g. the explorer's own instance."""
    if not prompts:
        raise ValueError("validate needs at least one held-out prompt")
    if tie_epsilon < 0 or max_new_tokens < 1:
        raise ValueError(f"tie_epsilon={tie_epsilon} must be >= 0 and max_new_tokens={max_new_tokens} >= 1")
    stock_engine = factory.engine(stock.config, stock.drafter_label, stock.load_policy())
    cand_engine = factory.engine(candidate.config, candidate.drafter_label,
                                 candidate_policy if candidate_policy is not None else candidate.load_policy())
    for engine in (stock_engine, cand_engine):  # warm-up: one-time costs (graph capture, allocation) stay out of timing
        engine.warm_up(list(prompts[0].ids), min(2, max_new_tokens))
    # one unit a prompt and pass: free-running pairs, the forced passes, and the re-measurement when there is one
    bar = tqdm(total=2 * len(prompts), desc=f"validate {candidate.name}", unit="prompt")
    runs = _run_pairs(stock_engine, cand_engine, prompts, max_new_tokens, bar)
    check = SpeedupCheck(speedup_threshold, tuple(_speedup(s, c) for s, c in runs))
    reruns = None  # suspiciously fast (a cache, a skipped check?): measure again, report both, check outputs again
    if check.geomean > speedup_threshold:
        bar.total += len(prompts)
        reruns = _run_pairs(stock_engine, cand_engine, prompts, max_new_tokens, bar)
        check = SpeedupCheck(speedup_threshold, check.first, tuple(_speedup(s, c) for s, c in reruns))
    ref_runner, cand_runner = forced_runner(stock_engine), forced_runner(cand_engine)
    rows, divergences, margins = [], [], []
    for i, (p, (s_run, c_run)) in enumerate(zip(prompts, runs)):
        ref = forced_pass(ref_runner, p.ids, s_run.tokens, max_new_tokens)
        cand = forced_pass(cand_runner, p.ids, s_run.tokens, max_new_tokens)
        flips = _forced_flips(p.key, s_run.tokens, ref, cand, tie_epsilon)
        tie_at = {d.index for d in flips if d.tie}
        free = _first_mismatch(DivergenceKind.FREE_RUNNING, p.key, s_run.tokens, c_run.tokens, tie_at)
        rerun = None if reruns is None else _first_mismatch(DivergenceKind.RERUN, p.key, s_run.tokens,
                                                            reruns[i][1].tokens, tie_at)
        divergences += [d for d in (free, rerun) if d is not None] + flips
        margins.append(PromptMargins(p.key, ref.margin, cand.margin))
        rows.append(PromptRow(p.key, len(p.ids), len(s_run.tokens), len(c_run.tokens), s_run.stop_reason,
                              c_run.stop_reason, None if free is None else free.index,
                              sum(d.kind is DivergenceKind.FORCED for d in flips), len(tie_at), min(ref.margin), check.first[i]))
        bar.update()
    bar.close()
    return Verdict(_classify(divergences), stock.name, candidate.name, tie_epsilon, max_new_tokens, tuple(rows),
                   tuple(divergences), tuple(margins), check, _reasons(divergences, check, tie_epsilon),
                   type(ref_runner).__name__)


def _run_pairs(stock: SpecEngine, cand: SpecEngine, prompts: Sequence[TokenizedPrompt],
               max_new_tokens: int, bar: tqdm) -> list[tuple[GenerationResult, GenerationResult]]:
    # Interleaved per prompt: each speedup compares the same request in the same run on the same machine.
    pairs = []
    for p in prompts:
        pairs.append((stock.generate(list(p.ids), max_new_tokens, p.key),
                      cand.generate(list(p.ids), max_new_tokens, p.key)))
        bar.update()
    return pairs


def _speedup(stock: GenerationResult, cand: GenerationResult) -> float:
    return max(stock.decode_s, DECODE_FLOOR_S) / max(cand.decode_s, DECODE_FLOOR_S)


def _first_mismatch(kind: DivergenceKind, prompt: str, stock: list[int], cand: list[int],
                    tie_at: set[int]) -> Divergence | None:
    i = next((j for j, (a, b) in enumerate(zip(stock, cand)) if a != b), min(len(stock), len(cand)))
    if i == len(stock) == len(cand):
        return None
    # A forced-mode tie at this very index explains the mismatch (both contexts agree up to it).
    return Divergence(kind, prompt, i, stock[i] if i < len(stock) else None, cand[i] if i < len(cand) else None,
                      tie=i in tie_at)


def _forced_flips(prompt: str, stock_out: list[int], ref: ForcedPass, cand: ForcedPass, eps: float) -> list[Divergence]:
    out = []
    for i, want in enumerate(stock_out):
        if ref.argmax[i] != want:  # stock's forced pass itself disagrees: a tie only if stock saw a near-tie
            out.append(Divergence(DivergenceKind.REFERENCE, prompt, i, want, ref.argmax[i], ref.margin[i], None,
                                  ref.runner_up[i], None, tie=ref.margin[i] <= eps and ref.runner_up[i] == want))
        elif cand.argmax[i] != want:
            # A tie: both builds rank the same two tokens first and second, each within epsilon of the other.
            tie = (cand.runner_up[i] == want and ref.runner_up[i] == cand.argmax[i]
                   and ref.margin[i] <= eps and cand.margin[i] <= eps)
            out.append(Divergence(DivergenceKind.FORCED, prompt, i, want, cand.argmax[i], ref.margin[i], cand.margin[i],
                                  ref.runner_up[i], cand.runner_up[i], tie))
    return out


def _classify(divergences: list[Divergence]) -> VerdictKind:
    if any(not d.tie for d in divergences):
        return VerdictKind.FAIL
    return VerdictKind.TIE if divergences else VerdictKind.PASS


def _reasons(divergences: list[Divergence], check: SpeedupCheck, eps: float) -> tuple[str, ...]:
    reasons = [f"{d.prompt}: {d.kind.value} output differs from token {d.index} (stock {d.stock_token}, "
               f"candidate {d.candidate_token}){' at a numerical tie' if d.tie else ''}"
               for d in divergences if d.kind in (DivergenceKind.FREE_RUNNING, DivergenceKind.RERUN)]
    for kind in (DivergenceKind.FORCED, DivergenceKind.REFERENCE):
        for tie, where in ((False, "outside"), (True, "within")):
            if n := sum(d.kind is kind and d.tie is tie for d in divergences):
                reasons.append(f"{n} {kind.value} flip(s) {where} tie_epsilon={eps}{': numerical ties' if tie else ''}")
    if check.remeasured is not None:
        reasons.append(f"speedup {check.geomean:.3g}x exceeds {check.threshold:g}x; re-measured: {check.remeasured_geomean:.3g}x")
    return tuple(reasons)
