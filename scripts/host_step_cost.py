"""Host-side (Python) cost of one speculative step, separate from model compute, on CPU.

python3 scripts/host_step_cost.py [--tokens N] [--block 16] [--verify chain|tree] [--profile]
A tiny random target and a random block drafter of `block` slots run SpecEngine.generate; the model calls
(the target's forward, the drafter's draft and observe forwards) are timed and subtracted from each step's wall
time. What is left is what the engine does on the host around them (drafting the chain/tree, verify inputs,
acceptance, commit, observe bookkeeping, traces): on a GPU with CUDA graphs that work sits between replays while
the device idles. --profile prints cProfile's top functions of the generation.
"""
import argparse
import cProfile
import json
import pstats
import time

import torch

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig, VerifyMode
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import LlamaShape

SHAPE = LlamaShape(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, rms_eps=1e-5,
                   rope_theta=10000.0, tie_embeddings=False)


class ComputeClock:
    """Wraps callables so their time is summed per phase ("draft": inside a step's draft_s, "verify": inside its
    verify_s), counting only once `armed` (the decode steps, not the prefill)."""

    def __init__(self):
        self.armed, self.seconds, self.calls = False, {"draft": 0.0, "verify": 0.0}, 0

    def wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.armed:
                    self.seconds[phase] += time.perf_counter() - t
                    self.calls += 1
        return timed


def measure(engine, prompt: list[int], tokens: int) -> dict:
    clock = ComputeClock()
    runner, drafter = engine.target, engine.drafter
    runner._step_fn = clock.wrap(runner._step_fn, "verify")
    drafter.step.draft = clock.wrap(drafter.step.draft, "draft")
    drafter.step.project = clock.wrap(drafter.step.project, "verify")  # observe runs inside verify_s
    propose = drafter.propose

    def arm_then_propose(*args):  # the first proposal starts the decode steps
        clock.armed = True
        return propose(*args)
    drafter.propose = arm_then_propose
    r = engine.generate(prompt, tokens)  # the wrappers stay: callers build a fresh engine per measurement
    n = len(r.steps)
    us = lambda seconds: round(1e6 * seconds / n, 1)  # noqa: E731  (per step)
    wall = {"draft": sum(s.draft_s for s in r.steps), "verify": sum(s.verify_s for s in r.steps)}
    compute = sum(clock.seconds.values())
    return {"steps": n, "tokens_per_step": round(r.accepted_per_step, 3),
            "wall_us_per_step": us(sum(wall.values())), "compute_us_per_step": us(compute),
            "host_us_per_step": us(sum(wall.values()) - compute),
            "host_us_in_draft_s": us(wall["draft"] - clock.seconds["draft"]),
            "host_us_in_verify_s": us(wall["verify"] - clock.seconds["verify"]),
            "compute_calls_per_step": round(clock.calls / n, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--verify", default="chain", choices=["chain", "tree"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = random_model(SHAPE, torch.float32, "cpu", seed=0)
    drafter = BlockDrafterModel(BlockDrafterConfig.for_target(SHAPE, layers=1, block_size=args.block)).init_weights(0)
    cfg = EngineConfig(dtype="float32", drafter=DrafterKind.BLOCK, block_size=args.block, max_seq_len=1024,
                       verify=VerifyMode(args.verify), kernel_backend="torch")
    prompt = torch.randint(3, SHAPE.vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.profile:
        engine = build_engine(cfg, target, frozenset(), "cpu", block_drafter=drafter)
        engine.generate(prompt, 16)
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(prompt, args.tokens)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    runs = []
    for _ in range(args.repeats):  # a fresh engine each time: the clock's wrappers stay out of the next run
        engine = build_engine(cfg, target, frozenset(), "cpu", block_drafter=drafter)
        engine.generate(prompt, 16)  # warm-up
        runs.append(measure(engine, prompt, args.tokens))
    best = min(runs, key=lambda r: r["host_us_per_step"])  # least disturbed by other jobs on the machine
    print(json.dumps({"verify": args.verify, "block": args.block, "best_of": args.repeats, **best,
                      "host_us_per_step_all": [r["host_us_per_step"] for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
