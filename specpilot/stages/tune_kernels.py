"""tune_kernels: search the launch parameters of the kernels furthest from their bound, per shape and token count.

1. Selection: op classes above their roofline ideal (attribution.kernel.op_gaps), by excess time (what tuning can
   win back per step: a 10x-slow 2 us kernel matters less than a 2x-slow GEMM), ratio breaking ties, mapped to
   SpecPilot's kernels (NORM runs fused inside qkv and gate_up).
2. Batch invariance: fields outside a kernel's T_NEUTRAL set the reduction order, so one setting of them holds
   for every T of a shape (searched per shape, on the total over all T); T-neutral fields are then searched per
   (shape, T), and a setting that changes any bit of the output against the shape's setting is refused. Both
   searches are greedy coordinate searches (one field at a time, `max_settings` settings each).
3. Proof: winners are re-timed against the defaults afresh, interleaved (re-profiling); what does not reproduce
   `min_gain` is dropped. Then the step gate (step_gate.py): a kernel's entries stay only if the whole captured
   decode step is `min_step_gain` faster with them (kernels alone can win where the step does not); then the step
   options (STEP_OPTIONS: settings that move work between launches, e.g. the norm statistic into its producers),
   each kept only if the captured step gains as much with it. CUDA timing
   is real (CUDA graphs, events); on CPU only the Triton interpreter runs the kernels, whose timings mean nothing
   for a GPU: refused unless allow_cpu=True (tests exercise the search).
The table goes into EngineConfig.kernel_table as (f"{kernel}@{N}x{K}@T{t}", params JSON).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from tqdm import tqdm
from triton.runtime.errors import OutOfResources

from specpilot.costmodel import Attribution
from specpilot.engines.batch.runner import bucket
from specpilot.engines.config import EngineConfig, WeightFormat
from specpilot.engines.family import shape_from_dict
from specpilot.engines.shapes import LlamaShape, OpClass
from specpilot.kernels import LaunchParams
from specpilot.kernels import table as _table
from specpilot.kernels.table import launch_params, parse_key  # noqa: F401  (the tuner's table API, re-exported)
from specpilot.stages.candidate import Candidate
from specpilot.stages.kernel_specs import BY_NAME, SPECS, KernelSpec, _k  # noqa: F401  (BY_NAME: re-exported)
from specpilot.stages.kernel_specs import MAX_COPIES

if TYPE_CHECKING:
    from specpilot.stages.io import StageRun

# A setting is refused, not fatal, when its params are invalid for the shape (ValueError from the wrappers) or
# its compiled kernel does not fit the device (Triton raises OutOfResources at launch: shared memory, registers).
UNLAUNCHABLE = (ValueError, OutOfResources)



class TuneError(RuntimeError):
    """Tuning cannot run here (device), or a table breaks batch invariance."""


@dataclass(frozen=True)
class TuneBudget:
    max_kernels: int = 3
    min_gap: float = 1.05  # op classes within 5% of their roofline ideal are not worth tuning
    max_settings: int = 16  # settings timed per (kernel, shape) search and per (kernel, shape, T) search
    reps: int = 20  # timing repetitions (CUDA: replays of a 20-launch graph, median; CPU: calls, median)
    context: int = 2048  # cached keys the attention kernel reads while timed
    min_gain: float = 1.02  # re-profiled default time / tuned time needed to keep a change
    step_gate: bool = True  # keep a kernel's entries only if the whole decode step is faster with them
    min_step_gain: float = 1.002  # step time without / with a kernel's entries, summed over the tuned T
    step_options: bool = True  # with the step gate: try STEP_OPTIONS on the captured step, keep what gains
    seed: int = 0  # the timed inputs




@dataclass(frozen=True)
class StepOption:
    """A table-wide setting the per-kernel search cannot judge (it moves work from one launch to another): tried on
    the captured step after the gate (step_gate.try_options), on every tuned T of its kernels."""
    name: str
    kernels: tuple[str, ...]
    fields: tuple[tuple[str, Any], ...]
    hidden_multiple: int = 1  # the shapes it applies to: hidden a multiple of this

    def apply(self, shape: LlamaShape) -> Callable[[tuple], tuple]:
        def apply(pairs: tuple) -> tuple:
            for kernel in self.kernels:
                pairs = _table.with_fields(pairs, kernel, *BY_NAME[kernel].dims(shape), dict(self.fields))
            return pairs
        return apply


# The norm launches' statistic from their producers' segment sums (kernels/rmsnorm.py): o_proj and down pay a few
# adds and a store in their epilogues, QKV, gate_up and the LM head skip a pass over x. post_scale on top: the
# producers also store their rows times the next norm weight, which those launches project without normalising.
STEP_OPTIONS = (StepOption("producer_stat", ("qkv", "gate_up", "lm_head"), (("producer_stat", True),), 16),
                StepOption("post_scale", ("qkv", "gate_up", "lm_head"), (("producer_stat", True), ("post_scale", True)),
                           16))


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    op: OpClass  # the op class whose gap selected it
    gap: float  # measured / ideal
    excess_s: float  # measured - ideal, per step


def select_kernels(attribution: Attribution, max_kernels: int, specs: Sequence[KernelSpec] = SPECS,
                   min_gap: float = 1.05) -> tuple[KernelChoice, ...]:
    gaps = sorted((g for g in attribution.kernel.op_gaps
                   if g.gap is not None and g.gap >= min_gap and g.excess_s > 0.0), key=lambda g: (-g.excess_s, -g.gap))
    chosen: dict[str, KernelChoice] = {}
    for g in gaps:
        for spec in specs:
            if g.op in spec.ops and spec.name not in chosen and len(chosen) < max_kernels:
                chosen[spec.name] = KernelChoice(spec.name, g.op, g.gap, g.excess_s)
    return tuple(chosen.values())


@dataclass(frozen=True)
class TableEntry:
    kernel: str
    n: int
    k: int
    tokens: int
    params: dict[str, Any]  # every LaunchParams field
    default_ms: float | None  # re-profiled; None for an entry a step option made (KernelTable.step["options"])
    tuned_ms: float | None

    @property
    def key(self) -> str:
        return f"{self.kernel}@{self.n}x{self.k}@T{self.tokens}"

    @property
    def pair(self) -> tuple[str, str]:
        """(key, params JSON): this entry as EngineConfig.kernel_table holds it."""
        return self.key, json.dumps(self.params, sort_keys=True)


@dataclass(frozen=True)
class KernelTable:
    device: str
    dtype: str
    context: int
    entries: tuple[TableEntry, ...]
    selected: tuple[KernelChoice, ...] = ()
    refused: tuple[str, ...] = ()  # settings that were invalid or changed bits they must not
    step: dict[str, Any] = dataclasses.field(default_factory=dict)  # the step gate's times (step_gate.gate)

    def config_pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple(e.pair for e in self.entries)

    def apply(self, config: EngineConfig) -> EngineConfig:
        """`config` with this table (replacing entries of the same key)."""
        merged = dict(config.kernel_table) | dict(self.config_pairs())
        check_invariance(tuple(merged.items()))
        return config.replace(kernel_table=tuple(sorted(merged.items())))

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "context": self.context,
                "entries": [dataclasses.asdict(e) for e in self.entries],
                "selected": [{**dataclasses.asdict(c), "op": c.op.value} for c in self.selected],
                "refused": list(self.refused), "step": self.step}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KernelTable":
        return cls(d["device"], d["dtype"], d["context"], tuple(TableEntry(**e) for e in d["entries"]),
                   tuple(KernelChoice(c["kernel"], OpClass(c["op"]), c["gap"], c["excess_s"]) for c in d["selected"]),
                   tuple(d["refused"]), d.get("step", {}))


def check_invariance(pairs: Sequence[tuple[str, str]]) -> None:
    """kernels.table.check_invariance, with a table that breaks batch invariance reported as a TuneError."""
    try:
        _table.check_invariance(pairs)
    except _table.InvarianceError as e:
        raise TuneError(str(e)) from None


def write_kernel_table(table: KernelTable, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(table.to_dict(), indent=1))
    return path


def read_kernel_table(path: str | Path) -> KernelTable:
    table = KernelTable.from_dict(json.loads(Path(path).read_text()))
    check_invariance(table.config_pairs())
    return table


# ---- the search -------------------------------------------------------------------------------------------
def _coordinate_search(spec: KernelSpec, fields: Sequence[str], start: dict[str, Any], limit: int,
                       score: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """The best setting of `fields` found by a greedy coordinate search over SEARCH_SPACE: from `start`, each field
    in turn takes its best value with the others held, and the fields are swept again while a sweep improves,
    until `limit` settings (start included) are scored. score -> seconds (inf: refused). One field at a time finds
    what a sample of the product misses: Llama-3-8B's best projections differ from the defaults in block_k alone."""
    best, best_s = dict(start), score(start)
    seen = {tuple(start[f] for f in fields)}
    improved = True
    while improved:
        improved = False
        for f in fields:
            current = dict(best)
            for v in spec.params.SEARCH_SPACE[f]:
                cand = {**current, f: v}
                key = tuple(cand[g] for g in fields)
                if key in seen:
                    continue
                if len(seen) >= limit:
                    return best
                seen.add(key)
                s = score(cand)
                if s < best_s:
                    best, best_s, improved = cand, s, True
    return best


def _timer(dev: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    if dev.type == "cuda":
        # Inside a CUDA graph, launches back to back: these kernels run for a few us, less than a Python launch
        # costs, so timing launches from the host (do_bench) would measure the launcher, not the kernel. One
        # launch per weight copy a Run cycles through (kernel_specs.MAX_COPIES), so the weights come from HBM.
        from specpilot.kernels.bench import time_graph
        return lambda fn: time_graph([fn] * MAX_COPIES, max(10, reps))

    def cpu(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return cpu


def _same(a: Any, b: Any) -> bool:
    """Bit-identical outputs (one tensor or a tuple of them)."""
    a, b = ((x,) if isinstance(x, torch.Tensor) else tuple(x) for x in (a, b))

    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.detach().contiguous().reshape(-1).view(torch.uint8)
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
                                    for x, y in zip(a, b))


def _check_device(dev: torch.device, allow_cpu: bool) -> None:
    from specpilot.kernels import _common
    interpreted = _common.is_interpreted(_k().gemm._linear_kernel)
    if dev.type == "cuda" and (interpreted or not torch.cuda.is_available()):
        raise TuneError("tune_kernels on CUDA needs a GPU and compiled kernels (unset TRITON_INTERPRET)")
    if dev.type != "cuda" and not allow_cpu:
        raise TuneError(f"tune_kernels times kernels on the real device; on {dev} only the Triton interpreter runs "
                        "them and its timings say nothing about GPU speed (allow_cpu=True exercises the search)")
    if dev.type != "cuda" and not interpreted:
        raise TuneError("on CPU the kernels run only under the interpreter: set TRITON_INTERPRET=1 before import")


def tune_kernels(attribution: Attribution, shape: LlamaShape, device: str | torch.device, tokens_list: Sequence[int],
                 budget: TuneBudget = TuneBudget(), *, allow_cpu: bool = False, dtype: torch.dtype | None = None,
                 specs: Sequence[KernelSpec] = SPECS,
                 weight_format: WeightFormat = WeightFormat.NATIVE) -> KernelTable:
    """weight_format=W12: the projections are timed on W12 weights, as a W12 build runs them (their best launches
    are not bf16's: session 29's H200 sweeps), and the step gate times W12 engines."""
    dev = torch.device(device)
    _check_device(dev, allow_cpu)
    w12 = weight_format is WeightFormat.W12
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" or w12 else torch.float32)
    if w12 and dtype != torch.bfloat16:
        raise TuneError(f"weight_format=w12 decodes to bf16: tuning needs dtype=torch.bfloat16, got {dtype}")
    timed = _timer(dev, budget.reps)
    choices = select_kernels(attribution, budget.max_kernels, specs, budget.min_gap)
    entries: list[TableEntry] = []
    refused: list[str] = []
    by_name = {s.name: s for s in specs}
    for choice in choices:
        spec = by_name[choice.kernel]
        n, k = spec.dims(shape)
        runs = {t: spec.make(shape, n, k, t, budget.context, dtype, dev, torch.Generator().manual_seed(budget.seed + t),
                             w12=w12) for t in tokens_list}
        default = spec.params()
        fields = [f.name for f in dataclasses.fields(spec.params)]

        with tqdm(desc=f"tune {spec.name}@{n}x{k}", unit="setting") as bar:  # closed on an exception too
            def total(p: LaunchParams) -> float:
                return sum(timed(lambda r=r: r(p)) for r in runs.values())

            def launchable(fn: Callable[[dict[str, Any]], float], at: str) -> Callable[[dict[str, Any]], float]:
                def score(setting: dict[str, Any]) -> float:
                    bar.set_postfix_str(f"{at} {setting}")  # before the launch: a hang or crash names its setting
                    bar.update()
                    try:
                        return fn(setting)
                    except UNLAUNCHABLE as e:
                        refused.append(f"{spec.name}@{n}x{k}{at} {setting}: {e}")
                        return float("inf")
                return score

            # 1) numerics-setting fields: one setting per shape, judged on the total over every T
            fixed_fields = [f for f in fields if f not in spec.params.T_NEUTRAL and f in spec.params.SEARCH_SPACE]
            base = dataclasses.replace(default, **_coordinate_search(
                spec, fixed_fields, {f: getattr(default, f) for f in fixed_fields}, budget.max_settings,
                launchable(lambda s: total(dataclasses.replace(default, **s)), "")))
            if base != default and total(default) / total(base) < budget.min_gain:  # re-profiled: not reproduced
                base = default
            # 2) T-neutral fields per T; each must keep every bit of the output
            neutral = [f for f in fields if f in base.t_neutral() and f in spec.params.SEARCH_SPACE]
            for t, run in runs.items():
                reference = run(base)

                def timed_if_same(s: dict[str, Any], run=run, reference=reference, t=t) -> float:
                    p = dataclasses.replace(base, **s)
                    if not _same(run(p), reference):
                        refused.append(f"{spec.name}@{n}x{k}@T{t} {s}: output differs from {dataclasses.asdict(base)}")
                        return float("inf")
                    return timed(lambda: run(p))

                found = dataclasses.replace(base, **_coordinate_search(
                    spec, neutral, {f: getattr(base, f) for f in neutral}, budget.max_settings,
                    launchable(timed_if_same, f"@T{t}")))
                # 3) re-profile default, shape setting and winner afresh, interleaved; keep what reproduces
                rounds = [(timed(lambda: run(default)), timed(lambda: run(base)), timed(lambda: run(found)))
                          for _ in range(3)]
                d_ms, b_ms, w_ms = (statistics.median(col) for col in zip(*rounds))
                kept_winner = found != base and b_ms / w_ms >= budget.min_gain
                winner, tuned_ms = (found, w_ms) if kept_winner else (base, b_ms)
                if winner != default:  # a shape-level setting is written for every T, gain or not: invariance
                    entries.append(TableEntry(spec.name, n, k, t, dataclasses.asdict(winner), d_ms, tuned_ms))
    step: dict[str, Any] = {}
    if budget.step_gate:
        from specpilot.stages.step_gate import gate, step_timer, try_options
        timer = step_timer(shape, dev, dtype, budget.context, budget.reps, weight_format=weight_format)
        if entries:
            groups: dict[str, list[TableEntry]] = {}
            for e in entries:
                groups.setdefault(e.kernel, []).append(e)
            pairs = {k: tuple(e.pair for e in es) for k, es in groups.items()}
            kept, dropped, step = gate(pairs, timer, sorted(set(tokens_list)), budget.min_step_gain)
            entries = [e for e in entries if e.kernel in kept]
            refused += [f"step gate: {d}" for d in dropped]
        if budget.step_options:
            options = [(o.name, o.apply(shape)) for o in STEP_OPTIONS if shape.hidden % o.hidden_multiple == 0]
            table_pairs = tuple(e.pair for e in entries)
            try:
                new_pairs, step["options"] = try_options(table_pairs, options, timer, sorted(set(tokens_list)),
                                                         budget.min_step_gain)
            except UNLAUNCHABLE as e:
                new_pairs = table_pairs
                refused.append(f"step options: {e}")
            entries = _with_option_entries(entries, new_pairs)
    table = KernelTable(str(dev), str(dtype).removeprefix("torch."), budget.context, tuple(entries), choices,
                        tuple(refused), step)
    check_invariance(table.config_pairs())
    return table


def _with_option_entries(entries: list[TableEntry], pairs: Sequence[tuple[str, str]]) -> list[TableEntry]:
    """The entries of `pairs` (try_options' table): unchanged ones as they were, the others with every field of their
    params class and no kernel-alone times (a step option was judged on the step)."""
    old = {e.key: e for e in entries}
    out = []
    for key, text in pairs:
        params = json.loads(text)
        if key in old and old[key].params == params:
            out.append(old[key])
            continue
        kernel, n, k, t = parse_key(key)
        full = dataclasses.asdict(_table.PARAMS[kernel](**params))
        out.append(TableEntry(kernel, n, k, t, full, None, None))
    return out


def token_counts(build: Candidate, concurrency: Sequence[int] = ()) -> list[int]:
    """The token counts to tune for a build: a single-request build's AR step (1) and its verify tile; a batch-regime
    build's steps at each concurrency, one token a request (AR) and 1 + draft_len (speculative), rounded up to the
    batched engine's graph buckets and capped at its largest graph (its launch table is looked up at the bucket)."""
    if build.batch_config is None or not concurrency:
        return sorted({1, build.config.token_tile})
    cap = build.batch_config.graph_max_tokens
    per_request = {1, 1 + build.config.draft_len} if build.config.speculative else {1}
    return sorted({bucket(min(c * n, cap)) for c in concurrency for n in per_request})


def run(run: "StageRun") -> dict[str, Any]:
    """Stage entry: profile's shape and build, attribute's attribution; writes kernel_table.json and the build
    with the table applied (build.json). Params: tokens (default 1 and the build's token tile; the tune flow passes
    token_counts), budget, allow_cpu."""
    build, shape = Candidate.from_dict(run.read_json("profile", "build.json")), shape_from_dict(run.read_json(
        "profile", "shape.json"))
    if not isinstance(shape, LlamaShape):  # the table steers the fused Llama layers' kernels only
        raise TuneError(f"tune_kernels tunes the Llama family's kernels; the target is {type(shape).__name__}")
    table = tune_kernels(Attribution.from_dict(run.read_json("attribute", "attribution.json")), shape, run.device,
                         run.param("tokens") or sorted({1, build.config.token_tile}),
                         TuneBudget(**run.param("budget", {})), allow_cpu=bool(run.param("allow_cpu", False)),
                         weight_format=build.config.weight_format)
    write_kernel_table(table, run.out_dir / "kernel_table.json")
    tuned = dataclasses.replace(build, name=f"{build.name}+kernels", config=table.apply(build.config))
    (run.out_dir / "build.json").write_text(json.dumps(tuned.to_dict(), indent=1))
    return {"kernels": [c.kernel for c in table.selected], "entries": len(table.entries),
            "refused": len(table.refused), "kernel_table": [list(p) for p in table.config_pairs()]}
