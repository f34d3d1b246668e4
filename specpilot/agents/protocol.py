"""What the parent hands the sandbox's child process and what it reads back: plain JSON, typed on both sides.

The child's result comes from an untrusted process: it is parsed strictly.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specpilot.engines.config import DType, EngineConfig

if TYPE_CHECKING:
    from specpilot.agents.sandbox import Isolation


class ChildMode(str, Enum):
    GENERATE = "generate"  # free-running decode of the prompts
    FORCED = "forced"  # token forcing's forced mode over the stock sequences


class ChildStatus(str, Enum):
    OK = "ok"
    ERROR = "error"  # the agent's code (or the engine with it) raised; the message says what


@dataclass(frozen=True)
class TargetSpec:
    """The model the child loads (read-only): a Hugging Face directory, as the parent's engines use it."""

    model_dir: str
    dtype: DType
    device: str
    eos: tuple[int, ...] = ()
    draft_model_dir: str | None = None  # for drafter=draft_model candidates

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "eos", tuple(int(t) for t in self.eos))
        object.__setattr__(self, "model_dir", str(Path(self.model_dir).resolve()))
        if self.draft_model_dir is not None:
            object.__setattr__(self, "draft_model_dir", str(Path(self.draft_model_dir).resolve()))

    def readable_paths(self) -> tuple[str, ...]:
        return (self.model_dir,) + ((self.draft_model_dir,) if self.draft_model_dir else ())

    def to_dict(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "dtype": self.dtype.value, "device": self.device, "eos": list(self.eos),
                "draft_model_dir": self.draft_model_dir}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TargetSpec":
        return cls(d["model_dir"], DType(d["dtype"]), d["device"], tuple(d.get("eos", ())), d.get("draft_model_dir"))


@dataclass(frozen=True)
class PromptIds:
    key: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class ChildRequest:
    mode: ChildMode
    policy: str  # "<run dir>/policy.py:ClassName"
    config: EngineConfig
    target: TargetSpec
    prompts: tuple[PromptIds, ...]
    max_new_tokens: int
    threads: int = 1
    stock_outputs: dict[str, list[int]] = field(default_factory=dict)  # FORCED only
    extra_writable: tuple[str, ...] = ()  # beyond the run dir (CUDA's device files)
    extra_readable: tuple[str, ...] = ()  # beyond the run dir and guard.readable_roots (caches, CUDA's /proc, /sys)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ChildMode(self.mode))
        if not self.prompts:
            raise ValueError("a sandbox run needs at least one prompt")
        if self.mode is ChildMode.FORCED and set(self.stock_outputs) != {p.key for p in self.prompts}:
            raise ValueError("forced mode needs the stock output of every prompt")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "policy": self.policy, "config": self.config.to_dict(),
                "target": self.target.to_dict(), "prompts": [{"key": p.key, "ids": list(p.ids)} for p in self.prompts],
                "max_new_tokens": self.max_new_tokens, "threads": self.threads, "stock_outputs": self.stock_outputs,
                "extra_writable": list(self.extra_writable), "extra_readable": list(self.extra_readable)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChildRequest":
        return cls(ChildMode(d["mode"]), d["policy"], EngineConfig.from_dict(d["config"]),
                   TargetSpec.from_dict(d["target"]), tuple(PromptIds(p["key"], tuple(p["ids"])) for p in d["prompts"]),
                   int(d["max_new_tokens"]), int(d.get("threads", 1)),
                   {k: list(v) for k, v in d.get("stock_outputs", {}).items()}, tuple(d.get("extra_writable", ())),
                   tuple(d.get("extra_readable", ())))


class SandboxStatus(str, Enum):
    OK = "ok"
    ERROR = "error"  # the code raised (not a guard): an ordinary bug
    VIOLATION = "violation"  # a guard stopped the code (network, processes, writes outside its directory, ...)
    TIMEOUT = "timeout"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    CRASHED = "crashed"  # died without a readable result


def _ints(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise TypeError(f"{name} must be a list of ints")
    return tuple(v)


def _seconds(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Violation:
    event: str  # the audit event (socket.connect, open, subprocess.Popen, ...)
    detail: str


@dataclass(frozen=True)
class GeneratedRun:
    key: str
    tokens: tuple[int, ...]
    stop_reason: str
    prefill_s: float
    decode_s: float
    committed: tuple[int, ...]  # per step
    accepted: tuple[int, ...]
    drafted: tuple[int, ...]

    @property
    def tokens_per_step(self) -> float:
        return sum(self.committed) / max(1, len(self.committed))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GeneratedRun":
        return cls(str(d["key"]), _ints("tokens", d["tokens"]), str(d["stop_reason"]), _seconds("prefill_s", d["prefill_s"]),
                   _seconds("decode_s", d["decode_s"]), _ints("committed", d["committed"]),
                   _ints("accepted", d["accepted"]), _ints("drafted", d["drafted"]))


@dataclass(frozen=True)
class ForcedRun:
    key: str
    argmax: tuple[int, ...]
    runner_up: tuple[int, ...]
    margin: tuple[float, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ForcedRun":
        margin = d["margin"]
        if not isinstance(margin, list) or not all(isinstance(m, (int, float)) for m in margin):
            raise TypeError("margin must be a list of numbers")
        out = cls(str(d["key"]), _ints("argmax", d["argmax"]), _ints("runner_up", d["runner_up"]),
                  tuple(float(m) for m in margin))
        if not len(out.argmax) == len(out.runner_up) == len(out.margin):
            raise ValueError(f"forced pass of {out.key}: argmax, runner_up and margin differ in length")
        return out


@dataclass(frozen=True)
class SandboxOutcome:
    status: SandboxStatus
    run_dir: str
    isolation: "Isolation"
    layers: tuple[str, ...]  # the isolation layers that were active
    returncode: int | None
    wall_s: float
    violations: tuple[Violation, ...]
    error: str  # "" when the run succeeded
    runs: tuple[GeneratedRun, ...] = ()
    forced: tuple[ForcedRun, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status is SandboxStatus.OK

    def reason(self) -> str:
        """Why the run was stopped or failed, in one line ('' when it succeeded)."""
        if self.ok:
            return ""
        parts = [f"sandbox {self.status.value}"]
        parts += [f"blocked {v.event}: {v.detail}" for v in self.violations]
        if self.error:
            parts.append(self.error)
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "run_dir": self.run_dir, "isolation": self.isolation.value,
                "layers": list(self.layers), "returncode": self.returncode, "wall_s": self.wall_s,
                "violations": [asdict(v) for v in self.violations], "error": self.error, "reason": self.reason(),
                "runs": [asdict(r) for r in self.runs], "forced": [asdict(f) for f in self.forced]}
