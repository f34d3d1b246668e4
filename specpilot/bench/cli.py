"""`specpilot bench`: AR vs speculative decoding on a deployment's workload."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specpilot.cliutil import run_standalone
from specpilot.bench.batched import add_concurrency_args, bench_concurrency
from specpilot.bench.harness import AR_FAST_LABEL, AR_LABEL, Variant, format_report, run_bench
from specpilot.bench.session import DeploymentSession
from specpilot.bench.plot import plot_speedups
from specpilot.deployments import load_deployment
from specpilot.engines.config import KernelBackend
from specpilot.workload import Benchmark, WorkloadSpec


def variants_for(session: DeploymentSession, mode: str) -> list[Variant]:
    dep = session.deployment
    out = [Variant(AR_LABEL, dep.ar_config())]
    # Also the fastest AR shapes, so speedups are not against a slow baseline; the fused Triton kernels have no
    # slower invariant shape (any width is invariant), so there the two AR runs would be the same run twice.
    ar = dep.ar_config()
    if ar.batch_invariant and ar.kernel_backend is not KernelBackend.TRITON:
        out.append(Variant(AR_FAST_LABEL, dep.ar_config().replace(batch_invariant=False)))
    if mode != "ar":
        out += [Variant(label, cfg, label) for label, cfg in dep.drafter_configs().items()]
    return out


def _bench(args: argparse.Namespace) -> int:
    dep = load_deployment(args.deployment)
    wl = dep.workload
    overrides = {}
    if args.benchmarks:
        overrides["benchmarks"] = tuple(args.benchmarks)
    if args.prompts_per_benchmark:
        overrides["prompts_per_benchmark"] = args.prompts_per_benchmark
    if args.max_new_tokens:
        overrides["max_new_tokens"] = args.max_new_tokens
    wl = WorkloadSpec(**{**wl.__dict__, **overrides})
    if args.what == "kernels":
        from specpilot.kernels.bench import bench_kernels, format_kernel_table
        rows = bench_kernels(_target_shape(dep), tokens_list=(1, 16))
        print(json.dumps(rows, indent=1) if args.json else format_kernel_table(rows))
        return 0
    session = DeploymentSession(dep, device=args.device)
    split = wl.select(args.benchmarks_dir)
    prompts = session.tokenize(list(split.validate if args.split == "validate" else split.tune))
    if args.concurrency:  # batched serving at fixed concurrency (specpilot.bench.batched)
        return bench_concurrency(args, session, prompts, wl.max_new_tokens)
    report, steps, _ = run_bench(session, prompts, variants_for(session, args.mode), wl.max_new_tokens,
                                 progress=not args.json, own_ar=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench.json").write_text(json.dumps(report.to_dict(), indent=1))
        plot_speedups(report.to_dict(), Path(args.out) / "speedup.png")
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_report(report))
    return 0 if report.all_match() else 3


def _target_shape(dep):
    from specpilot.deployments import ModelRefKind, resolve_model
    from specpilot.engines.loader import read_shape
    from specpilot.testbed.synthetic import ShapeName
    if dep.target.kind is ModelRefKind.RANDOM:
        return ShapeName(dep.target.value).shape
    return read_shape(resolve_model(dep.target))


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark AR and speculative decoding (or kernels) on a deployment")
    p.add_argument("what", nargs="?", choices=["requests", "kernels"], default="requests",
                   help="requests: end-to-end decoding (default); kernels: per-kernel time vs ceilings (GPU)")
    p.add_argument("--deployment", required=True, help="shipped deployment name or a YAML path")
    p.add_argument("--mode", choices=["ar", "spec", "both"], default="both",
                   help="ar: AR only; spec/both: AR (the reference) and every drafter of the deployment")
    p.add_argument("--benchmarks", nargs="+", choices=[b.value for b in Benchmark])
    p.add_argument("--prompts-per-benchmark", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--split", choices=["tune", "validate"], default="validate")
    p.add_argument("--benchmarks-dir", default=None, help="prompt sets (default $SPECPILOT_BENCHMARKS or ../shared/benchmarks)")
    p.add_argument("--device", default=None, help="override the deployment's device (cpu, cuda)")
    p.add_argument("--out", default=None, help="also write bench.json and speedup.png here")
    p.add_argument("--json", action="store_true")
    add_concurrency_args(p)
    p.set_defaults(func=_bench)
    return p


def main(argv=None) -> int:
    return run_standalone(register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
