"""CUDA graphs of the runner's hot path: one per step width (a decode/verify forward) and one per chain of AR steps.

Each graph copies its pinned inputs in and its argmax out itself, so a step costs the host one replay and one
sync. Capture warms up on a side stream writing only scratch KV slots (restored afterwards).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specpilot.kernels._common import capture_graph

if TYPE_CHECKING:
    from specpilot.engines.runner import ModelRunner


@dataclass
class StepGraph:
    """One captured step: it copies its pinned inputs (ints = ids | positions | slots | base; anc) in and the
    argmax out to pinned memory; `staged` marks when its last replay has read the inputs."""
    graph: "torch.cuda.CUDAGraph"
    host_ints: torch.Tensor
    host_anc: torch.Tensor
    host_argmax: torch.Tensor
    out: tuple
    staged: "torch.cuda.Event"
    # The device tensors the graph reads besides the model and cache (input buffers, constants): a replay reads
    # their addresses, so they must live as long as the graph (freed, the allocator hands them out again).
    keep: tuple = ()


def capture_step(runner: "ModelRunner", width: int) -> StepGraph:
    """One graph of a `width`-token forward over pinned inputs (ids, positions, slots, base, anc)."""
    d = runner.device
    ints = torch.zeros(3 * width + 1, dtype=torch.long, device=d)
    anc = torch.zeros(width, runner.block_width, dtype=torch.bool, device=d)
    host_ints = torch.zeros(ints.shape, dtype=torch.long).pin_memory()
    host_ints[2 * width:3 * width] = torch.arange(width)  # warm-up and capture write only scratch slots
    host_ints[3 * width] = 1
    host_anc = torch.eye(width, runner.block_width, dtype=torch.bool).pin_memory()
    host_argmax = torch.zeros(width, dtype=torch.long).pin_memory()
    static_in = (ints[:width], ints[width:2 * width], ints[2 * width:3 * width], ints[3 * width], anc)

    def step():
        ints.copy_(host_ints, non_blocking=True)
        anc.copy_(host_anc, non_blocking=True)
        out = runner._step_fn(*static_in)
        host_argmax.copy_(out[0], non_blocking=True)
        return out
    graph, static_out = capture_restoring(runner, step, width + 1)
    g = StepGraph(graph, host_ints, host_anc, host_argmax, static_out, torch.cuda.Event(), keep=(ints, anc))
    g.staged.record()
    return g


def capture_decode(runner: "ModelRunner", steps: int) -> StepGraph:
    """One graph of `steps` chained one-token forwards: inputs (token, base) in, the steps' argmax out."""
    d = runner.device
    ints = torch.zeros(2, dtype=torch.long, device=d)
    host_ints = torch.zeros(2, dtype=torch.long).pin_memory()  # warm-up/capture: slots 0.. (scratch)
    host_argmax = torch.zeros(steps, dtype=torch.long).pin_memory()
    offsets = torch.arange(steps, device=d)
    anc = torch.eye(1, runner.block_width, dtype=torch.bool, device=d)

    def chain():
        ints.copy_(host_ints, non_blocking=True)
        slots = ints[1] + offsets  # position == slot == base for one AR token
        token, tokens = ints[:1], []
        for i in range(steps):
            token = runner._step_fn(token, slots[i:i + 1], slots[i:i + 1], slots[i], anc)[0]
            tokens.append(token)
        host_argmax.copy_(torch.cat(tokens), non_blocking=True)
    graph, _ = capture_restoring(runner, chain, steps + 1)
    g = StepGraph(graph, host_ints, anc, host_argmax, (), torch.cuda.Event(), keep=(ints, offsets, anc))
    g.staged.record()
    return g


def capture_restoring(runner: "ModelRunner", body, scratch_slots: int, warmups: int = 3, keep_graph: bool = False):
    """(graph, body's outputs): warm-up on a side stream (compilation, cuBLAS handles), then capture (keep_graph:
    see capture_graph). Both write only KV slots < scratch_slots, which are restored afterwards (a request's
    context may live there)."""
    saved = runner.kv[:, :, :, :scratch_slots].clone()
    graph, out = capture_graph(body, warmups, keep_graph=keep_graph)
    torch.cuda.synchronize()
    runner.kv[:, :, :, :scratch_slots] = saved
    return graph, out
