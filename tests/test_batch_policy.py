"""Mechanisms a and b on the device (engines/batch/device_policy.py): the same estimates, draft lengths and budget
as the host functions (mechanisms.py) from the same numbers, step after step, hand-built edge cases included."""
from __future__ import annotations

import random

import pytest
import torch

from specpilot.engines.batch import CostCurve
from specpilot.engines.batch.device_policy import DevicePolicy
from specpilot.engines.batch.mechanisms import AcceptanceEstimate, allocate_verify_budget, goodput_draft_lens

CURVE = CostCurve(((1, 0.00106), (16, 0.00111), (32, 0.0013), (64, 0.00151), (128, 0.00186), (256, 0.00243)))
PRIOR, DECAY = 0.5, 0.7


def host_step(est, remaining, in_step, proposed, drafted, accepted, k_max, fixed_s, token_s, overhead_s, cap_b,
              goodput, budget):
    """The host engine's decisions for the same step, row by row (None: the row is not in the step)."""
    rows = len(est)
    for r in range(rows):
        if in_step[r]:
            est[r].update(drafted[r], accepted[r])
    drafting = [r for r in range(rows) if in_step[r] and remaining[r] > 0 and remaining[r] - accepted[r] - 1 >= 1]
    caps = [min(k_max, remaining[r] - accepted[r] - 2) for r in drafting]
    alphas = [est[r].alpha for r in drafting]
    lengths = goodput_draft_lens(alphas, caps, fixed_s, token_s) if goodput else caps
    counts = [min(proposed[r], n) for r, n in zip(drafting, lengths)]
    if budget:
        counts = allocate_verify_budget(alphas, counts, len(drafting), CURVE, overhead_s, cap_b)
    out = [0] * rows
    for r, n in zip(drafting, counts):
        out[r] = n
    return out


@pytest.mark.parametrize("goodput,budget", [(True, False), (False, True), (True, True), (False, False)])
def test_device_policy_equals_the_host_mechanisms_over_steps(goodput, budget):
    rng = random.Random(7)
    rows, depth = 6, 12
    pol = DevicePolicy(rows, depth, "cpu")
    pol.set_curve(CURVE)
    est = [AcceptanceEstimate(PRIOR, DECAY) for _ in range(rows)]
    for step in range(40):
        fresh = [r for r in range(rows) if rng.random() < 0.1]
        for r in fresh:
            est[r] = AcceptanceEstimate(PRIOR, DECAY)
        in_step = [rng.random() < 0.85 for _ in range(rows)]
        remaining = [rng.choice([0, 1, 2, 3, 40, 300]) for _ in range(rows)]
        drafted = [rng.randrange(0, depth + 1) for _ in range(rows)]
        # mostly all-or-nothing, as a lookup's chains go
        accepted = [d if rng.random() < 0.6 else rng.randrange(0, d + 1) for d in drafted]
        proposed = [rng.randrange(0, depth + 1) for _ in range(rows)]
        k_max = rng.choice([depth, 5])
        fixed_s, token_s, overhead_s = rng.uniform(2e-5, 2e-4), rng.uniform(0, 1e-5), rng.uniform(0, 5e-4)
        cap_b = rng.choice([0, 0, 7])
        want = host_step(est, remaining, in_step, proposed, drafted, accepted, k_max, fixed_s, token_s, overhead_s,
                         cap_b, goodput, budget)
        pol.stage(goodput=goodput, budget=budget, k_max=k_max, fixed_s=fixed_s, token_s=token_s,
                  overhead_s=overhead_s, budget_cap=cap_b, prior=PRIOR, decay=DECAY,
                  remaining={r: n for r, n in enumerate(remaining) if n}, fresh=fresh)
        got = pol.apply(torch.tensor(proposed), torch.tensor(accepted), torch.tensor(drafted),
                        torch.tensor([5 if s else -1 for s in in_step]))
        assert got.tolist() == want, f"step {step}"
        assert [pol.successes[r].item() for r in range(rows)] == [e.successes for e in est]
        assert [pol.trials[r].item() for r in range(rows)] == [e.trials for e in est]


def test_device_policy_edge_cases():
    pol = DevicePolicy(3, 4, "cpu")
    pol.set_curve(CURVE)

    def step(proposed, accepted, drafted, positions, remaining, **kw):
        args = dict(goodput=True, budget=False, k_max=4, fixed_s=1e-4, token_s=1e-6, overhead_s=0.0, budget_cap=0,
                    prior=PRIOR, decay=DECAY, fresh=[])
        args.update(kw)
        pol.stage(remaining=remaining, **args)
        return pol.apply(torch.tensor(proposed), torch.tensor(accepted), torch.tensor(drafted),
                         torch.tensor(positions)).tolist()

    # a row out of the step, a row at its token limit after this step, a row wanting no chain: no draft
    assert step([4, 4, 4], [0, 2, 0], [0, 2, 0], [-1, 9, 9], {0: 50, 1: 3}) == [0, 0, 0]
    # cheap tokens and a perfect history: the longest draft the lookup has; capped by the token limit
    for _ in range(5):
        step([4, 4, 4], [4, 4, 4], [4, 4, 4], [9, 9, 9], {0: 50, 1: 50, 2: 50})
    assert step([4, 2, 4], [4, 4, 4], [4, 4, 4], [9, 9, 9], {0: 50, 1: 50, 2: 8}) == [4, 2, 2]
    # a fresh request starts from the prior again; its old history is gone
    before = pol.successes.tolist()
    step([4, 4, 4], [0, 0, 0], [0, 0, 0], [9, 9, 9], {0: 50}, fresh=[0])
    assert pol.successes[0].item() == 0.0 and pol.successes[1].item() == pytest.approx(before[1] * DECAY)
    # the budget's hard cap bounds the step's draft tokens: equal histories, so shallower slots first, then rows
    # in order (row 0 wants no chain)
    assert step([4, 4, 4], [4, 4, 4], [4, 4, 4], [9, 9, 9], {1: 50, 2: 50}, budget=True, budget_cap=3,
                goodput=False) == [0, 2, 1]
    with pytest.raises(ValueError, match="depth"):
        step([0, 0, 0], [0, 0, 0], [0, 0, 0], [9, 9, 9], {}, k_max=5)


def test_compiled_policy_and_extrapolation_equal_eager():
    """The CUDA path torch.compiles the decision and extrapolate_rows (device_policy.py); here Inductor's CPU code
    against eager, step after step, on the same inputs (both policies keep their own estimates)."""
    from specpilot.engines.batch.ngram_drafting import extrapolate_rows
    rng = torch.Generator().manual_seed(3)
    rows, depth = 8, 12
    eager, fused = DevicePolicy(rows, depth, "cpu"), DevicePolicy(rows, depth, "cpu", compiled=True)
    for pol in (eager, fused):
        pol.set_curve(CURVE)
    for step in range(12):
        remaining = {r: int(n) for r, n in enumerate(torch.randint(0, 60, (rows,), generator=rng)) if n % 7}
        fresh = [step % rows]
        for pol in (eager, fused):
            pol.stage(goodput=step % 3 != 1, budget=step % 2 == 0, k_max=depth, fixed_s=1e-3, token_s=6e-6,
                      overhead_s=4e-4, budget_cap=0 if step % 4 else 9, prior=PRIOR, decay=DECAY,
                      remaining=remaining, fresh=fresh)
        drafted = torch.randint(0, depth + 1, (rows,), generator=rng)
        accepted = torch.minimum(drafted, torch.randint(0, depth + 1, (rows,), generator=rng))
        args = (torch.randint(0, depth + 1, (rows,), generator=rng), accepted, drafted,
                torch.randint(-1, 50, (rows,), generator=rng))
        assert eager.apply(*args).tolist() == fused.apply(*args).tolist(), f"step {step}"
        assert torch.equal(eager.successes, fused.successes) and torch.equal(eager.trials, fused.trials)
    # extrapolate_rows over counting loops (a period of 4-9 tokens, one of them a count going up by 1-3 a period),
    # where the lookup's match is one period back, and over random rows (no period: left as they are)
    fused_rows = torch.compile(extrapolate_rows, fullgraph=True, dynamic=False)
    width = 200 + depth + 2
    tokens = torch.randint(0, 50, (rows, width), generator=rng)
    length, first = torch.full((rows,), 150), torch.full((rows,), 140)
    drafts = torch.randint(0, 50, (rows, depth), generator=rng)
    proposed = torch.randint(1, depth + 1, (rows,), generator=rng)
    for r in range(rows // 2):
        period = 4 + r
        pattern = torch.randint(0, 50, (period,), generator=rng)
        step_by = 1 + r % 3
        seq = torch.cat([torch.cat([pattern[:1], torch.tensor([200 + step_by * i]), pattern[2:]]) for i in range(40)])
        tokens[r, :150] = seq[:150]
        first[r] = 150 - period
        k = min(period, depth)
        drafts[r, :k], proposed[r] = tokens[r, 150 - period:150 - period + k], k
    want, count = extrapolate_rows(tokens, length, first, drafts, proposed, 49152)
    got, got_count = fused_rows(tokens, length, first, drafts, proposed, 49152)
    assert torch.equal(got, want) and torch.equal(got_count, count)
    continued = (want != drafts).any(1)
    assert continued[:rows // 2].all() and not continued[rows // 2:].any()
