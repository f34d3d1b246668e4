"""CUDA graphs of the runner's hot path: one per step width (a decode/verify forward) and one per chain of AR steps.

Each graph copies its pinned inputs in and its argmax out itself, so a step costs the host one replay and one
sync. Capture warms up on a side stream writing only scratch KV slots (restored afterwards).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specpilot.engines import graph_if
from specpilot.kernels._common import capture_graph

if TYPE_CHECKING:
    from specpilot.engines.runner import ModelRunner
log = logging.getLogger(__name__)


@dataclass
class StepGraph:
    """One captured step: it copies its pinned inputs (ints = ids | positions | slots | base; anc) in and the
    argmax out to pinned memory; `staged` marks when its last replay has read the inputs."""
    graph: "torch.cuda.CUDAGraph | graph_if.GuardedChain"
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
    """One graph of `steps` chained one-token forwards: inputs (token, base) in, the steps' argmax out. With the
    runner's decode_stop ids (and conditional nodes here), the steps after one that produced a stop id are skipped
    (capture_guarded_decode)."""
    if runner.decode_stop is not None and steps > 1:
        why_not = graph_if.unsupported_reason()
        if why_not is None:
            return capture_guarded_decode(runner, steps)
        log.warning("AR decode: steps past a stop run in full here (%s)", why_not)
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


def capture_guarded_decode(runner: "ModelRunner", steps: int) -> StepGraph:
    """capture_decode's chain as one graph a step (engines.graph_if): step i > 0 runs only while the request is live,
    its guard clearing `live` where step i - 1 produced one of runner.decode_stop. The argmax of a skipped step reads
    -1 (the host cuts there)."""
    d = runner.device
    ints = torch.zeros(3, dtype=torch.long, device=d)  # token, base, live
    host_ints = torch.tensor([0, 0, 1]).pin_memory()  # warm-up/capture: slots 0.. (scratch), live
    host_argmax = torch.zeros(steps, dtype=torch.long).pin_memory()
    tokens = torch.full((steps,), -1, dtype=torch.long, device=d)
    slots = torch.zeros(steps, dtype=torch.long, device=d)
    offsets = torch.arange(steps, device=d)
    anc = torch.eye(1, runner.block_width, dtype=torch.bool, device=d)

    def step(i: int):
        def body():
            if i == 0:
                ints.copy_(host_ints, non_blocking=True)
                tokens.fill_(-1)
                slots.copy_(ints[1] + offsets)  # position == slot == base + i for one AR token
            token = ints[:1] if i == 0 else tokens[i - 1:i]
            tokens[i:i + 1].copy_(runner._step_fn(token, slots[i:i + 1], slots[i:i + 1], slots[i], anc)[0])
        return body

    def to_host():
        host_argmax.copy_(tokens, non_blocking=True)
    parts = []
    for i, body in [*((i, step(i)) for i in range(steps)), (steps, to_host)]:
        graph, _ = capture_restoring(runner, body, steps + 1, keep_graph=True)
        guard = graph_if.Guard(ints[2:], tokens[i - 1:i], runner.decode_stop) if 0 < i < steps else None
        parts.append((graph, guard))
    g = StepGraph(graph_if.GuardedChain(parts), host_ints, anc, host_argmax, (), torch.cuda.Event(),
                  keep=(ints, tokens, slots, offsets, anc))
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
