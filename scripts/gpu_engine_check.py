"""H200 engine check: AR step time per execution mode, transformers' best AR, and AR == n-gram spec in bf16.

Usage (device host): python scripts/gpu_engine_check.py MODEL_DIR OUT_DIR [--tokens N] [--kernel-table NAME=FILE ...]

--kernel-table adds a mode triton_graph_NAME: the Triton graph engine with that kernel table (a tuner's summary.json
or a pair list), its tokens compared with triton_graph's (a table that changes a reduction order may change them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import eos_ids, load_model, load_tokenizer
from specpilot.kernels.table import read_pairs


def timed_generate(engine, ids, n):
    torch.cuda.synchronize()
    r = engine.generate(ids, n)
    torch.cuda.synchronize()
    return r


def hf_best_ar(model_dir, ids, n):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    inp = torch.tensor([ids], device="cuda")
    # transformers compiles the forward itself when generating with a static cache on CUDA.
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
    for _ in range(2):
        m.generate(inp, **kw)
    torch.cuda.synchronize(); t = time.perf_counter()
    out = m.generate(inp, **kw)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t), out[0, len(ids):].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir"); ap.add_argument("out_dir"); ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--modes", default="torch_graph_tile16,torch_graph_t1_fast,triton_eager,triton_graph")
    ap.add_argument("--skip-checks", action="store_true", help="no AR == n-gram loop (the bench checks it)")
    ap.add_argument("--kernel-table", action="append", default=[], metavar="NAME=FILE")
    a = ap.parse_args()
    out = Path(a.out_dir); out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(a.model_dir)
    eos = eos_ids(a.model_dir, tok)
    model = load_model(a.model_dir, torch.bfloat16, "cuda")
    bench = Path(os.environ.get("SPECPILOT_BENCHMARKS", "../shared/benchmarks"))
    prompts = []
    for f, field in (("gsm8k.test.jsonl", "question"), ("humaneval.jsonl", "prompt"), ("mt_bench.questions.jsonl", "turns")):
        row = json.loads((bench / f).read_text().splitlines()[0])
        text = row[field][0] if field == "turns" else row[field]
        prompts.append(list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]))
    rows = []
    base = EngineConfig(drafter=DrafterKind.NONE, max_seq_len=4096)
    modes = {
        "torch_graph_tile16": base,
        "torch_graph_t1_fast": base.replace(batch_invariant=False),
        "triton_eager": base.replace(kernel_backend="triton", cuda_graphs=False),
        "triton_graph": base.replace(kernel_backend="triton"),
        "triton_graph_w12": base.replace(kernel_backend="triton", weight_format="w12"),  # tokens must equal triton_graph's
    }
    outs = {}
    modes = {k: v for k, v in modes.items() if k in a.modes.split(",")}
    for spec in a.kernel_table:
        name, path = spec.split("=", 1)
        modes[f"triton_graph_{name}"] = base.replace(kernel_backend="triton", kernel_table=read_pairs(path))
    for name, cfg in modes.items():
        eng = build_engine(cfg, model, frozenset(), "cuda")
        n = 64 if "eager" in name else a.tokens
        timed_generate(eng, prompts[0], n)  # same request size: the same graphs as the timed run
        r = timed_generate(eng, prompts[0], n)
        outs[name] = r.tokens
        rows.append({"mode": name, "tok_s": n / r.decode_s, "ms_per_tok": 1e3 * r.decode_s / n})
        if name.startswith("triton_graph_") and "triton_graph" in outs:
            same = next((i for i, (x, y) in enumerate(zip(r.tokens, outs["triton_graph"])) if x != y), None)
            rows[-1]["equal_to_triton_graph"] = same is None and len(r.tokens) == len(outs["triton_graph"])
            rows[-1]["first_difference"] = same
        print(rows[-1], flush=True)
    if not a.skip_hf:
        try:
            tps, hf_tokens = hf_best_ar(a.model_dir, prompts[0], a.tokens)
            rows.append({"mode": "transformers_static_compile", "tok_s": tps, "ms_per_tok": 1e3 / tps})
            outs["hf"] = hf_tokens
        except Exception as e:  # report, keep going: the engine numbers matter more
            print("transformers baseline failed:", repr(e)[:500])
    # Exactness: AR vs n-gram speculative, bf16, same tile.
    checks = []
    for backend in () if a.skip_checks else ("triton", "torch"):
        for k in (5, 10):
            ar = build_engine(base.replace(kernel_backend=backend), model, eos, "cuda")
            sp = build_engine(base.replace(kernel_backend=backend, drafter=DrafterKind.NGRAM, draft_len=k), model, eos, "cuda")
            for i, p in enumerate(prompts):
                ra = timed_generate(ar, p, a.tokens); rs = timed_generate(sp, p, a.tokens)
                checks.append({"tile": backend, "compile": k, "prompt": i, "equal": ra.tokens == rs.tokens,
                               "n": len(ra.tokens), "ar_tok_s": len(ra.tokens) / ra.decode_s,
                               "spec_tok_s": len(rs.tokens) / rs.decode_s, "acc": rs.accepted_per_step})
                print(checks[-1], flush=True)
    (out / "engine_check.json").write_text(json.dumps({"rows": rows, "checks": checks}, indent=1))
    print("\n| mode | tok/s | ms/tok |\n|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tok_s']:.0f} | {r['ms_per_tok']:.3f} |"
              + (f" tokens equal to triton_graph: {r['equal_to_triton_graph']} (first difference at "
                 f"{r['first_difference']})" if "equal_to_triton_graph" in r else ""))
    print("| backend | draft_len | prompt | equal | AR tok/s | spec tok/s | tokens/step |")
    for c in checks:
        print(f"| {c['tile']} | {c['compile']} | {c['prompt']} | {c['equal']} | {c['ar_tok_s']:.0f} | {c['spec_tok_s']:.0f} | {c['acc']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
