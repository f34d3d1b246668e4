"""Stages run in-process exactly as the flow runs them, up to the first explore (shared by the stage tests)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from specpilot.stages.candidate import Candidate
from specpilot.stages.io import StageName, StageOutcome, StageRequest, run_stage

Stage = Callable[..., StageOutcome]


def stage_runner(run_id: str, deployment: str, store: str, out: Path) -> Stage:
    """stage(name, qualifiers, params, inputs=None): one stage of run `run_id`, outputs under out/<stage>/..."""
    def stage(name: StageName, qualifiers: tuple[str, ...], params: dict, inputs: dict | None = None):
        return run_stage(StageRequest(name, run_id, deployment, store, inputs or {}, params, qualifiers),
                         out.joinpath(name.value, *qualifiers))
    return stage


def recall_to_explore(stage: Stage, stock: Candidate, memory: str, profile: dict, explore: dict) -> dict:
    """recall, profile (round 0), attribute and one explore task (round 1, dev0) of the stock build."""
    runs = {"recall": stage(StageName.RECALL, (), {"build": stock.to_dict(), "memory": memory})}
    runs["profile"] = stage(StageName.PROFILE, ("round0",), {**profile, "build": stock.to_dict()})
    runs["attribute"] = stage(StageName.ATTRIBUTE, ("round1",), {}, {"profile": runs["profile"].manifest_uri})
    runs["explore"] = stage(StageName.EXPLORE, ("round1", "dev0"), explore, {
        "profile": runs["profile"].manifest_uri, "attribute": runs["attribute"].manifest_uri,
        "recall": runs["recall"].manifest_uri})
    return runs
