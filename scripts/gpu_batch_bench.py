"""Batched serving on the H200: SmolLM2-135M at concurrency 16, 20, 24 (issue 7's acceptance run).

AR batched vs stock batched speculative decoding (n-gram, draft length 5) vs each batching mechanism alone vs
all of them, on the five benchmarks' prompts, all-at-once and Poisson arrivals. Every request's output is
checked against its single-request AR output (SpecEngine, kernel_backend=triton): exit code 3 on a mismatch.
Writes JSON to OUT and prints a short table last.

Usage (PYTHONPATH=repo root; needs torch, triton, transformers only):
  python scripts/gpu_batch_bench.py MODEL_DIR OUT.json [--max-new-tokens 2048] [--concurrency 16,20,24]
  python scripts/gpu_batch_bench.py --random OUT.json   # random SmolLM2-135M weights: speed of the machinery only
  python scripts/gpu_batch_bench.py --tiny OUT.json     # CPU, Triton interpreter, a micro model: the logic only
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the Triton kernels must be built for the interpreter before they are imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from specpilot.bench.batched import (ALL_LABEL, AR_LABEL, STOCK_LABEL, Arrival, block_variants,  # noqa: E402
                                     format_concurrency_report, interleave, run_concurrency_bench, standard_variants)
from specpilot.engines.batch import MECHANISMS, BatchConfig, CostCurve  # noqa: E402
from specpilot.engines.build import build_engine  # noqa: E402
from specpilot.engines.config import DrafterKind, EngineConfig  # noqa: E402
from specpilot.engines.loader import eos_ids, load_model, load_tokenizer, random_model  # noqa: E402
from specpilot.engines.shapes import SMOLLM2_135M, LlamaShape  # noqa: E402

MICRO = LlamaShape(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=16, intermediate=64, rms_eps=1e-5,
                   rope_theta=10000.0, tie_embeddings=False)


def benchmark_prompts(tokenizer, per_benchmark: int, directory: str | None = None) -> list[tuple[str, list[int]]]:
    """The validate prompts of all five benchmarks, interleaved (any first n requests mix the benchmarks)."""
    from specpilot.workload import ALL_BENCHMARKS, WorkloadSpec, apply_chat_template
    wl = WorkloadSpec(benchmarks=tuple(b.value for b in ALL_BENCHMARKS), prompts_per_benchmark=per_benchmark,
                      max_new_tokens=1)
    order = interleave(list(wl.select(directory).validate), lambda p: p.benchmark)
    return [(p.key, apply_chat_template(tokenizer, p.text)) for p in order]


def synthetic_prompts(vocab: int, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """Prompts that repeat a random phrase (the n-gram drafter finds matches), distinct per request."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, vocab, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
        out.append((f"synthetic/{i}", phrase * 3 + torch.randint(3, vocab, (5,), generator=g).tolist()))
    return out


def micro_model(seed: int = 0):
    m = random_model(MICRO, torch.float32, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # larger weights than the default init: input-dependent, varied greedy output
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 0.35))
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", help="SmolLM2-135M model directory (safetensors + tokenizer)")
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--random", action="store_true", help="random SmolLM2-135M weights, synthetic prompts")
    ap.add_argument("--tiny", action="store_true", help="CPU + Triton interpreter + micro model (logic check)")
    ap.add_argument("--concurrency", default=None, help="default 16,20,24 (tiny: 2)")
    ap.add_argument("--arrival", default="all,poisson")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 2048 (tiny: 6)")
    ap.add_argument("--per-benchmark", type=int, default=None, help="prompts per benchmark (default: enough for "
                    "the largest concurrency)")
    ap.add_argument("--requests", type=int, default=None, help="requests per concurrency (default: the concurrency; "
                    "more keep the batch full while the first ones finish)")
    ap.add_argument("--mechanisms", default=",".join([*MECHANISMS, ALL_LABEL]))
    ap.add_argument("--cost-curve", default=None, help="JSON [[tokens, seconds], ...]; default: measured")
    ap.add_argument("--cost-context", type=int, default=None, help="keys a row attends to in the measured cost "
                    "curve (default: mean prompt + half the new tokens)")
    ap.add_argument("--benchmarks-dir", default=None, help="the five JSONL files (default $SPECPILOT_BENCHMARKS, "
                    "../shared/benchmarks, /work/shared/benchmarks)")
    ap.add_argument("--engine", default=None, help="JSON of EngineConfig fields for every engine (e.g. a tuned "
                    "kernel_table or weight_format); drafter and kernel_backend are set here")
    ap.add_argument("--batch", default=None, help="JSON of BatchConfig fields for every variant (e.g. max_draft_len, "
                    "graph_max_tokens); the mechanisms are turned on per variant here")
    ap.add_argument("--drafter", default=None, help="a block drafter checkpoint directory: adds the batched block "
                    "drafter's variants (alone, led by prompt lookup, and that with goodput draft lengths)")
    ap.add_argument("--drafter-variants", default=None, help="which of --drafter's variants to run (default: all of "
                    "block, block+lookup, block+lookup+goodput, block+lookup+goodput+budget)")
    ap.add_argument("--profile", type=int, default=0, help="print the N host functions with the most own time "
                    "(cProfile over the whole bench: graph capture, cost curve and warm-up included)")
    ap.add_argument("--save-outputs", default=None, help="write the single-request AR outputs here, as "
                    "{key: {prompt, out}} (scripts/host_batch_cost.py --outputs replays them on a CPU)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not (a.tiny or a.random or a.model_dir):
        ap.error("give MODEL_DIR, --random or --tiny")
    conc = [int(x) for x in (a.concurrency or ("2" if a.tiny else "16,20,24")).split(",")]
    max_new = a.max_new_tokens or (6 if a.tiny else 2048)
    n_prompts = max(max(conc), a.requests or 0)
    device = "cpu" if a.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --tiny on CPU)")
    t_start = time.perf_counter()
    if a.tiny:
        model, eos, dtype = micro_model(a.seed), frozenset(), "float32"
        prompts = synthetic_prompts(MICRO.vocab, n_prompts)
    elif a.random:
        model = random_model(SMOLLM2_135M, torch.bfloat16, device, seed=a.seed)
        eos, prompts, dtype = frozenset(), synthetic_prompts(SMOLLM2_135M.vocab, n_prompts), "bfloat16"
    else:
        tok = load_tokenizer(Path(a.model_dir))
        model, dtype = load_model(Path(a.model_dir), torch.bfloat16, device), "bfloat16"
        eos = eos_ids(Path(a.model_dir), tok)
        prompts = benchmark_prompts(tok, a.per_benchmark or -(-n_prompts // 5), a.benchmarks_dir)
    longest = max(len(ids) for _, ids in prompts)
    max_seq_len = -(-(longest + max_new + 64) // 256) * 256
    ar_cfg = EngineConfig.from_dict({"dtype": dtype, "max_seq_len": max_seq_len, "cuda_graphs": device == "cuda",
                                     **json.loads(a.engine or "{}"), "drafter": "none", "kernel_backend": "triton"})
    spec_cfg = ar_cfg.replace(drafter=DrafterKind.NGRAM)  # stock n-gram: draft_len 5, ngram 4..1
    print(f"{len(prompts)} prompts (longest {longest}), {max_new} new tokens, max_seq_len {max_seq_len}", flush=True)

    # Single-request AR reference: the existing engine, one request at a time.
    single = build_engine(ar_cfg, model, eos, device)
    single.generate(list(prompts[0][1]), 4)
    reference, t0 = {}, time.perf_counter()
    for key, ids in prompts:
        reference[key] = single.generate(list(ids), max_new).tokens
    single_s = time.perf_counter() - t0
    single_tokens = sum(len(t) for t in reference.values())
    print(f"single-request AR: {single_tokens} tokens in {single_s:.1f}s ({single_tokens / single_s:.0f} tok/s)",
          flush=True)
    del single
    if a.save_outputs:
        Path(a.save_outputs).parent.mkdir(parents=True, exist_ok=True)
        Path(a.save_outputs).write_text(json.dumps({k: {"prompt": list(ids), "out": reference[k]}
                                                    for k, ids in prompts}))
    if device == "cuda":
        torch.cuda.empty_cache()

    mechanisms = [m for m in a.mechanisms.split(",") if m]
    base = BatchConfig.from_dict({**json.loads(a.batch or "{}"), "max_batch": max(conc)})
    variants = standard_variants(ar_cfg, spec_cfg, mechanisms, base)
    drafter = None
    if a.drafter:
        from specpilot.drafting.checkpoint import load_drafter
        drafter = load_drafter(a.drafter, model)
        ours = block_variants(ar_cfg, drafter.config.block_size, base)
        wanted = set(a.drafter_variants.split(",")) if a.drafter_variants else {v.label for v in ours}
        if wanted - {v.label for v in ours}:
            ap.error(f"unknown --drafter-variants {sorted(wanted - {v.label for v in ours})}")
        variants += [v for v in ours if v.label in wanted]
    curve = CostCurve(tuple(tuple(p) for p in json.loads(Path(a.cost_curve).read_text()))) if a.cost_curve else None
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "model": a.model_dir or ("random-smollm2-135m" if a.random else "micro"), "max_new_tokens": max_new,
           "concurrency": conc, "prompts": [k for k, _ in prompts],
           "single_ar": {"tokens": single_tokens, "seconds": single_s}}
    prof = cProfile.Profile() if a.profile else None
    with torch.no_grad(), (prof or contextlib.nullcontext()):
        report = run_concurrency_bench(model, eos, prompts, max_new, conc, [Arrival(x) for x in a.arrival.split(",")],
                                       variants, device, requests=a.requests, rate=None, seed=a.seed, cost_curve=curve,
                                       reference=reference, progress=lambda s: print(s, flush=True),
                                       cost_repeats=1 if a.tiny else 5, block_drafter=drafter,
                                       cost_context=a.cost_context)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
    out["report"] = report.to_dict()
    out["summary"] = summary(report)
    out["total_s"] = time.perf_counter() - t_start
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(format_concurrency_report(report))
    print()
    print(short_table(out["summary"]))
    return 0 if report.all_match() else 3


def summary(report) -> list[dict]:
    """Per (concurrency, arrival): AR tok/s, each variant's speedup over AR and over stock, all outputs equal."""
    rows = []
    for c, arrival in dict.fromkeys((r.concurrency, r.arrival) for r in report.rows):
        group = {r.variant: r for r in report.rows if (r.concurrency, r.arrival) == (c, arrival)}
        rows.append({"concurrency": c, "arrival": arrival, "ar_tok_s": group[AR_LABEL].throughput,
                     "vs_ar": {v: r.speedup_vs_ar for v, r in group.items() if v != AR_LABEL},
                     "vs_stock": {v: r.speedup_vs_stock for v, r in group.items() if v not in (AR_LABEL, STOCK_LABEL)},
                     "tokens_per_step": {v: r.tokens_per_step for v, r in group.items()},
                     "all_equal_single_ar": all(r.matches_ar for r in group.values())})
    return rows


def short_table(rows: list[dict]) -> str:
    variants = [v for v in rows[0]["vs_ar"]] if rows else []
    head = ("| conc | arrival | AR tok/s | " + " | ".join(f"{v} vs AR" for v in variants)
            + " | all vs stock | best vs stock | lossless |")
    lines = [head, "|---" * (4 + len(variants) + 2) + "|"]
    for r in rows:
        cells = " | ".join(f"{r['vs_ar'][v]:.2f}x" for v in variants)
        vs_stock = r["vs_stock"].get(ALL_LABEL)
        best = max(r["vs_stock"].items(), key=lambda kv: kv[1] or 0.0, default=None)
        lines.append(f"| {r['concurrency']} | {r['arrival']} | {r['ar_tok_s']:.0f} | {cells} | "
                     f"{'-' if vs_stock is None else f'{vs_stock:.2f}x'} | "
                     f"{'-' if not best or best[1] is None else f'{best[1]:.2f}x ({best[0]})'} | "
                     f"{'yes' if r['all_equal_single_ar'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
