"""The batch regime's measurements: builds served by the batched engine at the deployment's concurrencies.

BatchBench runs named builds (Candidates with a BatchConfig) through bench.batched.run_concurrency_bench, one
concurrency level at a time under the deployment's arrival process, next to batched AR. Builds that share the
runner (dtype, kernels, kernel table, CUDA graphs, paging: one runner serves one such setting) run in one group
on one shared runner; a build with other runner settings runs in a group of its own beside an AR of its settings.
Every speedup is over the deployment's own batched AR (the first group's), at the same concurrency, so a kernel
table that speeds up AR too still shows. Poisson arrivals without a rate take the first group's rate (Little's
law under AR) at each level, so every group sees the same arrivals. The cost curve the mechanisms price verify
tokens with is measured once, on the first runner that needs it, and reused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specpilot.bench.batched import AR_LABEL, BatchVariant, ConcurrencyRow, run_concurrency_bench
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.deployments import Arrival
from specpilot.engines.batch import BatchConfig, CostCurve
from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig, KernelBackend, VerifyMode
from specpilot.stages.batch_catalog import stock_batch
from specpilot.stages.candidate import Candidate

# What one runner serves (run_concurrency_bench refuses variants that differ from AR in these), and the BatchConfig
# fields that size it.
RUNNER_FIELDS = ("dtype", "max_seq_len", "kernel_table", "weight_format", "cuda_graphs", "kernel_backend")
SIZING_FIELDS = ("prefill_chunk", "graph_max_tokens", "num_pages")


def unservable(c: Candidate) -> str:
    """Why the batched engine cannot serve `c` ('' when it can), checked before a run so one bad candidate
    cannot stop the builds that share its runner."""
    cfg = c.config
    if c.batch_config is None:
        return "no BatchConfig: a batch-regime build is served by the batched engine"
    if c.policy is not None:
        return "the batched engine runs no policy code"
    if cfg.drafter not in (DrafterKind.NGRAM, DrafterKind.NONE):
        return f"the batched engine drafts by n-gram lookup only, not {cfg.drafter.value}"
    if cfg.verify is not VerifyMode.CHAIN:
        return f"the batched engine verifies chains only, not {cfg.verify.value}"
    if cfg.kernel_backend is not KernelBackend.TRITON:
        return "the batched engine runs the batch-invariant Triton kernels (kernel_backend=triton)"
    return ""


def _runner_key(cfg: EngineConfig, batch) -> tuple:
    return tuple(getattr(cfg, f) for f in RUNNER_FIELDS), tuple(getattr(batch, f) for f in SIZING_FIELDS)


@dataclass(frozen=True)
class LevelRun:
    """One build at one concurrency."""

    concurrency: int
    throughput: float  # new tokens per second, first arrival to last token
    tokens_per_step: float
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    rate: float | None  # poisson arrivals per second
    matches_ar: bool  # every request's tokens equal the batched AR of its runner
    outputs: dict[str, list[int]] = field(default_factory=dict, compare=False)  # "<prompt key>#<n>" -> tokens


@dataclass
class Throughputs:
    """A BatchBench measurement: label -> its levels (AR_LABEL: the deployment's batched AR), or why it did not run."""

    levels: dict[str, dict[int, LevelRun]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def speedup(self, label: str, over: str = AR_LABEL) -> dict[int, float]:
        """Per concurrency: the label's throughput over `over`'s."""
        mine, theirs = self.levels[label], self.levels[over]
        return {c: mine[c].throughput / max(theirs[c].throughput, 1e-12) for c in mine}

    def matches(self, label: str) -> bool:
        return label in self.levels and all(run.matches_ar for run in self.levels[label].values())


class BatchBench:
    def __init__(self, session: DeploymentSession):
        dep = session.deployment
        if not dep.batched:
            raise ValueError(f"deployment {dep.name} is not in the batch regime")
        self.session, self.regime = session, dep.regime
        self.ar, self.sizing = dep.ar_config(), stock_batch(dep)
        self.cost_curve: CostCurve | None = None

    def measure(self, prompts: Sequence[TokenizedPrompt], max_new_tokens: int,
                builds: dict[str, Candidate]) -> Throughputs:
        """Every servable build at every concurrency; AR_LABEL is the deployment's batched AR."""
        if AR_LABEL in builds:
            raise ValueError(f"{AR_LABEL!r} names the batched AR baseline: pick another label")
        out = Throughputs({AR_LABEL: {}})
        for label, c in builds.items():
            if (why := unservable(c)):
                out.errors[label] = why
        groups: dict[tuple, dict[str, Candidate]] = {}
        for label, c in builds.items():
            if label not in out.errors:
                groups.setdefault(_runner_key(c.config, c.batch_config), {})[label] = c
        main = _runner_key(self.ar, self.sizing)  # the deployment's AR runs first, in the group sharing its runner
        order = [main] + [key for key in groups if key != main]
        pairs = [(tp.key, tp.ids) for tp in prompts]
        for conc in self.regime.concurrency:
            rate = self.regime.rate
            for i, key in enumerate(order):
                members = groups.get(key, {})
                first = next(iter(members.values()), None)
                ar_cfg = self.ar if first is None else self.ar.replace(**{f: getattr(first.config, f)
                                                                          for f in RUNNER_FIELDS})
                sizing = self.sizing if first is None else first.batch_config
                runs, rate = self._group(pairs, max_new_tokens, conc, rate, ar_cfg, sizing, members, out.errors,
                                         main=i == 0)
                ar_run = runs.pop(AR_LABEL, None)
                if i == 0:
                    out.levels[AR_LABEL][conc] = ar_run
                for label, run in runs.items():
                    out.levels.setdefault(label, {})[conc] = run
        return out

    def _group(self, pairs, max_new_tokens: int, conc: int, rate: float | None, ar_cfg: EngineConfig,
               sizing: BatchConfig, members: dict[str, Candidate], errors: dict[str, str],
               main: bool) -> tuple[dict[str, LevelRun], float | None]:
        """AR and `members` on one runner at one concurrency; if that fails, each member alone beside AR, so a
        build that cannot run is reported without taking the others down. The main group's AR (the deployment's
        own) must run; another group's AR only serves its members."""
        ar = BatchVariant(AR_LABEL, ar_cfg.replace(drafter=DrafterKind.NONE), sizing)
        variants = [ar] + [BatchVariant(label, c.config, c.batch_config) for label, c in members.items()]
        try:
            return self._run(pairs, max_new_tokens, conc, rate, variants)
        except (ConfigError, ValueError, RuntimeError) as e:
            if not members:
                raise
            if len(members) == 1:
                errors[variants[1].label] = f"{type(e).__name__}: {e}"
                return self._run(pairs, max_new_tokens, conc, rate, [ar]) if main else ({}, rate)
        runs: dict[str, LevelRun] = {}
        for label, c in members.items():
            got, rate = self._group(pairs, max_new_tokens, conc, rate, ar_cfg, sizing, {label: c}, errors, main)
            runs.update(got)
        return runs, rate

    def _run(self, pairs, max_new_tokens: int, conc: int, rate: float | None,
             variants: list[BatchVariant]) -> tuple[dict[str, LevelRun], float | None]:
        s = self.session
        report = run_concurrency_bench(s.target, s.eos, pairs, max_new_tokens, [conc], [self.regime.arrival], variants,
                                       s.device, requests=max(conc, len(pairs)), rate=rate, cost_curve=self.cost_curve,
                                       cost_repeats=2)
        if report.cost_curve and self.cost_curve is None:
            self.cost_curve = CostCurve(report.cost_curve)
        runs = {row.variant: _level(row, report.outputs[f"{conc}/{row.arrival}/{row.variant}"]) for row in report.rows}
        poisson = self.regime.arrival is Arrival.POISSON
        return runs, (report.rows[0].rate if poisson and rate is None else rate)


def _level(row: ConcurrencyRow, outputs: dict[str, list[int]]) -> LevelRun:
    return LevelRun(row.concurrency, row.throughput, row.tokens_per_step, row.tpot_p50_ms, row.tpot_p99_ms, row.rate,
                    row.matches_ar, outputs)
