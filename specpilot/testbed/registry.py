"""Testbed model names and their on-demand resolution to model directories in the cache.

A testbed name is a base model (`smollm2-135m`) optionally followed by `-l<N>`: the base cut to its first
N decoder layers by `derive_truncated`, a draft model sharing the base's tokenizer (`smollm2-135m-l6`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from specpilot.testbed.derive import derive_truncated, derived_source_sha
from specpilot.testbed.fetch import fetch_smollm2
from specpilot.engines.family import TargetFamily
from specpilot.engines.shapes import SMOLLM2_135M
from specpilot.testbed import modeldir
from specpilot.testbed.modeldir import check_model_dir, file_lock, valid_stamp

_NAME = re.compile(r"^(?P<base>.+?)(?:-l(?P<layers>\d+))?$")


class TestbedBase(str, Enum):
    __test__ = False  # not a pytest test class despite the name

    SMOLLM2_135M = "smollm2-135m"

    @property
    def layers(self) -> int:
        return {TestbedBase.SMOLLM2_135M: SMOLLM2_135M.layers}[self]

    @property
    def family(self) -> TargetFamily:  # known without fetching the model
        return {TestbedBase.SMOLLM2_135M: TargetFamily.LLAMA}[self]


@dataclass(frozen=True)
class TestbedName:
    """A parsed testbed model name: a base model and, for a derived draft, its layer count."""

    __test__ = False

    base: TestbedBase
    layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", TestbedBase(self.base))
        if self.layers is not None and not 1 <= self.layers < self.base.layers:
            raise ValueError(f"testbed {self.base.value}-l{self.layers}: layers must be in 1..{self.base.layers - 1}")

    @classmethod
    def parse(cls, name: str) -> "TestbedName":
        m = _NAME.match(name) if isinstance(name, str) else None
        bases = [b.value for b in TestbedBase]
        if m is None or m.group("base") not in bases:
            raise ValueError(f"testbed model {name!r} is unknown: expected one of {bases}, optionally with "
                             f"-l<N> for its first N layers (e.g. {bases[0]}-l6)")
        layers = m.group("layers")
        return cls(TestbedBase(m.group("base")), int(layers) if layers is not None else None)

    def __str__(self) -> str:
        return self.base.value if self.layers is None else f"{self.base.value}-l{self.layers}"


def fetch_base(base: TestbedBase, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    if base is TestbedBase.SMOLLM2_135M:
        return fetch_smollm2(cache_dir)
    raise AssertionError(f"no fetcher for {base}")  # every TestbedBase member has a branch above


def resolve_testbed(name: str | TestbedName, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The model directory for a testbed name, fetching the base and deriving the draft when needed."""
    parsed = name if isinstance(name, TestbedName) else TestbedName.parse(name)
    base_dir = fetch_base(parsed.base, cache_dir)
    if parsed.layers is None:
        return base_dir
    root = modeldir.cache_dir(cache_dir)
    out = root / "models" / str(parsed)
    source_sha = derived_source_sha(base_dir)
    with file_lock(root / "locks" / f"{parsed}.lock"):
        stamp = valid_stamp(out, source_sha)
        if stamp is None or stamp.details.get("layers") != parsed.layers:
            derive_truncated(base_dir, out, parsed.layers)
    return check_model_dir(out)
