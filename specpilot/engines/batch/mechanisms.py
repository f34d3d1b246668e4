"""The batching mechanisms' decisions: per-request draft length (a) and the per-step verify budget (b).

Both price a verify token with the cost curve and value it by the probability that it is accepted. A
request's per-token acceptance alpha is estimated from its recent steps (a decayed count of accepted draft
tokens over draft tokens tried, a chain stopping at its first rejection): the j-th draft token of a chain is
accepted with probability alpha^j, and a step commits 1 + sum_j alpha^j tokens in expectation.
Pure functions over numbers: no model, no device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specpilot.engines.batch.cost import CostCurve


@dataclass
class AcceptanceEstimate:
    """A request's per-token acceptance from its recent steps: decayed successes / decayed trials, with a
    prior worth one trial (so a fresh request starts at `prior` and alpha never reaches 1)."""

    prior: float
    decay: float
    successes: float = 0.0
    trials: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.successes + self.prior) / (self.trials + 1.0)

    def update(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` draft tokens and accepted the first `accepted` of them."""
        if drafted <= 0:
            # Nothing tried (no proposal, or the mechanisms cut the draft to nothing): no evidence, but the old
            # evidence fades, back toward the prior. Otherwise a request whose estimate once fell so low that it got
            # no draft would never draft again, whatever its text did next (CPU replay of SmolLM2's outputs: the
            # verify budget alone went from 0.87x to 0.99x stock at concurrency 24).
            self.successes, self.trials = self.decay * self.successes, self.decay * self.trials
            return
        rejected = 1 if accepted < drafted else 0  # the chain stops at its first rejection
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + rejected


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a chain of k draft tokens commits in expectation: 1 (bonus) + alpha + ... + alpha^k."""
    return float(1.0 + sum(alpha ** j for j in range(1, k + 1)))


def goodput_draft_lens(alphas, caps, fixed_s: float, token_s: float) -> list[int]:
    """Per request, the draft length in 0..cap maximising expected tokens per second of its share of a step:
    (1 + alpha + .. + alpha^k) / (fixed_s + k * token_s). fixed_s is a request's share of the step's fixed
    cost, token_s the marginal cost of one more verify token (the cost curve's slope at the batch's size).
    Vectorised over requests (it runs every step for every request)."""
    alphas, caps = np.asarray(alphas, dtype=float), np.asarray(caps, dtype=int)
    if caps.size == 0 or caps.max() <= 0:
        return [0] * int(caps.size)
    ks = np.arange(int(caps.max()) + 1)
    gain = np.cumsum(alphas[:, None] ** ks[None, :], axis=1)  # alpha^0 = 1: the bonus token
    rate = gain / (max(fixed_s, 1e-12) + ks * max(token_s, 0.0))[None, :]
    rate[ks[None, :] > caps[:, None]] = -np.inf
    return np.argmax(rate, axis=1).tolist()  # first maximum: ties go to the shorter draft


def goodput_draft_len(alpha: float, k_max: int, fixed_s: float, token_s: float) -> int:
    """goodput_draft_lens for one request."""
    return goodput_draft_lens([alpha], [k_max], fixed_s, token_s)[0]


def request_costs(curve: CostCurve, overhead_s: float, batch: int, tokens: int) -> tuple[float, float]:
    """(fixed_s, token_s) for goodput_draft_len: one request's share of a step of `batch` requests (its
    forward at one token each plus the host's per-step overhead), and the marginal cost of a verify token
    around `tokens` tokens in the forward. A larger batch shrinks each request's fixed share, so draft tokens
    must clear a higher bar: the draft length is batch-size aware."""
    batch = max(1, batch)
    return (float(curve.at(batch)) + overhead_s) / batch, curve.slope(max(tokens, batch))


def allocate_verify_budget(alphas: list[float], proposed: list[int], base_tokens: int, curve: CostCurve,
                           overhead_s: float, cap: int = 0) -> list[int]:
    """How many of its proposed draft tokens each request verifies this step (mechanism b).

    Every (request r, position j <= proposed[r]) slot is worth alpha_r^j expected tokens; slots are taken
    best first (ties: shallower first, so each request keeps a prefix of its chain) and the step's budget n
    is the count maximising (decode requests + expected accepted) / (curve(base_tokens + n) + overhead):
    expected tokens per second of the step. base_tokens counts the tokens that are in the forward anyway
    (every decode request's pending token, prefill chunks). cap > 0 bounds n."""
    if not proposed or max(proposed, default=0) == 0:
        return [0] * len(proposed)
    counts = np.asarray(proposed)
    req = np.repeat(np.arange(len(proposed)), counts)
    depth = (np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts) + 1).astype(float)  # 1..k each
    value = np.asarray(alphas, dtype=float)[req] ** depth
    order = np.lexsort((req, depth, -value))  # by value desc, then depth asc, then request
    gain = np.concatenate([[0.0], np.cumsum(value[order])])
    n = np.arange(len(gain))
    if cap > 0:
        gain, n = gain[:cap + 1], n[:cap + 1]
    decode = len(proposed)
    rate = (decode + gain) / (np.asarray(curve.at(base_tokens + n)) + overhead_s)
    best = int(np.argmax(rate))
    return np.bincount(req[order[:best]], minlength=len(proposed)).tolist()
