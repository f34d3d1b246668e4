"""A second CUDA stream for a device loop step's work off its critical path (EngineConfig.observe_overlap,
lookup_overlap).

The block drafter's observe beside the target's last layers (observe_overlap): a tree step ran verify -> commit ->
move -> observe (fc, the context keys/values GEMM, their norm + rotary), and the next draft attends to the observe's
keys, so the observe sat on the step's critical path (~16 us of kernels on an H100). It reads only the target's
captured features, which are complete once the last captured layer has run (27 of SmolLM2's 30): with
observe_overlap the device loop projects every tree row there, at the row's tree slot and position, on a second CUDA
stream beside the target's remaining layers, its LM head and the commit; the main stream joins it before the move,
which places the drafter's rows of the accepted path with the target's (tree_move's drafter_cache). The drafter's
cache ends as before: the path's rows are the same rows of the same launches (the tree's rows instead of the
gathered path's: as many rows when the tree is as deep as it is wide).

Prompt lookup beside the block's draft (lookup_overlap): the lookup read the block's depth-1 candidates for its gate
(LeadGate), so it ran after the draft's last launch; it now runs on the second stream from the step's start, ungated,
and the grow launch applies the gate where it reads the lead (tree_grow's `gate`).

The main stream's tensors the second stream reads stay referenced until the join, so no allocation of the main
stream (a graph capture's included) reuses their memory while the second stream may still read it. Off CUDA the same
work runs in stream order.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SideStream:
    """A second CUDA stream for one piece of a step's work at a time (in stream order off CUDA)."""

    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._held: tuple[torch.Tensor | None, ...] | None = None

    @property
    def pending(self) -> bool:
        return self._held is not None

    @contextlib.contextmanager
    def fork(self, *held: torch.Tensor | None) -> Iterator[None]:
        """Work queued inside runs on the second stream, after everything queued so far on the current one; `held`
        (what that work reads of the current stream's) stays referenced until the join."""
        if self.pending:
            raise RuntimeError("side stream: a fork before the last one was joined")
        # pending from here on, even if the body raises: whatever it queued is still joined (a capture must not end
        # with the second stream unjoined)
        self._held = held
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            yield

    def join(self) -> None:
        """The current stream waits for the forked work (a no-op when nothing is pending)."""
        if self.pending:
            if self.side is not None:
                torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self._held = None
