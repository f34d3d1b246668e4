"""Mechanisms a and b on the device, inside the step that drafts (device_draft with goodput and/or the budget).

On the host (mechanisms.py) every request's acceptance estimate, goodput's draft lengths and the verify budget's
sort cost the batched engine ~100 us a step on this CPU and ~0.2 ms on the H200's host, between one forward and
the next (notes/h200.md, session 18: "all" spent 0.55-0.85 ms of a 2.3-2.5 ms step on the host, the device lookup
alone 0.35-0.61). Here the same decisions run at the end of the forward that verified the step, after the device
lookup drafted every row's next chain:
1. each row's estimate (AcceptanceEstimate's decayed successes / trials) takes the step's (drafted, accepted); a
   row bound to a new request since the last step starts from nothing;
2. goodput (a): each row's draft length, goodput_draft_lens's argmax over 0..cap (cap: the fixed k_max and the
   request's token limit after this step);
3. verify budget (b): allocate_verify_budget over the rows' remaining slots, the step's base tokens being the rows
   that draft again (the next step's prefill chunks are not known yet: the host version counts them);
4. each chain's proposed count becomes the length kept.
float64 and the host functions' operations in their order, so both pick the same lengths from the same numbers
(tests compare them). Which of a and b apply, and the prices, are inputs of each step (one host->device copy),
so one set of CUDA graphs serves every variant; no host sync.

On CUDA the decision is torch.compile'd: eager, its ~80 small operations are ~80 kernels in the step's graph,
~0.3 ms of a 2-2.5 ms step on an H200 (scripts/gpu_batch_profile.py --lookup); compiled they fuse into a few.
Same operations (the eager path, which the tests run, is the reference); fused float arithmetic may round the
last bit differently, which can move a length only at a near-tie and never changes an output token.
"""
from __future__ import annotations

import numpy as np
import torch

from specpilot.engines.batch.cost import CostCurve

GOODPUT, BUDGET = 1, 2  # flag bits
SCALARS = ("flags", "k_max", "fixed_s", "token_s", "overhead_s", "budget_cap", "prior", "decay")


class DevicePolicy:
    """Per-row acceptance estimates and the step's inputs, on the device, for `rows` rows and drafts of up to
    `depth` tokens."""

    def __init__(self, rows: int, depth: int, device: str | torch.device, compiled: bool | None = None):
        """compiled: torch.compile the per-step decision (default: on CUDA)."""
        if rows < 1 or depth < 1:
            raise ValueError(f"rows={rows}, depth={depth}: both must be >= 1")
        self.rows, self.depth = rows, depth
        dev = torch.device(device)
        f64 = torch.float64
        self.successes = torch.zeros(rows, dtype=f64, device=dev)
        self.trials = torch.zeros(rows, dtype=f64, device=dev)
        # inputs: the SCALARS, then per row the tokens its request may still commit before this step (0: no
        # chain wanted), then 1 where the row was bound to a new request since the last step
        size = len(SCALARS) + 2 * rows
        self.host = torch.zeros(size, dtype=f64, pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros(size, dtype=f64, device=dev)
        self._h = self.host.numpy()
        self.curve = torch.zeros(rows * (depth + 1) + 1, dtype=f64, device=dev)  # seconds of a forward of n tokens
        self._ks = torch.arange(depth + 1, dtype=f64, device=dev)
        self._n = torch.arange(rows * depth + 1, device=dev)
        self._zero = torch.zeros(1, dtype=f64, device=dev)
        fused = dev.type == "cuda" if compiled is None else compiled
        self._decide = torch.compile(self._decide_eager, fullgraph=True, dynamic=False) if fused else self._decide_eager

    def set_curve(self, curve: CostCurve) -> None:
        """The target forward's cost curve the budget prices tokens with (not a step input: set it when it changes)."""
        table = np.asarray(curve.at(np.arange(self.curve.shape[0])), dtype=np.float64)
        self.curve.copy_(torch.from_numpy(table))

    def stage(self, *, goodput: bool, budget: bool, k_max: int, fixed_s: float, token_s: float, overhead_s: float,
              budget_cap: int, prior: float, decay: float, remaining: dict[int, int], fresh: list[int]) -> None:
        """The next launch's inputs (rows absent from `remaining` want no chain); copied to the device on the
        stream, ahead of the forward. The previous copy is done: the previous step's result has been read."""
        if k_max > self.depth:
            raise ValueError(f"k_max={k_max} exceeds the policy's depth {self.depth}")
        h, s, r = self._h, len(SCALARS), self.rows
        h[:s] = ((GOODPUT if goodput else 0) | (BUDGET if budget else 0), k_max, fixed_s, token_s, overhead_s,
                 budget_cap, prior, decay)
        h[s:] = 0.0
        for row, left in remaining.items():
            h[s + row] = left
        for row in fresh:
            h[s + r + row] = 1.0
        self.inputs.copy_(self.host, non_blocking=True)

    @torch.no_grad()
    def apply(self, proposed: torch.Tensor, accepted: torch.Tensor, drafted: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """proposed [rows] (the lookup's chain lengths for the next step), accepted and drafted [rows] (this
        step's), positions [rows] (-1: the row is not in the step) -> the lengths kept. Device work only."""
        return self._decide(proposed, accepted, drafted, positions)

    def _decide_eager(self, proposed: torch.Tensor, accepted: torch.Tensor, drafted: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        x, s, r = self.inputs, len(SCALARS), self.rows
        flags, k_max, fixed_s, token_s, overhead_s, budget_cap, prior, decay = (x[i] for i in range(s))
        remaining, fresh = x[s:s + r], x[s + r:s + 2 * r] > 0
        in_step = positions >= 0
        acc, tried = accepted.to(torch.float64), drafted.to(torch.float64)
        # AcceptanceEstimate.update, both branches at once (nothing drafted: nothing accepted, no rejection)
        succ = torch.where(fresh, 0.0, self.successes)
        trials = torch.where(fresh, 0.0, self.trials)
        succ_new = decay * succ + acc
        trials_new = decay * trials + acc + (acc < tried).to(torch.float64)
        self.successes.copy_(torch.where(in_step, succ_new, succ))
        self.trials.copy_(torch.where(in_step, trials_new, trials))
        alpha = (self.successes + prior) / (self.trials + 1.0)
        left = remaining - (acc + 1.0)  # after this step's commit (the bonus token included)
        drafting = in_step & (remaining > 0) & (left >= 1.0)
        cap = torch.where(drafting, torch.minimum(k_max, left - 1.0).clamp(min=0.0), 0.0)
        # goodput_draft_lens
        ks = self._ks
        gain = torch.cumsum(alpha[:, None] ** ks[None, :], dim=1)
        rate = gain / (torch.clamp(fixed_s, min=1e-12) + ks * torch.clamp(token_s, min=0.0))[None, :]
        rate = torch.where(ks[None, :] > cap[:, None], float("-inf"), rate)
        length = torch.where((flags.long() & GOODPUT) > 0, torch.argmax(rate, dim=1).to(torch.float64), cap)
        count = torch.minimum(proposed.to(torch.float64), length)
        keep = self._budget(alpha, count, drafting, budget_cap, overhead_s)
        return torch.where((flags.long() & BUDGET) > 0, keep, count).long()

    def _budget(self, alpha, count, drafting, budget_cap, overhead_s) -> torch.Tensor:
        """allocate_verify_budget: slots best first (value desc, then depth, then row), the count maximising the
        step's expected tokens per second."""
        r, k = self.rows, self.depth
        depth = self._ks[1:]
        value = alpha[None, :] ** depth[:, None]  # [depth, rows]: depth-major, as the host's tie order
        value = torch.where(depth[:, None] <= count[None, :], value, -1.0).reshape(-1)
        ordered, order = torch.sort(value, descending=True, stable=True)
        taken = ordered >= 0
        gain = torch.cat([self._zero, torch.cumsum(torch.where(taken, ordered, 0.0), dim=0)])
        n = self._n
        decode = drafting.sum()
        ok = (n <= taken.sum()) & ((budget_cap <= 0) | (n <= budget_cap))
        rate = (decode.to(torch.float64) + gain) / (self.curve[decode + n] + overhead_s)
        best = torch.argmax(torch.where(ok, rate, float("-inf")))
        kept = (n[:r * k] < best).to(torch.float64)
        return torch.zeros(r, dtype=torch.float64, device=alpha.device).scatter_add_(0, order % r, kept)
