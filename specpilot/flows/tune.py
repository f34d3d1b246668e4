"""The `tune` flow: profile -> per round attribute -> explore (one task per device) -> validate -> integrate.

Every task runs one stage through the stage framework, so each stage's files and sha256 manifest land in the
artifact store under runs/<run_id>/; tasks pass manifest URIs to each other. Explore tasks are pinned to a
device each (cuda:<index> of the visible devices; on CPU one task); a per-device lock keeps measurements on
one device from overlapping. Validation sees only the validate split, which explore never sees.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, get_run_logger, task, unmapped  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402

from specpilot.artifacts import new_run_id, store_from_uri  # noqa: E402
from specpilot.deployments import Deployment, DeviceKind, load_deployment  # noqa: E402
from specpilot.flows.publish import (publish_attribution, publish_round, publish_summary,  # noqa: E402
                                     publish_timeline)
from specpilot.flows.report import RoundReport, TuneReport  # noqa: E402
from specpilot.flows.settings import TuneSettings  # noqa: E402
from specpilot.memory import default_memory_path  # noqa: E402
from specpilot.stages.candidate import Candidate  # noqa: E402
from specpilot.engines.config import KernelBackend  # noqa: E402
from specpilot.engines.family import TargetFamily  # noqa: E402
from specpilot.stages.catalog import stock_candidate, with_kernel_table  # noqa: E402
from specpilot.stages.integrate import mark_run_failed  # noqa: E402
from specpilot.stages.devices import default_device, device_name  # noqa: E402
from specpilot.stages.io import StageName, StageOutcome, StageRequest, path_part, run_stage  # noqa: E402
from specpilot.stages.tune_kernels import token_counts  # noqa: E402


def _task_run_name() -> str:
    from prefect.runtime import task_run
    request = task_run.parameters["request"]
    return "-".join((request.stage.value, *request.qualifiers))


def _run_stage(request: StageRequest, work_dir: str) -> StageOutcome:
    return run_stage(request, Path(work_dir).joinpath(request.stage.value, *request.qualifiers))


def _stage_task(stage: StageName):
    return task(_run_stage, name=stage.value, cache_policy=NO_CACHE, task_run_name=_task_run_name)


recall_task = _stage_task(StageName.RECALL)
profile_task = _stage_task(StageName.PROFILE)
attribute_task = _stage_task(StageName.ATTRIBUTE)
explore_task = _stage_task(StageName.EXPLORE)
tune_kernels_task = _stage_task(StageName.TUNE_KERNELS)
validate_task = _stage_task(StageName.VALIDATE)
integrate_task = _stage_task(StageName.INTEGRATE)


def devices_for(dep: Deployment, gpus: int) -> list[str]:
    """One device per explore task: cuda:0..gpus-1 (of the visible devices), or the CPU once."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus}: must be >= 1")
    if dep.device.kind is DeviceKind.CPU and gpus != 1:
        raise ValueError(f"deployment {dep.name} runs on cpu: use --gpus 1 (one explore task)")
    return [default_device(dep, i) for i in range(gpus)]


def preflight(deployment: str, rounds: int = 1, gpus: int = 1, store: str | None = None, trials: int | None = None,
              seed: int = 0, overrides: dict[str, dict[str, Any]] | None = None
              ) -> tuple[Deployment, list[str], TuneSettings, str]:
    """Everything a tune run can refuse before it starts (rounds, deployment file, devices, stage overrides, the
    artifact store: S3 credentials and bucket): (deployment, devices, settings, store root URI). The CLI calls it
    before starting the flow, so a bad argument fails at once rather than after a Prefect server starts."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: must be >= 1")
    dep = load_deployment(deployment)
    devices = devices_for(dep, gpus)
    settings = TuneSettings.for_deployment(dep, gpus, trials, seed).with_overrides(overrides)
    artifacts = store_from_uri(store)
    artifacts.list("preflight/")  # one cheap request: no credentials, an unreachable endpoint, no bucket
    return dep, devices, settings, artifacts.root_uri


def default_work_dir() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE") or "~/.cache/specpilot").expanduser() / "work"


def pick_candidates(explores: list[StageOutcome], limit: int) -> list[Candidate]:
    """Every device's selected candidates, largest gain over the build (in their own bench run) first, each
    configuration once."""
    ranked = sorted((m for e in explores for m in e.meta["selected"]), key=lambda m: -m["objective"] / m["baseline"])
    out: dict[tuple[str, str | None], Candidate] = {}
    for m in ranked:
        c = Candidate.from_dict(m["candidate"])
        out.setdefault((c.build_digest, c.drafter_label), c)
    return list(out.values())[:limit]


def kernel_tuned(candidates: list[Candidate], tuned: StageOutcome) -> list[Candidate]:
    """The Triton-backend builds among `candidates` with tune_kernels' table applied (the table only steers the
    Triton kernels), as extra candidates for validation."""
    pairs = tuple((key, params) for key, params in tuned.meta["kernel_table"])
    return [with_kernel_table(c, pairs) for c in candidates
            if pairs and c.config.kernel_backend is KernelBackend.TRITON]


def round_report(r: int, attribution: StageOutcome, explores: list[StageOutcome], validations: list[StageOutcome],
                 integration: StageOutcome) -> RoundReport:
    f, i = attribution.meta, integration.meta
    accepted = sum(v.meta["verdict"] == "pass" and v.meta["speedup_vs_stock"] > 1.0 for v in validations)
    return RoundReport(r, f["direction"], f["tau_gap"], f["kernel"], f["overhead"], f["total_gap"],
                       any(e.meta["widened"] for e in explores),
                       tuple(n for e in explores for n in e.meta["memory_first"]), sum(e.meta["tried"] for e in explores),
                       accepted, len(validations) - accepted, i["final"]["name"], i["final_vs_stock"], i["final_vs_ar"],
                       tuple(i["decisions"]))


@flow(name="tune", task_runner=ThreadPoolTaskRunner(max_workers=8))
def tune(deployment: str, rounds: int = 1, gpus: int = 1, store: str | None = None, memory: str | None = None,
         trials: int | None = None, seed: int = 0, work_dir: str | None = None,
         overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Tune `deployment` for `rounds` rounds on `gpus` devices; returns the TuneReport as a dict.

    `overrides` replaces per-stage settings (TuneSettings.with_overrides), e.g. {"explore": {"repeats": 2}}."""
    logger = get_run_logger()
    dep, devices, settings, store_uri = preflight(deployment, rounds, gpus, store, trials, seed, overrides)
    run_id = new_run_id()
    memory_path = str(Path(memory).expanduser() if memory else default_memory_path())
    work = str(Path(work_dir).expanduser() if work_dir else default_work_dir() / run_id)
    stock = build = stock_candidate(dep)
    logger.info("tune %s: run %s, %d round(s) on %s; store %s, memory %s", dep.name, run_id, rounds, devices,
                store_uri, memory_path)

    def request(stage: StageName, qualifiers: tuple[str, ...], params: dict[str, Any],
                inputs: dict[str, str] | None = None, device: str = devices[0]) -> StageRequest:
        return StageRequest(stage, run_id, deployment, store_uri, inputs or {}, params, qualifiers, device)

    reports: list[RoundReport] = []
    try:
        recall = recall_task(request(StageName.RECALL, (), {"build": stock.to_dict(), "memory": memory_path}), work)
        logger.info("memory: %d mechanism(s) proven on similar scopes: %s", len(recall.meta["hits"]), recall.meta["hits"])
        profile = first_profile = profile_task(request(StageName.PROFILE, ("round0",),
                                                       {**asdict(settings.profile), "build": build.to_dict()}), work)
        for r in range(1, rounds + 1):
            q = f"round{r}"
            # every round judged by round 0's measured ceilings: factors comparable across rounds
            attribution = attribute_task(request(StageName.ATTRIBUTE, (q,), {}, {
                "profile": profile.manifest_uri, "ceilings": first_profile.manifest_uri}), work)
            publish_attribution(dep.name, r, attribution)
            inputs = {"profile": profile.manifest_uri, "attribute": attribution.manifest_uri, "recall": recall.manifest_uri}
            explores = explore_task.map(request=[
                request(StageName.EXPLORE, (q, f"dev{i}"), asdict(replace(settings.explore, round=r, device_index=i)),
                        inputs, device) for i, device in enumerate(devices)], work_dir=unmapped(work)).result()
            publish_timeline(dep.name, r, explores)
            candidates = pick_candidates(explores, settings.candidates_per_round)
            # Kernel tuning needs the real device's timings; its table steers the Llama family's fused kernels only.
            if dep.device.kind is DeviceKind.CUDA and dep.target_family() is TargetFamily.LLAMA:
                tokens = token_counts(build, dep.regime.concurrency)
                tuned = tune_kernels_task(request(StageName.TUNE_KERNELS, (q,), {"tokens": tokens}, {
                    "profile": profile.manifest_uri, "attribute": attribution.manifest_uri}), work)
                candidates += kernel_tuned([build, *candidates], tuned)
            validations = validate_task.map(request=[
                request(StageName.VALIDATE, (q, path_part(c.name)), {**asdict(settings.validate), "stock": stock.to_dict(),
                                                          "candidate": c.to_dict()}, device=devices[i % len(devices)])
                for i, c in enumerate(candidates)], work_dir=unmapped(work)).result() if candidates else []
            integration = integrate_task(request(
                StageName.INTEGRATE, (q,),
                {**asdict(replace(settings.integrate, round=r, final_round=r == rounds, memory=memory_path)),
                 "stock": stock.to_dict(), "current": build.to_dict()},
                {**{f"explore.{i}": e.manifest_uri for i, e in enumerate(explores)},
                 **{f"validate.{i}": v.manifest_uri for i, v in enumerate(validations)}}), work)
            build = Candidate.from_dict(integration.meta["final"])
            reports.append(round_report(r, attribution, explores, validations, integration))
            publish_round(dep.name, r, [profile, attribution, *explores, *validations, integration], explores,
                          validations)
            logger.info("round %d: %s", r, reports[-1].decisions[-1])
            if r < rounds:
                profile = profile_task(request(StageName.PROFILE, (q,), {**asdict(settings.profile),
                                                                         "build": build.to_dict()}), work)
    except Exception as e:
        mark_run_failed(memory_path, run_id, f"{type(e).__name__}: {e}")
        raise
    final = integration.meta
    report = TuneReport(dep.name, run_id, device_name(devices[0]), store_uri, settings.to_dict(), tuple(reports),
                        build.name, final["final_is_stock"], tuple(build.mechanisms), final["final_vs_stock"],
                        final["final_vs_ar"], final["stock_vs_ar"], final["heldout_prompts"],
                        final["heldout_max_new_tokens"], final["build"]["manifest_uri"],
                        final.get("final_vs_stock_interval"))
    publish_summary(dep.name, report)
    return report.to_dict()
