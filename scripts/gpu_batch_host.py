"""Where the batched engine's per-step host time goes on the GPU host (random SmolLM2-135M weights, bf16).

On the H200 the batched AR step spent 0.33 ms of host time (outside its wait for the forward) against 0.05 ms
for the engine's loop alone on a replayed runner (scripts/host_batch_cost.py): the rest is the runner's launch
and result. This times each part of BatchRunner.launch(...).result() separately, median of N, for 16 requests
x (1, 6) tokens: _fill (numpy packing), _upload (pinned host -> device copy, enqueue), the graph replay call
(host time to submit), the wait for the result, the result read (.tolist()); then launch(...).result().tolist() as one call.

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args(argv)
    runner = smollm2_batch_runner()[0]
    rows = []
    with torch.no_grad():
        for requests, per, context in ((16, 1, 1024), (16, 6, 1024)):
            pages = [runner.cache.allocate(context + 33) for _ in range(requests)]
            for r, p in enumerate(pages):
                runner.bind(r, p)
            entries = [StepEntry(r, [1] * per, context) for r in range(requests)]
            nb = bucket(requests * per)
            graph, out = runner._graph(nb)
            parts = {k: [] for k in ("fill", "upload", "replay_call", "wait", "read", "launch_to_list")}
            for i in range(a.reps + 10):
                t0 = time.perf_counter()
                runner._fill(entries, nb, max_tiles(nb, runner.group, runner.B))
                t1 = time.perf_counter()
                runner._upload()
                t2 = time.perf_counter()
                graph.replay()
                t3 = time.perf_counter()
                torch.cuda.current_stream().synchronize()
                t4 = time.perf_counter()
                res = out.cpu().numpy().tolist()
                t5 = time.perf_counter()
                if i >= 10:
                    for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                        parts[k].append(v)
            for i in range(a.reps + 10):  # the engine's path as one call, for the total
                t0 = time.perf_counter()
                runner.launch(entries).result().tolist()
                if i >= 10:
                    parts["launch_to_list"].append(time.perf_counter() - t0)
            assert len(res) == runner.B
            row = {"requests": requests, "tokens_per_request": per, "bucket": nb,
                   **{k: med_us(v) for k, v in parts.items()}}
            rows.append(row)
            print(row, flush=True)
            for r, p in enumerate(pages):
                runner.unbind(r)
                runner.cache.release(p)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print("| requests x tokens | fill us | upload us | replay call us | wait us | read us | launch..tolist us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} x {r['tokens_per_request']} | {r['fill']} | {r['upload']} | {r['replay_call']} | "
              f"{r['wait']} | {r['read']} | {r['launch_to_list']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
