"""The kernel tuner's end-to-end gate: a kernel's tuned entries stay in the table only if the whole decode step is
faster with them.

tune_kernels times each kernel alone (a graph of back-to-back launches over rotated weight copies). That does not
always carry into the step: on an H200, session 6's Llama-3-8B table took qkv from 32.6 to 27.2 us alone, and the
captured step from 5.052 to 5.096 ms (notes/h200.md, session 7). So after the search the table is applied to an
engine with random weights of the target's shape (step time does not depend on weight values), and each kernel's
entries are dropped in turn when the step is not at least `min_gain` faster with them than without (the two
measured together, interleaved).
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from specpilot.engines.config import DrafterKind, DType, EngineConfig, KernelBackend, WeightFormat
from specpilot.engines.loader import random_model
from specpilot.engines.runner import ModelRunner
from specpilot.engines.shapes import LlamaShape
from specpilot.weights.model import W12Weights

# (kernel table pairs, tokens[, a context manager factory the step is captured in, e.g. kernels.pdl's
# grid_dependency]) per configuration -> ms per step of each, measured together (interleaved)
StepTimer = Callable[[Sequence[tuple]], list[float]]
Pairs = tuple[tuple[str, str], ...]  # a kernel table (EngineConfig.kernel_table)


def step_timer(shape: LlamaShape, device: torch.device, dtype: torch.dtype, context: int, reps: int,
               rounds: int = 5, weight_format: WeightFormat = WeightFormat.NATIVE) -> StepTimer:
    """Times `tokens`-token verify steps at `context` cached tokens through the Triton kernels, one engine per
    (table, tokens) configuration: each configuration's captured step graph (CUDA; the eager step on CPU) is built
    first, then the configurations are replayed in turn for `rounds` rounds of `reps` replays, and each gets the
    median of its rounds. Interleaved because two captures of one configuration timed apart differed by ~2% on an
    H200 (Llama-3-8B shapes, 5.24 vs 5.33 ms), more than the gains judged. The engines read the build's weight
    format: a W12 table is judged on the W12 step (until session 31 every gate timed bf16 weights, so a W12 tuning
    run kept or dropped entries by what they did to the native step), its kernel layouts encoded once and shared."""
    model = random_model(shape, dtype, device, seed=0)
    layouts = W12Weights.from_model(model).kernel_layouts() if weight_format is WeightFormat.W12 else None

    def prepare(pairs: tuple[tuple[str, str], ...], tokens: int,
                capture: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], None]:
        cfg = EngineConfig(drafter=DrafterKind.NONE, kernel_backend=KernelBackend.TRITON, dtype=DType(str(dtype).removeprefix("torch.")),
                           kernel_table=pairs, max_seq_len=context + 64, cuda_graphs=True, weight_format=weight_format)
        runner = ModelRunner(model, cfg, device, block_width=max(16, tokens), w12_layouts=layouts)
        ids, anc = list(range(3, 3 + tokens)), np.tril(np.ones((tokens, tokens), dtype=bool))

        def step() -> None:
            runner.verify(context - tokens, ids, list(range(tokens)), anc)
        with capture():
            step()  # compiles and captures the one graph this runner holds (the block padded to its width)
        if not runner.use_graphs:
            return step
        graph = next(iter(runner._graphs.values())).graph

        def replay() -> None:
            # The replay writes the runner's KV cache and reads its buffers: the closure keeps the runner alive
            # (returning graph.replay alone let it be freed and the graph write into reused memory).
            assert runner.use_graphs
            graph.replay()
        return replay

    def ms_per_call(fn: Callable[[], None], n: int) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e3 * (time.perf_counter() - t0) / n

    def measure(configs: Sequence[tuple]) -> list[float]:
        fns = [prepare(*config) for config in configs]
        times = [[ms_per_call(fn, max(1, reps)) for fn in fns] for _ in range(rounds)]
        del fns
        gc.collect()  # the runners (in reference cycles) and their graphs go now, outside any capture
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the engines' caches and graph pools
        return [statistics.median(col) for col in zip(*times)]
    return measure


def gate(pairs_by_kernel: dict[str, tuple[tuple[str, str], ...]], measure: StepTimer, tokens_list: Sequence[int],
         min_gain: float) -> tuple[list[str], list[str], dict[str, Any]]:
    """(kernels kept, why each other was dropped, step times per token count, JSON-ready): kernel by kernel in the
    given order, its entries are kept if the step, summed over tokens_list, is at least min_gain times faster with
    them than without (both measured together). Then the kept entries together against the untuned step, measured
    together in both orders (the configuration measured first can read faster): below min_gain, none is kept."""
    def pairs(kernels: Sequence[str]) -> tuple[tuple[str, str], ...]:
        return tuple(p for k in kernels for p in pairs_by_kernel[k])
    kept = list(pairs_by_kernel)
    n = len(tokens_list)
    dropped = []
    for kernel in tqdm(list(kept), desc="step gate", unit="kernel"):
        rest = [k for k in kept if k != kernel]
        both = measure([(pairs(kept), t) for t in tokens_list] + [(pairs(rest), t) for t in tokens_list])
        with_it, without = both[:n], both[n:]
        gain = sum(without) / sum(with_it)
        if gain < min_gain:
            dropped.append(f"{kernel}: the step takes {_ms(tokens_list, without)} ms without its entries and "
                           f"{_ms(tokens_list, with_it)} ms with them (gain {gain:.4f} < {min_gain})")
            kept = rest
    if not kept:  # nothing to compare the untuned step with
        default = measure([((), t) for t in tokens_list])
        return kept, dropped, {"tokens": list(tokens_list), "default_ms": default, "tuned_ms": default, "gain": 1.0}
    default, tuned = both_orders(measure, (), pairs(kept), tokens_list)
    gain = sum(default) / sum(tuned)
    if gain < min_gain:
        dropped.append(f"together ({', '.join(kept)}): the step takes {_ms(tokens_list, default)} ms untuned and "
                       f"{_ms(tokens_list, tuned)} ms with them, both orders (gain {gain:.4f} < {min_gain})")
        kept, tuned, gain = [], default, 1.0
    return kept, dropped, {"tokens": list(tokens_list), "default_ms": default, "tuned_ms": tuned, "gain": gain}


def both_orders(measure: StepTimer, base: Pairs, table: Pairs,
                tokens_list: Sequence[int]) -> tuple[list[float], list[float]]:
    """(base ms, table ms) per token count, each the mean of a measurement with the table first and one with the base
    first (the configuration measured first can read faster)."""
    n = len(tokens_list)
    table_first = measure([(table, t) for t in tokens_list] + [(base, t) for t in tokens_list])
    base_first = measure([(base, t) for t in tokens_list] + [(table, t) for t in tokens_list])
    return ([(a + b) / 2 for a, b in zip(table_first[n:], base_first[:n])],
            [(a + b) / 2 for a, b in zip(table_first[:n], base_first[n:])])


def try_options(pairs: Pairs, options: Sequence[tuple[str, Callable[[Pairs], Pairs]]], measure: StepTimer,
                tokens_list: Sequence[int], min_gain: float) -> tuple[Pairs, list[dict[str, Any]]]:
    """Table-wide options a kernel timed alone cannot judge (one launch's change paid or repaid by another, e.g.
    RMSNormLinearParams.producer_stat): each (name, table -> the table with it) in turn against the table so far,
    both orders; kept where the step, summed over tokens_list, is min_gain faster. -> (the table, a record each)."""
    records = []
    for name, apply in tqdm(list(options), desc="step options", unit="option"):
        with_it = apply(pairs)
        without, ms = both_orders(measure, pairs, with_it, tokens_list)
        gain = sum(without) / sum(ms)
        kept = gain >= min_gain
        records.append({"option": name, "tokens": list(tokens_list), "without_ms": without, "with_ms": ms,
                        "gain": gain, "kept": kept})
        if kept:
            pairs = with_it
    return pairs, records


def _ms(tokens_list: Sequence[int], times: Sequence[float]) -> str:
    return " + ".join(f"{v:.4f} (T={t})" for t, v in zip(tokens_list, times))
