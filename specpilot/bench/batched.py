"""`specpilot bench --concurrency 16,20,24`: batched serving, AR vs speculative decoding at equal concurrency.

Per (concurrency, arrival process, variant): throughput (new tokens / wall time from the first arrival to the
last token), TPOT p50/p99 over requests, tokens per step, and speedup over AR at the same concurrency and
arrivals (AR batched by the same engine: drafter none). Variants: AR, stock batched speculative decoding
(the deployment's n-gram drafter at its default draft length), each batching mechanism alone, and all
together. Every variant's tokens must equal AR's for every request (and single-request outputs, when given).

Arrival processes: `all` (every request at t=0; the scheduler keeps `concurrency` of them running) and
`poisson` (exponential inter-arrival times at `rate` requests/s; by default the rate that keeps
`concurrency` requests in flight under AR by Little's law: concurrency / mean AR latency at t=0 arrivals).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from specpilot.deployments.spec import Arrival  # a deployment's batch regime names its arrival process
from specpilot.engines.batch import (MECHANISMS, BatchBlockDrafter, BatchConfig, BatchEngine, BatchNgramDrafter,
                                     BatchRunner, CostCurve, DevicePolicy, RequestSpec, block_width,
                                     measure_cost_curve)
from specpilot.engines.batch.config import longest_draft, mechanism_fields
from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig, KernelBackend
from specpilot.engines.drafters.block import BlockDrafterModel
from specpilot.engines.llama import LlamaModel

AR_LABEL, STOCK_LABEL, ALL_LABEL = "ar", "stock", "all"


@dataclass(frozen=True)
class BatchVariant:
    label: str
    engine: EngineConfig
    batch: BatchConfig


def standard_variants(ar_cfg: EngineConfig, spec_cfg: EngineConfig,
                      mechanisms: Sequence[str] = (*MECHANISMS, ALL_LABEL),
                      batch: BatchConfig = BatchConfig()) -> list[BatchVariant]:
    """AR, stock speculative decoding, then one variant per mechanism name (a MECHANISMS key, 'all', or keys joined
    by '+'). `batch` is every variant's config (sizing, and the mechanisms' own knobs such as max_draft_len); a
    mechanism variant turns its mechanisms on in it, AR and stock keep it as given (every mechanism off)."""
    if batch.mechanisms:
        raise ValueError(f"the base batch config turns on {batch.mechanisms}: stock must have every mechanism off")
    out = [BatchVariant(AR_LABEL, ar_cfg.replace(drafter=DrafterKind.NONE), batch),
           BatchVariant(STOCK_LABEL, spec_cfg, batch)]
    return out + [BatchVariant(name, spec_cfg, batch.replace(**mechanism_fields(*name.split("+"))))
                  for name in mechanisms]


def block_variants(ar_cfg: EngineConfig, block_size: int, batch: BatchConfig = BatchConfig()) -> list[BatchVariant]:
    """The batched block drafter (engines.batch.block_drafting): its top-1 chain at the block's depth, led by
    prompt lookup (ngram_prefix), that with goodput draft lengths (mechanism a), and with the verify budget too
    (mechanism b; c, drafting ahead from the lookup, does not apply: the block drafts after the verify)."""
    cfg = ar_cfg.replace(drafter=DrafterKind.BLOCK, block_size=block_size)
    lookup = cfg.replace(ngram_prefix=True)
    return [BatchVariant("block", cfg, batch), BatchVariant("block+lookup", lookup, batch),
            BatchVariant("block+lookup+goodput", lookup, batch.replace(**mechanism_fields("goodput_draft"))),
            BatchVariant("block+lookup+goodput+budget", lookup,
                         batch.replace(**mechanism_fields("goodput_draft", "verify_budget")))]


@dataclass
class ConcurrencyRow:
    concurrency: int
    arrival: str
    variant: str
    requests: int
    new_tokens: int
    wall_s: float
    throughput: float  # new tokens per second
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tokens_per_step: float  # committed tokens per decode step of a request
    rate: float | None  # poisson arrivals per second
    ahead_hit_rate: float | None  # overlap_draft: guesses that came true
    step_ms: float = 0.0  # mean wall time of an engine step (host + forward + the step's sync)
    host_ms: float = 0.0  # mean host time of a step outside its wait for the forward (schedule, draft, pack and
    # launch, commit); drafting ahead under overlap_draft runs inside the wait
    forward_tokens: float = 0.0  # mean tokens in a step's forward (verify blocks + prompt chunks)
    decode_rows: float = 0.0  # mean requests verifying per step
    speedup_vs_ar: float | None = None
    speedup_vs_stock: float | None = None
    matches_ar: bool = True
    mismatches: list[str] = field(default_factory=list)  # request ids whose tokens differ from AR (or reference)


@dataclass
class ConcurrencyReport:
    device: str
    max_new_tokens: int
    rows: list[ConcurrencyRow] = field(default_factory=list)
    cost_curve: tuple[tuple[int, float], ...] = ()
    outputs: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # "c/arrival/variant" -> id -> tokens

    def all_match(self) -> bool:
        return all(r.matches_ar for r in self.rows)

    def to_dict(self) -> dict:
        return {"device": self.device, "max_new_tokens": self.max_new_tokens,
                "cost_curve": [list(p) for p in self.cost_curve], "all_match_ar": self.all_match(),
                "rows": [asdict(r) for r in self.rows]}


def _shared_lookups(variants: Sequence[BatchVariant], model: LlamaModel, rows: int, device: str
                    ) -> list[BatchNgramDrafter]:
    """The device lookups the device_draft variants share (their n-gram settings must agree): one per (policy or not:
    goodput / the verify budget on, extrapolating or not) that some variant needs."""
    users = [v for v in variants if v.batch.device_draft and v.engine.speculative]
    if not users:
        return []
    windows = {(v.engine.ngram_min, v.engine.ngram_max) for v in users}
    if len(windows) > 1:
        raise ValueError(f"device_draft variants differ in their n-gram window {sorted(windows)}: they share one "
                         "lookup")
    (lo, hi), = windows
    depth = max(longest_draft(v.engine, v.batch) for v in users)
    seq, vocab = users[0].engine.max_seq_len, model.shape.vocab
    return [BatchNgramDrafter(rows, seq, depth, lo, hi, device, policy=DevicePolicy(rows, depth, device) if p else None,
                              extrapolate=x, vocab=vocab)
            for p, x in sorted({(v.batch.needs_cost_curve, v.batch.extrapolate) for v in users})]


def arrival_times(n: int, kind: Arrival, rate: float | None = None, seed: int = 0) -> list[float]:
    if kind is Arrival.ALL:
        return [0.0] * n
    if not rate or rate <= 0:
        raise ValueError("poisson arrivals need a rate > 0 (requests per second)")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return (np.cumsum(gaps) - gaps[0]).tolist()  # the first request arrives at t=0


def interleave(items: Sequence, group: Callable) -> list:
    """Round-robin over groups (benchmarks) in first-seen order: the first n requests mix every group."""
    by: dict = {}
    for it in items:
        by.setdefault(group(it), []).append(it)
    return [g[i] for i in range(max((len(g) for g in by.values()), default=0)) for g in by.values() if i < len(g)]


def percentile(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def typical_context(prompts: Sequence[tuple[str, Sequence[int]]], max_new_tokens: int) -> int:
    """Keys a verify row attends to on average over a run: mean prompt length plus half the new tokens (a request
    that runs to its limit spends equal time at every length)."""
    return round(sum(len(ids) for _, ids in prompts) / len(prompts)) + max_new_tokens // 2


def run_concurrency_bench(model: LlamaModel, eos: frozenset[int], prompts: Sequence[tuple[str, Sequence[int]]],
                          max_new_tokens: int, concurrencies: Sequence[int], arrivals: Sequence[Arrival],
                          variants: Sequence[BatchVariant], device: str, requests: int | None = None,
                          rate: float | None = None, seed: int = 0, cost_curve: CostCurve | None = None,
                          reference: dict[str, list[int]] | None = None, warmup: bool | None = None,
                          progress: Callable[[str], None] | None = None, emulate_graphs: bool = False,
                          cost_repeats: int = 3, block_drafter: BlockDrafterModel | None = None,
                          cost_context: int | None = None) -> ConcurrencyReport:
    """Runs every variant at every concurrency and arrival process on one shared runner (one paged cache, one
    set of CUDA graphs). reference: prompt key -> single-request output, checked for every request.
    cost_context: the keys each row of the measured cost curve attends to (default: the run's mean context,
    typical_context), since a verify token's cost grows with the keys it reads.
    warmup (default: on CUDA) captures every graph and runs each engine once before anything is timed.
    block_drafter: the model the drafter=block variants draft with (one batched drafter, shared)."""
    if not variants or variants[0].label != AR_LABEL or variants[0].engine.speculative:
        raise ValueError(f"the first variant must be AR, labelled {AR_LABEL!r}")
    if not prompts:
        raise ValueError("no prompts")
    base = variants[0].engine
    shared = ("dtype", "max_seq_len", "kernel_table", "weight_format", "cuda_graphs", "kernel_backend")
    for v in variants:
        if any(getattr(v.engine, k) != getattr(base, k) for k in shared):
            raise ValueError(f"variant {v.label} differs from AR in a runner setting ({', '.join(shared)})")
    uses_block = any(v.engine.drafter is DrafterKind.BLOCK for v in variants)
    if uses_block and block_drafter is None:
        raise ValueError("drafter=block variants need the drafter's model (block_drafter)")
    shapes = {(v.engine.drafter_window, v.engine.drafter_head_rows) for v in variants
              if v.engine.drafter is DrafterKind.BLOCK}
    if len(shapes) > 1:
        raise ValueError(f"block variants differ in (drafter_window, drafter_head_rows) ({sorted(shapes)}): they share "
                         "one drafter here")
    sizing = variants[0].batch.replace(max_batch=max(concurrencies))
    window, head_rows = shapes.pop() if uses_block else (0, 0)
    blocks = (BatchBlockDrafter(block_drafter, model, sizing.max_batch, base.max_seq_len, device,
                                cuda_graphs=base.cuda_graphs, window=window, head_rows=head_rows)
              if uses_block else None)
    lookups = _shared_lookups(variants, model, sizing.max_batch, device)
    runner = BatchRunner(model, base, sizing, device, max(block_width(v.engine, v.batch) for v in variants),
                         emulate_graphs=emulate_graphs, drafters=[d for d in (blocks, *lookups) if d is not None])
    say = progress or (lambda _: None)
    warmup = runner.device.type == "cuda" if warmup is None else warmup
    if warmup:
        say(f"captured {runner.capture_all(draft=bool(runner.drafters))} graphs")
    if cost_curve is None and any(v.batch.needs_cost_curve for v in variants):
        context = typical_context(prompts, max_new_tokens) if cost_context is None else cost_context
        cost_curve = measure_cost_curve(runner, context=context, repeats=cost_repeats)
        say(f"cost curve at {context} keys a row: {cost_curve.points}")
    report = ConcurrencyReport(device, max_new_tokens, cost_curve=cost_curve.points if cost_curve else ())
    for c in concurrencies:
        n = requests or c
        reqs = [(f"{prompts[i % len(prompts)][0]}#{i // len(prompts)}", prompts[i % len(prompts)]) for i in range(n)]
        engines = {v.label: BatchEngine(runner, v.engine, v.batch.replace(max_batch=c), eos, cost_curve=cost_curve,
                                        block_drafter=blocks if v.engine.drafter is DrafterKind.BLOCK else None)
                   for v in variants}
        if warmup:
            for e in engines.values():
                e.run([RequestSpec("warmup", tuple(prompts[0][1]), min(4, max_new_tokens))])
        poisson_rate, ar_at_once = rate, None
        for kind in sorted(arrivals, key=lambda a: a is Arrival.POISSON):  # all-at-once first: it sets the rate
            if kind is Arrival.POISSON and poisson_rate is None:  # Little's law under AR at t=0 arrivals
                ar_at_once = ar_at_once or engines[AR_LABEL].run(_specs(reqs, max_new_tokens, [0.0] * n))
                poisson_rate = c / max(1e-9, float(np.mean([r.latency_s for r in ar_at_once.requests])))
            times = arrival_times(n, kind, poisson_rate, seed)
            rows = {}
            for v in variants:
                res = engines[v.label].run(_specs(reqs, max_new_tokens, times))
                if kind is Arrival.ALL and v.label == AR_LABEL:
                    ar_at_once = res
                outs = {r.id: r.tokens for r in res.requests}
                report.outputs[f"{c}/{kind.value}/{v.label}"] = outs
                rows[v.label] = row = _row(c, kind, v.label, res, poisson_rate if kind is Arrival.POISSON else None)
                ar_outs = report.outputs[f"{c}/{kind.value}/{AR_LABEL}"]
                key_of = dict(reqs)
                row.mismatches = [i for i, toks in outs.items() if toks != ar_outs[i] or (
                    reference is not None and key_of[i][0] in reference and toks != reference[key_of[i][0]])]
                row.matches_ar = not row.mismatches
                row.speedup_vs_ar = row.throughput / rows[AR_LABEL].throughput
                if STOCK_LABEL in rows and v.label != AR_LABEL:
                    row.speedup_vs_stock = row.throughput / rows[STOCK_LABEL].throughput
                report.rows.append(row)
                say(f"c={c} {kind.value:7s} {v.label:14s} {row.throughput:9.1f} tok/s  x{row.speedup_vs_ar:.2f} vs AR"
                    f"  {'ok' if row.matches_ar else 'MISMATCH'}")
    return report


def _specs(reqs, max_new_tokens: int, times: list[float]) -> list[RequestSpec]:
    return [RequestSpec(rid, tuple(ids), max_new_tokens, t) for (rid, (_, ids)), t in zip(reqs, times)]


def _row(c: int, kind: Arrival, label: str, res, rate: float | None) -> ConcurrencyRow:
    tpots = [r.tpot_s * 1e3 for r in res.requests if r.tpot_s is not None]
    steps = sum(r.steps for r in res.requests)
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    return ConcurrencyRow(c, kind.value, label, len(res.requests), res.new_tokens, res.wall_s, res.throughput,
                          percentile(tpots, 50), percentile(tpots, 99),
                          sum(len(r.tokens) - 1 for r in res.requests) / max(1, steps), rate,
                          res.ahead_hits / res.ahead_tried if res.ahead_tried else None,
                          step_ms=mean([s.wall_s for s in res.steps]) * 1e3,
                          host_ms=mean([s.wall_s - s.wait_s for s in res.steps]) * 1e3,
                          forward_tokens=mean([s.tokens for s in res.steps]),
                          decode_rows=mean([s.decode for s in res.steps]))


def format_concurrency_report(report: ConcurrencyReport) -> str:
    lines = [f"batched serving on {report.device}, {report.max_new_tokens} new tokens max per request; speedup = "
             "throughput / AR throughput at the same concurrency and arrivals", "",
             "| conc | arrival | variant | tok/s | TPOT p50 ms | TPOT p99 ms | tok/step | step ms (host) "
             "| forward tokens | vs AR | vs stock | = AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        def f(x, spec):
            return "-" if x is None else format(x, spec)
        lines.append(f"| {r.concurrency} | {r.arrival} | {r.variant} | {r.throughput:.1f} | "
                     f"{f(r.tpot_p50_ms, '.2f')} | {f(r.tpot_p99_ms, '.2f')} | {r.tokens_per_step:.2f} | "
                     f"{r.step_ms:.2f} ({r.host_ms:.2f}) | {r.forward_tokens:.0f} | "
                     f"{f(r.speedup_vs_ar, '.2f')}x | "
                     f"{f(r.speedup_vs_stock, '.2f')}{'' if r.speedup_vs_stock is None else 'x'} | "
                     f"{'yes' if r.matches_ar else 'NO'} |")
    for r in (r for r in report.rows if not r.matches_ar):
        lines.append(f"MISMATCH c={r.concurrency} {r.arrival} {r.variant}: {', '.join(r.mismatches[:8])}")
    return "\n".join(lines)


# ---- the CLI hook (specpilot bench --concurrency ...) -------------------------------------------------------
def add_concurrency_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batched serving (--concurrency)")
    g.add_argument("--concurrency", type=_int_list, default=None,
                   help="comma-separated concurrencies (e.g. 16,20,24): benchmark batched serving instead")
    g.add_argument("--arrival", type=lambda s: [Arrival(x) for x in s.split(",")],
                   default=[Arrival.ALL, Arrival.POISSON], help="arrival processes: all,poisson (default both)")
    g.add_argument("--rate", type=float, default=None,
                   help="poisson arrivals per second (default: Little's law under AR)")
    g.add_argument("--requests", type=int, default=None, help="requests per concurrency (default: the concurrency)")
    g.add_argument("--mechanisms", type=lambda s: [x for x in s.split(",") if x], default=[*MECHANISMS, ALL_LABEL],
                   help=f"variants beyond AR and stock: any of {','.join(MECHANISMS)},{ALL_LABEL}, or several "
                        "joined by + (empty: none)")
    g.add_argument("--cost-curve", default=None,
                   help="JSON [[tokens, seconds], ...] of the target forward (default: measured)")
    g.add_argument("--cost-context", type=int, default=None,
                   help="keys a row attends to when the cost curve is measured (default: mean prompt + half the "
                        "new tokens)")
    g.add_argument("--batch", type=_batch_config, default=BatchConfig(),
                   help="JSON of BatchConfig fields for every variant, e.g. '{\"max_draft_len\": 32, "
                        "\"graph_max_tokens\": 1024}' (the mechanisms are turned on per variant; max_batch is each "
                        "concurrency, the cost curve comes from --cost-curve or is measured)")


def _batch_config(text: str) -> BatchConfig:
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        return BatchConfig.from_dict(fields)
    except (ValueError, TypeError, ConfigError) as e:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"--batch {text!r}: {e}") from None


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def bench_concurrency(args: argparse.Namespace, session, prompts, max_new_tokens: int) -> int:
    """`specpilot bench --concurrency`: the deployment's AR and n-gram configs on the batched engine."""
    dep = session.deployment
    ar = dep.ar_config().replace(kernel_backend=KernelBackend.TRITON)
    ngram = next((c for c in dep.drafter_configs().values() if c.drafter is DrafterKind.NGRAM),
                 ar.replace(drafter=DrafterKind.NGRAM))
    variants = standard_variants(  # ConfigError for an unknown mechanism name, before anything runs
        ar, ngram.replace(kernel_backend=KernelBackend.TRITON), args.mechanisms, args.batch)
    curve = CostCurve(tuple((int(n), float(s)) for n, s in json.loads(Path(args.cost_curve).read_text()))) \
        if args.cost_curve else None
    with torch.no_grad():
        mixed = interleave(prompts, lambda tp: tp.key.split("/")[0])  # any first n requests mix the benchmarks
        report = run_concurrency_bench(session.target, session.eos, [(tp.key, tp.ids) for tp in mixed],
                                       max_new_tokens, args.concurrency, args.arrival, variants, session.device,
                                       requests=args.requests, rate=args.rate, cost_curve=curve,
                                       progress=None if args.json else print, cost_context=args.cost_context)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_concurrency.json").write_text(json.dumps(report.to_dict(), indent=1))
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_concurrency_report(report))
    return 0 if report.all_match() else 3
