"""The tune report: per round the three factors, what was tried and validated; the final build's held-out speedups."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from specpilot.bench.harness import CI_LEVEL


@dataclass(frozen=True)
class RoundReport:
    round: int
    direction: str
    tau_gap: float  # 1 / tau: how many more tokens per step the best tree shape would accept
    kernel: float  # profiled kernel time / roofline ideal
    overhead: float  # wall step time / kernel time
    total_gap: float
    widened: bool  # the direction's own mechanisms were too few: every applicable mechanism was searched
    memory_first: tuple[str, ...]  # memory's candidates, measured before any search trial
    tried: int  # candidates quick-benchmarked (memory + search)
    validated: int  # passed token forcing and beat stock on held-out prompts
    rejected: int  # failed or tied token forcing, or not faster
    build: str  # the build after this round's integration
    build_vs_stock: float
    build_vs_ar: float
    decisions: tuple[str, ...]


@dataclass(frozen=True)
class TuneReport:
    deployment: str
    run_id: str
    device: str
    store: str
    settings: dict[str, Any]
    rounds: tuple[RoundReport, ...]
    final_build: str
    final_is_stock: bool
    final_mechanisms: tuple[str, ...]
    final_vs_stock: float
    final_vs_ar: float
    stock_vs_ar: float
    heldout_prompts: int
    heldout_max_new_tokens: int
    build_uri: str
    final_vs_stock_interval: tuple[float, float] | None = None  # its paired bootstrap interval (CI_LEVEL)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rounds": [asdict(r) for r in self.rounds]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneReport":
        rounds = tuple(RoundReport(**{**r, "memory_first": tuple(r["memory_first"]), "decisions": tuple(r["decisions"])})
                       for r in d["rounds"])
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "rounds": rounds,
                      "final_mechanisms": tuple(d["final_mechanisms"])})

    def _interval(self) -> str:
        if not self.final_vs_stock_interval:
            return ""
        lo, hi = self.final_vs_stock_interval
        return f" ({CI_LEVEL:.0%} paired interval {lo:.3f}-{hi:.3f}x)"

    def table(self) -> str:
        lines = [f"## Tune of {self.deployment} (run {self.run_id}) on {self.device}", "",
                 "| round | direction | tau gap (1/tau) | kernel factor | overhead factor | total gap | tried | "
                 "memory-first | validated | rejected | build | vs stock | vs AR |",
                 "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
        for r in self.rounds:
            memory = ", ".join(r.memory_first) or "-"
            lines.append(f"| {r.round} | {r.direction}{' (widened)' if r.widened else ''} | {r.tau_gap:.2f}x | "
                         f"{r.kernel:.2f}x | {r.overhead:.2f}x | {r.total_gap:.2f}x | {r.tried} | {memory} | "
                         f"{r.validated} | {r.rejected} | {r.build} | {r.build_vs_stock:.3f}x | {r.build_vs_ar:.3f}x |")
        verdict = ("no candidate beat stock on the held-out prompts: the final build IS stock" if self.final_is_stock
                   else f"final build {self.final_build} ({', '.join(self.final_mechanisms) or 'no mechanisms'})")
        lines += ["", f"**{verdict}.** Held-out ({self.heldout_prompts} prompts of the validate split, "
                      f"{self.heldout_max_new_tokens} new tokens, greedy): final vs stock "
                      f"**{self.final_vs_stock:.3f}x**{self._interval()}, "
                      f"final vs AR **{self.final_vs_ar:.3f}x** (stock vs AR {self.stock_vs_ar:.3f}x).",
                  f"Build: {self.build_uri}", ""]
        for r in self.rounds:
            lines += [f"Round {r.round} decisions:"] + [f"- {d}" for d in r.decisions]
        return "\n".join(lines)
