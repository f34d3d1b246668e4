"""The benchmark workload: the five prompt sets, disjoint tune/validate subsets, and chat formatting.

Prompt sets are read from a benchmarks directory: the `benchmarks_dir` argument, else `$SPECPILOT_BENCHMARKS`,
else `../shared/benchmarks` next to the repository root, else `/work/shared/benchmarks`. Tune prompts
(exploration) and validate prompts (validation and reports) never overlap: each benchmark's prompts are
ordered by a seeded hash of their ids, the first `tune_fraction` of that order is the tune pool and the
last `validate_fraction` the validate pool, and runs take the first N of each pool (so a larger N only adds
prompts and never moves one from one side to the other).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Sequence

BENCHMARKS_ENV = "SPECPILOT_BENCHMARKS"
_REPO_ROOT = Path(__file__).resolve().parents[1]
_DEFAULT_DIRS = (_REPO_ROOT.parent / "shared" / "benchmarks", Path("/work/shared/benchmarks"))
MBPP_TEST_IDS = range(11, 511)  # task_id 11-510: MBPP's test split


class WorkloadError(ValueError):
    """A benchmark file, directory or workload setting is invalid."""


class ChatTemplateError(WorkloadError):
    """The tokenizer has no chat template."""


class Benchmark(str, Enum):
    GSM8K = "gsm8k"
    HUMANEVAL = "humaneval"
    MATH500 = "math500"
    MBPP = "mbpp"
    MT_BENCH = "mt_bench"

    @property
    def filename(self) -> str:
        return {Benchmark.GSM8K: "gsm8k.test.jsonl", Benchmark.HUMANEVAL: "humaneval.jsonl",
                Benchmark.MATH500: "math500.jsonl", Benchmark.MBPP: "mbpp.jsonl",
                Benchmark.MT_BENCH: "mt_bench.questions.jsonl"}[self]

    @property
    def expected_count(self) -> int:
        """Prompts in the benchmark as SpecPilot uses it (benchmarks/README.md; MBPP: test split only)."""
        return {Benchmark.GSM8K: 1319, Benchmark.HUMANEVAL: 164, Benchmark.MATH500: 500, Benchmark.MBPP: 500,
                Benchmark.MT_BENCH: 80}[self]


ALL_BENCHMARKS = tuple(Benchmark)


@dataclass(frozen=True)
class Prompt:
    benchmark: Benchmark
    id: str
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "benchmark", Benchmark(self.benchmark))
        if not self.id:
            raise WorkloadError(f"{self.benchmark.value}: prompt id must be non-empty")
        if not isinstance(self.text, str) or not self.text.strip():
            raise WorkloadError(f"{self.benchmark.value}/{self.id}: prompt text must be a non-empty string")

    @property
    def key(self) -> str:
        return f"{self.benchmark.value}/{self.id}"


def benchmarks_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding the five JSONL files (see the module docstring for the search order)."""
    if override is not None:
        candidates = [Path(override).expanduser()]
    elif os.environ.get(BENCHMARKS_ENV):
        candidates = [Path(os.environ[BENCHMARKS_ENV]).expanduser()]
    else:
        candidates = list(_DEFAULT_DIRS)
    for d in candidates:
        if d.is_dir():
            return d
    raise WorkloadError(f"no benchmarks directory found (tried {', '.join(map(str, candidates))}); "
                        f"pass one or set ${BENCHMARKS_ENV}")


def _prompt_from_row(bench: Benchmark, row: dict[str, Any], line: int) -> Prompt | None:
    if bench is Benchmark.GSM8K:
        return Prompt(bench, str(line), row["question"])
    if bench is Benchmark.HUMANEVAL:
        return Prompt(bench, str(row["task_id"]), row["prompt"])
    if bench is Benchmark.MATH500:
        return Prompt(bench, str(row.get("unique_id", row.get("id"))), row["problem"])
    if bench is Benchmark.MBPP:
        if row["task_id"] not in MBPP_TEST_IDS:
            return None
        return Prompt(bench, str(row["task_id"]), f"{row['text']}\nYour code should pass this test:\n{row['test_list'][0]}")
    return Prompt(bench, str(row["question_id"]), row["turns"][0])


def load_prompts(benchmark: Benchmark | str, directory: str | os.PathLike[str] | None = None) -> list[Prompt]:
    """One benchmark's prompts in file order (MBPP: the test split, task_id 11-510)."""
    bench = Benchmark(benchmark)
    path = benchmarks_dir(directory) / bench.filename
    if not path.is_file():
        raise WorkloadError(f"benchmark file {path} does not exist")
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                prompt = _prompt_from_row(bench, json.loads(line), len(prompts) if bench is Benchmark.GSM8K else line_no)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{line_no}: invalid JSON: {e}") from None
            except (KeyError, IndexError, TypeError) as e:
                raise WorkloadError(f"{path}:{line_no}: missing or malformed prompt field {e!s}") from None
            if prompt is not None:
                prompts.append(prompt)
    keys = [p.key for p in prompts]
    if len(set(keys)) != len(keys):
        raise WorkloadError(f"{path}: duplicate prompt ids")
    return prompts


def load_all(benchmarks: Iterable[Benchmark | str] = ALL_BENCHMARKS,
             directory: str | os.PathLike[str] | None = None) -> dict[Benchmark, list[Prompt]]:
    return {Benchmark(b): load_prompts(b, directory) for b in benchmarks}


@dataclass(frozen=True)
class Split:
    tune: tuple[Prompt, ...]
    validate: tuple[Prompt, ...]


def _rank(seed: int, prompt: Prompt) -> str:
    return hashlib.sha256(f"specpilot-split:{seed}:{prompt.key}".encode()).hexdigest()


def split(prompts: Sequence[Prompt], tune_n: int, validate_n: int, seed: int,
          tune_fraction: float = 0.5, validate_fraction: float = 0.5) -> Split:
    """Disjoint, deterministic tune and validate subsets of `prompts` (see the module docstring)."""
    for name, v in (("tune_n", tune_n), ("validate_n", validate_n), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise WorkloadError(f"{name}={v!r}: must be a non-negative integer")
    _check_fractions(tune_fraction, validate_fraction)
    keys = [p.key for p in prompts]
    if len(set(keys)) != len(keys):
        raise WorkloadError("split: prompts must have distinct benchmark/id keys")
    order = sorted(prompts, key=lambda p: (_rank(seed, p), p.key))
    n = len(order)
    tune_pool = order[: math.floor(n * tune_fraction)]
    validate_pool = order[n - math.floor(n * validate_fraction):] if validate_fraction > 0 else []
    if tune_n > len(tune_pool) or validate_n > len(validate_pool):
        raise WorkloadError(f"split: asked for {tune_n} tune / {validate_n} validate prompts but {n} prompts give "
                            f"pools of {len(tune_pool)} / {len(validate_pool)} (fractions {tune_fraction} / {validate_fraction})")
    return Split(tuple(tune_pool[:tune_n]), tuple(validate_pool[:validate_n]))


def _check_fractions(tune_fraction: float, validate_fraction: float) -> None:
    for name, v in (("tune_fraction", tune_fraction), ("validate_fraction", validate_fraction)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise WorkloadError(f"{name}={v!r}: must be a number strictly between 0 and 1")
    if tune_fraction + validate_fraction > 1 + 1e-9:
        raise WorkloadError(f"tune_fraction={tune_fraction} + validate_fraction={validate_fraction}: must sum to <= 1 "
                            "(the tune and validate pools must not overlap)")


@dataclass(frozen=True)
class WorkloadSpec:
    """Which prompts a deployment runs: per benchmark, `prompts_per_benchmark` tune and as many validate prompts."""

    benchmarks: tuple[Benchmark, ...] = ALL_BENCHMARKS
    prompts_per_benchmark: int = 2
    max_new_tokens: int = 64
    tune_fraction: float = 0.5
    validate_fraction: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            benches = tuple(Benchmark(b) for b in self.benchmarks)
        except ValueError as e:
            raise WorkloadError(f"benchmarks={list(self.benchmarks)!r}: {e}; expected a subset of {[b.value for b in Benchmark]}") from None
        if not benches or len(set(benches)) != len(benches):
            raise WorkloadError(f"benchmarks={[b.value for b in benches]}: must be a non-empty list without repeats")
        object.__setattr__(self, "benchmarks", benches)
        for name, lo, hi in (("prompts_per_benchmark", 1, 10_000), ("max_new_tokens", 1, 65_536), ("seed", 0, 2**63 - 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise WorkloadError(f"{name}={v!r}: must be an integer in {lo}..{hi}")
        _check_fractions(self.tune_fraction, self.validate_fraction)
        for b in benches:
            pool = min(math.floor(b.expected_count * self.tune_fraction), math.floor(b.expected_count * self.validate_fraction))
            if self.prompts_per_benchmark > pool:
                raise WorkloadError(f"prompts_per_benchmark={self.prompts_per_benchmark}: {b.value} has {b.expected_count} "
                                    f"prompts, so its smaller pool holds only {pool}")

    def select(self, directory: str | os.PathLike[str] | None = None) -> Split:
        """The tune and validate prompts of every listed benchmark, in benchmark order."""
        tune: list[Prompt] = []
        validate: list[Prompt] = []
        for bench, prompts in load_all(self.benchmarks, directory).items():
            s = split(prompts, self.prompts_per_benchmark, self.prompts_per_benchmark, self.seed,
                      self.tune_fraction, self.validate_fraction)
            tune += s.tune
            validate += s.validate
        return Split(tuple(tune), tuple(validate))

    def to_dict(self) -> dict[str, Any]:
        return {"benchmarks": [b.value for b in self.benchmarks], "prompts_per_benchmark": self.prompts_per_benchmark,
                "max_new_tokens": self.max_new_tokens, "tune_fraction": self.tune_fraction,
                "validate_fraction": self.validate_fraction, "seed": self.seed}


def apply_chat_template(tokenizer: Any, text: str, *, require_template: bool = True) -> list[int]:
    """Token ids of `text` as one user turn plus the generation prompt, through the tokenizer's chat template.

    A tokenizer without a chat template raises ChatTemplateError, unless `require_template=False`: then the
    raw text is encoded and the BOS token (if the tokenizer has one) put in front.
    """
    if not getattr(tokenizer, "chat_template", None):
        if require_template:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ChatTemplateError(f"tokenizer {name!r} has no chat template; pass require_template=False to "
                                    "encode the raw prompt with a BOS token instead")
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        bos = getattr(tokenizer, "bos_token_id", None)
        return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else ids
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))
