"""The device loop's tree steps with the drafter's observe beside the next draft (EngineConfig.observe_overlap).

A tree step ends commit -> move -> observe (fc, the context keys/values GEMM, their norm + rotary: four launches),
and the next step's draft starts embedding -> first norm + QKV projection, which read nothing the move or the
observe write and write nothing they read. On one stream all of them sit on the step's critical path; here the move
and the observe run on a second stream, forked after the commit, and the draft joins it just before its first layer
writes keys into the cache (FusedBlockStep.draft's `join`): the draft's first two launches leave the critical path
(the longer branch, the move and the observe, stays on it). Those launches read the commit's next state, not the
loop's state, which the move writes. The tensors of the main stream that the second one reads stay referenced until
the join, so no allocation of the main stream (graph capture included) reuses their memory while the second stream
may still read it. A chunk joins before it ends, so only steps inside one chunk overlap (device_steps > 1).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ObserveStream:
    """A second CUDA stream for the move and the observe of one tree step at a time."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"observe_overlap runs a second CUDA stream: not on {device}")
        self.side = torch.cuda.Stream(device)
        self.next_state: torch.Tensor | None = None  # the forked step's commit's next state, until the join
        self._held: tuple[torch.Tensor | None, ...] = ()

    @property
    def pending(self) -> bool:
        return self.next_state is not None

    def _main(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.side.device)

    @contextlib.contextmanager
    def fork(self, next_state: torch.Tensor, *held: torch.Tensor | None) -> Iterator[None]:
        """Work queued inside runs on the second stream, after everything queued so far on the current one; until
        the join, the next draft reads next_state and `held` (what that work reads) stays referenced."""
        if self.pending:
            raise RuntimeError("observe stream: a fork before the last one was joined")
        self.side.wait_stream(self._main())
        # pending from here on, even if the body raises: whatever it queued is still joined (a capture must not end
        # with the second stream unjoined)
        self.next_state, self._held = next_state, held
        with torch.cuda.stream(self.side):
            yield

    def join(self) -> None:
        """The current stream waits for the forked work (a no-op when nothing is pending)."""
        if self.pending:
            self._main().wait_stream(self.side)
            self.next_state, self._held = None, ()
