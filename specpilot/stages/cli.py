"""`specpilot stage <name> --in REQUEST --out DIR` (one stage, e.g. on a bare GPU host) and `specpilot tune`.

A stage request is the request.json every stage run writes next to its outputs: input manifest URIs by role,
parameters, the store and the device, so any stage of a past run can be re-run from it. `tune` runs the
Prefect flow (ephemeral local API unless PREFECT_API_URL points at a server) and prints the summary table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specpilot.cliutil import run_standalone
from specpilot.stages.io import StageName, StageRequest, run_stage


def _stage(args: argparse.Namespace) -> int:
    request = StageRequest.load(Path(args.request))
    if request.stage.value != args.name:
        raise ValueError(f"{args.request} is a {request.stage.value} request, not {args.name}")
    if args.store:
        request = StageRequest(**{**request.__dict__, "store": args.store})
    if args.device:
        request = StageRequest(**{**request.__dict__, "device": args.device})
    outcome = run_stage(request, Path(args.out))
    print(json.dumps({"manifest": outcome.manifest_uri, "summary": outcome.meta}, indent=1))
    return 0


def _tune(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from specpilot.flows.report import TuneReport
    from specpilot.flows.tune import preflight, tune

    overrides: dict[str, dict[str, object]] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        stage, _, field = name.partition(".")
        if not field or not value:
            raise ValueError(f"--set {item!r}: expected STAGE.FIELD=VALUE, e.g. explore.trials=12")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        overrides.setdefault(stage, {})[field] = parsed
    preflight(args.deployment, args.rounds, args.gpus, args.store, args.trials, args.seed, overrides or None)
    result = tune(deployment=args.deployment, rounds=args.rounds, gpus=args.gpus, store=args.store,
                  memory=args.memory, trials=args.trials, seed=args.seed, work_dir=args.work_dir,
                  overrides=overrides or None)
    report = TuneReport.from_dict(result)
    print(json.dumps(result, indent=1) if args.json else report.table())
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    stage = subparsers.add_parser("stage", help="run one stage (profile, attribute, explore, ...) from a request file")
    stage.add_argument("name", choices=[s.value for s in StageName])
    stage.add_argument("--in", dest="request", required=True, metavar="REQUEST",
                       help="stage request JSON (input manifest URIs by role, parameters, store, device)")
    stage.add_argument("--out", required=True, metavar="DIR", help="local output directory (also uploaded to the store)")
    stage.add_argument("--store", default=None, help="override the request's artifact store URI")
    stage.add_argument("--device", default=None, help="override the request's device (cpu, cuda:0, ...)")
    stage.set_defaults(func=_stage)

    tune = subparsers.add_parser("tune", help="tune a deployment: profile, attribute, explore, validate, integrate")
    tune.add_argument("--deployment", required=True, help="shipped deployment name or a YAML path")
    tune.add_argument("--rounds", type=int, default=1)
    tune.add_argument("--gpus", type=int, default=1, help="explore tasks, one per visible GPU (1 on CPU)")
    tune.add_argument("--store", default=None, help="artifact store: a directory, file:///dir or s3://bucket/prefix "
                                                     "(default $SPECPILOT_STORE or ~/.cache/specpilot/artifacts)")
    tune.add_argument("--memory", default=None, help="memory DuckDB file (default $SPECPILOT_MEMORY or "
                                                      "~/.cache/specpilot/memory.duckdb)")
    tune.add_argument("--trials", type=int, default=None, help="search trials per device and round (default by device)")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--work-dir", default=None, help="local scratch for stage outputs (default under the cache)")
    tune.add_argument("--set", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                      help="override a stage setting (JSON value), e.g. --set explore.repeats=2; repeatable")
    tune.add_argument("--json", action="store_true", help="print the report as JSON")
    tune.set_defaults(func=_tune)


def main(argv: list[str] | None = None) -> int:
    return run_standalone(register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
