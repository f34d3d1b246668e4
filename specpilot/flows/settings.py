"""How much work one tune does per stage, by device: full workloads on GPU, shorter exploration on CPU.

On a shared two-core CPU a 135M-parameter bf16 forward takes 0.07 to 1.5 s (idle to busy). The CPU defaults
keep the reported numbers on the deployment's own held-out workload (every validate prompt, its max_new_tokens)
and validation at its max_new_tokens on one prompt per benchmark, and save time where only relative speed
matters: profile one tune prompt per benchmark at 32 new tokens, quick-benchmark 12 search trials on two tune
prompts at 16. A one-round tune of the CPU deployment takes about 4 minutes idle and 20 to 30 busy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from specpilot.deployments import Deployment, DeviceKind
from specpilot.stages.explore import ExploreParams
from specpilot.stages.integrate import IntegrateParams, ValidateParams
from specpilot.stages.profile import ProfileParams


@dataclass(frozen=True)
class TuneSettings:
    profile: ProfileParams
    explore: ExploreParams
    validate: ValidateParams
    integrate: IntegrateParams
    candidates_per_round: int  # most candidates validated per round, over all devices

    @classmethod
    def for_deployment(cls, dep: Deployment, gpus: int = 1, trials: int | None = None, seed: int = 0) -> "TuneSettings":
        if dep.device.kind is DeviceKind.CPU:
            settings = cls(
                ProfileParams(prompts=5, max_new_tokens=32, kernel_steps=2, cost_tokens=(1, 16, 32, 64), cost_repeats=2),
                ExploreParams(prompts=2, max_new_tokens=16, trials=12, batch=4, keep=2, memory_candidates=2, seed=seed),
                ValidateParams(prompts=5),
                IntegrateParams(recheck_prompts=2, recheck_max_new_tokens=16),
                candidates_per_round=2)
        else:
            settings = cls(
                ProfileParams(kernel_steps=8, cost_repeats=5),
                ExploreParams(prompts=5, max_new_tokens=256, trials=24, batch=4, keep=3, memory_candidates=3, seed=seed),
                ValidateParams(),
                IntegrateParams(recheck_prompts=5, recheck_max_new_tokens=256),
                candidates_per_round=min(6, 3 * gpus))
        return settings if trials is None else replace(settings, explore=replace(settings.explore, trials=trials))

    def with_overrides(self, overrides: dict[str, dict[str, Any]] | None) -> "TuneSettings":
        """Replace fields per stage, e.g. {"explore": {"trials": 12, "repeats": 2}}; unknown names are errors."""
        out = self
        for stage, fields_ in (overrides or {}).items():
            if stage == "candidates_per_round":
                out = replace(out, candidates_per_round=int(fields_))  # type: ignore[arg-type]
                continue
            if stage not in ("profile", "explore", "validate", "integrate"):
                raise ValueError(f"unknown settings section {stage!r}: expected profile, explore, validate, integrate")
            current = getattr(out, stage)
            unknown = set(fields_) - set(asdict(current))
            if unknown:
                raise ValueError(f"unknown {stage} setting(s) {sorted(unknown)}; known: {sorted(asdict(current))}")
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields_.items()}
            out = replace(out, **{stage: replace(current, **values)})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"profile": asdict(self.profile), "explore": asdict(self.explore), "validate": asdict(self.validate),
                "integrate": asdict(self.integrate), "candidates_per_round": self.candidates_per_round}
