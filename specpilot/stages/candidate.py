"""A candidate engine build: an EngineConfig plus, optionally, policy code at the engine's extension points, and,
for a batch-regime deployment, the BatchConfig of the batched engine that serves it."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from specpilot.engines.batch.config import BatchConfig
from specpilot.engines.config import EngineConfig
from specpilot.engines.policy import STOCK, EnginePolicy


class CandidateSource(str, Enum):
    STOCK = "stock"  # the drafter's published defaults
    SEARCH = "search"  # the search proposer (optimizer over the mechanism catalog)
    MEMORY = "memory"  # mechanisms proven on a similar scope
    AGENT = "agent"  # an LLM proposer
    LOSSY_SUITE = "lossy_suite"  # deliberately lossy: must be rejected by token forcing
    INTEGRATED = "integrated"  # several validated candidates combined


@dataclass(frozen=True)
class Candidate:
    name: str
    config: EngineConfig
    policy: str | None = None  # "package.module:Class" or "/path/file.py:Class" of an EnginePolicy subclass
    mechanisms: tuple[str, ...] = ()  # catalog mechanism names this candidate embodies
    source: CandidateSource = CandidateSource.SEARCH
    drafter_label: str | None = None  # which deployment drafter (model) the config's drafter kind refers to
    batch_config: BatchConfig | None = None  # batch regime: the batched engine's mechanisms (None: single regime)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a candidate needs a name")
        if self.batch_config is not None and not isinstance(self.batch_config, BatchConfig):
            raise ValueError(f"candidate {self.name}: batch_config must be a BatchConfig, got {self.batch_config!r}")
        if self.batch_config is not None and self.policy is not None:
            raise ValueError(f"candidate {self.name}: the batched engine runs no policy code")
        object.__setattr__(self, "source", CandidateSource(self.source))
        object.__setattr__(self, "mechanisms", tuple(self.mechanisms))
        if self.policy is not None and ":" not in self.policy:
            raise ValueError(f"candidate {self.name}: policy {self.policy!r} must look like 'module:Class' or 'file.py:Class'")

    @property
    def build_digest(self) -> str:
        """What decodes: the engine config and, in the batch regime, the batching config too (two candidates that
        differ only in their BatchConfig are different builds)."""
        config = self.config.digest()
        return config if self.batch_config is None else f"{config}+{self.batch_config.digest()}"

    @property
    def runs_isolated(self) -> bool:
        """An agent's policy: it runs only in the sandbox (specpilot.agents.sandbox), never in-process. Any policy
        reference an agent candidate carries counts, not only files: a module path is code the agent chose too."""
        return self.source is CandidateSource.AGENT and self.policy is not None

    def load_policy(self) -> EnginePolicy:
        if self.policy is None:
            return STOCK
        target, cls_name = self.policy.rsplit(":", 1)
        if self.runs_isolated:
            # Agent-written code never runs in the orchestrator: specpilot.agents.sandbox runs it isolated.
            raise PermissionError(f"candidate {self.name}: agent policy code runs only in the sandbox "
                                  "(specpilot.agents.sandbox), never in this process")
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"candidate {self.name}: policy file {path} does not exist")
            spec = importlib.util.spec_from_file_location(f"specpilot_policy_{abs(hash(str(path)))}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        cls = getattr(module, cls_name, None)
        if cls is None or not (isinstance(cls, type) and issubclass(cls, EnginePolicy)):
            raise ValueError(f"candidate {self.name}: {self.policy} is not an EnginePolicy subclass")
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config.to_dict(), "policy": self.policy,
                "mechanisms": list(self.mechanisms), "source": self.source.value, "drafter_label": self.drafter_label,
                "batch_config": None if self.batch_config is None else self.batch_config.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Candidate":
        return cls(name=d["name"], config=EngineConfig.from_dict(d["config"]), policy=d.get("policy"),
                   mechanisms=tuple(d.get("mechanisms", ())), source=d.get("source", "search"),
                   drafter_label=d.get("drafter_label"),
                   batch_config=None if d.get("batch_config") is None else BatchConfig.from_dict(d["batch_config"]))
