"""Where the batched engine's per-step host time goes on the GPU host (random SmolLM2-135M weights, bf16).

On the H200 the batched AR step spent 0.33 ms of host time (outside its wait for the forward) against 0.05 ms
for the engine's loop alone on a replayed runner (scripts/host_batch_cost.py): the rest is the runner's launch
and result. This times each part of BatchRunner.launch(...).result() separately, median of N, for 16 requests
x (1, 6) tokens: _fill (numpy packing), _upload (pinned host -> device copy, enqueue), the graph replay call
(host time to submit), the wait for the result, the result read (.tolist()); then launch(...).result().tolist() as one
call. Three cases: 16 x 1 and 16 x 6 tokens (one graph, replayed every step) and 16 x 4..7 cycling (a different
graph each step, as the mechanisms' varying drafts give): is switching graphs a host cost?

python3 scripts/gpu_batch_host.py OUT.json [--reps 200]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpu_batch_profile import smollm2_batch_runner  # scripts/ is on sys.path when run as scripts/gpu_batch_host.py
from specpilot.engines.batch.paged_attn import max_tiles
from specpilot.engines.batch.runner import StepEntry, bucket


def med_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def time_parts(runner, steps: list[list[StepEntry]], reps: int) -> dict[str, float]:
    """Median us of each part of a step, cycling through `steps` (one shape: the same graph every step; several:
    a different graph each step, as steps of varying drafts replay)."""
    parts = {k: [] for k in ("fill", "upload", "replay_call", "wait", "read", "launch_to_list")}
    for i in range(reps + 10):
        entries = steps[i % len(steps)]
        nb = bucket(sum(len(e.tokens) for e in entries))
        graph, out = runner._graph(nb)
        t0 = time.perf_counter()
        runner._fill(entries, nb, max_tiles(nb, runner.group, runner.B))
        t1 = time.perf_counter()
        runner._upload()
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        t4 = time.perf_counter()
        out.cpu().numpy().tolist()  # the read before the pinned result buffer
        t5 = time.perf_counter()
        if i >= 10:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                parts[k].append(v)
    for i in range(reps + 10):  # the engine's path as one call (pinned result buffer), for the total
        t0 = time.perf_counter()
        runner.launch(steps[i % len(steps)]).result().tolist()
        if i >= 10:
            parts["launch_to_list"].append(time.perf_counter() - t0)
    return {k: med_us(v) for k, v in parts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args(argv)
    runner = smollm2_batch_runner()[0]
    requests, context = 16, 1024
    pages = [runner.cache.allocate(context + 33) for _ in range(requests)]
    for r, p in enumerate(pages):
        runner.bind(r, p)
    shapes = {"16 x 1": [1], "16 x 6": [6], "16 x 4..7, cycling (another graph each step)": [4, 5, 6, 7]}
    rows = []
    with torch.no_grad():  # each bucket's graph is captured on its first step, inside the 10 untimed ones
        for label, pers in shapes.items():
            steps = [[StepEntry(r, [1] * per, context) for r in range(requests)] for per in pers]
            row = {"case": label, **time_parts(runner, steps, a.reps)}
            rows.append(row)
            print(row, flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print("| step | fill us | upload us | replay call us | wait us | read us | launch..tolist us (pinned read) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['fill']} | {r['upload']} | {r['replay_call']} | {r['wait']} | {r['read']} | "
              f"{r['launch_to_list']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
