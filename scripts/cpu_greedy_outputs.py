"""Greedy outputs of a model on the benchmark prompts, for scripts/host_batch_cost.py --outputs (CPU, transformers).

The batched bench's prompts (gpu_batch_bench.benchmark_prompts: the validate prompts of the five benchmarks,
interleaved), each generated greedily to EOS or --max-new-tokens. Written after every prompt as
{key: {"prompt": [ids], "out": [ids]}}.

Usage: python scripts/cpu_greedy_outputs.py OUT.json [--model DIR] [--per-benchmark 5] [--max-new-tokens 2048]
(DIR default: the SmolLM2-135M testbed, converted by `specpilot` into ~/.cache/specpilot/models/smollm2-135m)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from gpu_batch_bench import benchmark_prompts  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/specpilot/models/smollm2-135m")
    ap.add_argument("--per-benchmark", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--benchmarks-dir", default=None)
    a = ap.parse_args(argv)
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"no model at {a.model} (run `specpilot tune` once to fetch and convert the testbed)")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16).eval()
    out = {}
    for key, ids in benchmark_prompts(tok, a.per_benchmark, a.benchmarks_dir):
        t = time.time()
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False,
                               eos_token_id=tok.eos_token_id)
        out[key] = {"prompt": ids, "out": g[0, len(ids):].tolist()}
        print(f"{key}: {len(out[key]['out'])} tokens, {time.time() - t:.1f}s", flush=True)
        a.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
