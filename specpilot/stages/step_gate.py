"""The kernel tuner's end-to-end gate: a kernel's tuned entries stay in the table only if the whole decode step is
faster with them.

tune_kernels times each kernel alone (a graph of back-to-back launches over rotated weight copies). That does not
always carry into the step: on an H200, session 6's Llama-3-8B table took qkv from 32.6 to 27.2 us alone, and the
captured step from 5.052 to 5.096 ms (notes/h200.md, session 7). So after the search the table is applied to an
engine with random weights of the target's shape (step time does not depend on weight values), and each kernel's
entries are dropped in turn when the step is not at least `min_gain` faster with them than without.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specpilot.engines.config import DrafterKind, DType, EngineConfig, KernelBackend
from specpilot.engines.loader import random_model
from specpilot.engines.runner import ModelRunner
from specpilot.engines.shapes import LlamaShape

StepTimer = Callable[[tuple[tuple[str, str], ...], int], float]  # (kernel table pairs, tokens) -> ms per step
_DTYPES = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16, torch.float32: DType.FP32}


def step_timer(shape: LlamaShape, device: torch.device, dtype: torch.dtype, context: int, reps: int) -> StepTimer:
    """ms of one `tokens`-token verify step at `context` cached tokens through the Triton kernels with a given
    table: the captured step graph's replay time on CUDA (CUDA events, median), the eager step's on CPU."""
    model = random_model(shape, dtype, device, seed=0)

    def time_step(pairs: tuple[tuple[str, str], ...], tokens: int) -> float:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous call's runner: its cache and graph pool
        cfg = EngineConfig(drafter=DrafterKind.NONE, kernel_backend=KernelBackend.TRITON, dtype=_DTYPES[dtype],
                           kernel_table=pairs, max_seq_len=context + 64, cuda_graphs=True)
        runner = ModelRunner(model, cfg, device, block_width=max(16, tokens))
        ids, anc = list(range(3, 3 + tokens)), np.tril(np.ones((tokens, tokens), dtype=bool))
        base = context - tokens

        def step() -> None:
            runner.verify(base, ids, list(range(tokens)), anc)
        step()  # compiles and captures
        if runner.use_graphs:
            graph = runner._graphs[runner._graph_key(tokens)].graph
            times = []
            for _ in range(max(10, reps)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            times = []
            for _ in range(max(1, reps)):
                t0 = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return time_step


def gate(pairs_by_kernel: dict[str, tuple[tuple[str, str], ...]], time_step: StepTimer, tokens_list: Sequence[int],
         min_gain: float) -> tuple[list[str], list[str], dict[str, Any]]:
    """(kernels kept, why each other was dropped, step times per token count, JSON-ready): kernel by kernel in the given order, its entries are
    kept if the step, summed over tokens_list, is at least min_gain times faster with them than without."""
    def total(kernels: Sequence[str]) -> dict[int, float]:
        pairs = tuple(p for k in kernels for p in pairs_by_kernel[k])
        return {t: time_step(pairs, t) for t in tokens_list}
    kept = list(pairs_by_kernel)
    default = total([])
    with_all = total(kept)
    dropped = []
    for kernel in list(kept):
        rest = [k for k in kept if k != kernel]
        without = default if not rest else total(rest)
        gain = sum(without.values()) / sum(with_all.values())
        if gain < min_gain:
            dropped.append(f"{kernel}: the step takes {_ms(without)} ms without its entries and {_ms(with_all)} ms "
                           f"with them (gain {gain:.4f} < {min_gain})")
            kept, with_all = rest, without
    return kept, dropped, {"tokens": list(tokens_list), "default_ms": [default[t] for t in tokens_list],
                           "tuned_ms": [with_all[t] for t in tokens_list],
                           "gain": sum(default.values()) / sum(with_all.values())}


def _ms(times: dict[int, float]) -> str:
    return " + ".join(f"{v:.4f} (T={t})" for t, v in times.items())
