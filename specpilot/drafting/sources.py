"""The target a drafter is trained for, and where its training prompts may come from: MBPP's train split,
synthetic task prompts (task_prompts) and free generation. Never test prompts.

MBPP task ids 601-974 are its train split (11-510 test, 511-600 validation, 1-10 few-shot prompts); the
benchmarks use the test split only, so train prompts can never leak into a measurement. Free generation, with a
chat template, has the target invent a user turn (sampled inside the template's user slot) and then answer it
greedily as the assistant: the kind of text the benchmarks, which prompt through the template, make it write.
Without a template it starts from BOS (or, for targets without a tokenizer, a random token) and samples a few
tokens before the greedy continuation. Either way: diverse text in the target's own distribution.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.drafting.task_prompts import TaskKind, function_stub, task_prompts
from specpilot.engines.config import DType
from specpilot.engines.llama import LlamaModel
from specpilot.engines.loader import ModelLoadError, eos_ids, load_model, load_tokenizer, random_model
from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M, LlamaShape
from specpilot.workload import MBPP_TEST_IDS, Benchmark, apply_chat_template, benchmarks_dir, load_prompts

MBPP_TRAIN_IDS = range(601, 975)
SYNTHETIC_PREFIX = "synthetic:"
# Random-weight targets for timing runs on hosts without real weights (their text is meaningless).
SYNTHETIC = {"smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA3_8B}


@dataclass(frozen=True)
class TargetBundle:
    name: str
    model: LlamaModel
    tokenizer: Any | None  # None: prompts are random token prefixes, free generation starts at a random token
    eos: frozenset[int]

    @property
    def shape(self) -> LlamaShape:
        return self.model.shape


def load_target(spec: str, device: str, dtype: DType) -> TargetBundle:
    """`spec`: a model directory, a testbed name (fetched / derived on demand), or synthetic:<shape>[:seed]."""
    if spec.startswith(SYNTHETIC_PREFIX):
        name, _, seed = spec[len(SYNTHETIC_PREFIX):].partition(":")
        if name not in SYNTHETIC:
            raise ValueError(f"unknown synthetic target {name!r}: expected one of {sorted(SYNTHETIC)}")
        model = random_model(SYNTHETIC[name], dtype.torch, device, seed=int(seed or 0))
        return TargetBundle(spec, model, None, frozenset())
    path = Path(spec)
    if not path.is_dir():
        from specpilot.testbed.registry import resolve_testbed  # only when a testbed name is given

        path = resolve_testbed(spec)
    model = load_model(path, dtype.torch, device)
    try:
        tokenizer = load_tokenizer(path)
    except ModelLoadError:
        tokenizer = None  # weights without a tokenizer: train on random prefixes and free generation
    return TargetBundle(str(spec), model, tokenizer, eos_ids(path, tokenizer))


class LeakError(ValueError):
    """A benchmark test prompt was about to be used for drafter training."""


def mbpp_train_tasks(directory: str | Path | None = None, ids: range = MBPP_TRAIN_IDS) -> list[tuple[int, str, str]]:
    """(task_id, task text, first test) of MBPP train tasks."""
    if any(i in MBPP_TEST_IDS for i in ids):
        raise LeakError(f"MBPP ids {ids} overlap the test split {MBPP_TEST_IDS}")
    path = benchmarks_dir(directory) / "mbpp.jsonl"
    rows: list[tuple[int, str, str]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            tid = int(row["task_id"])
            if tid in ids:
                rows.append((tid, row["text"], row["test_list"][0]))
    if not rows:
        raise ValueError(f"{path} holds no MBPP tasks with ids in {ids.start}..{ids.stop - 1}")
    return rows


def mbpp_train_texts(directory: str | Path | None = None, ids: range = MBPP_TRAIN_IDS) -> list[tuple[int, str]]:
    """(task_id, prompt text) of MBPP train tasks, formatted as the benchmark formats its prompts."""
    return [(tid, f"{text}\nYour code should pass this test:\n{test}")
            for tid, text, test in mbpp_train_tasks(directory, ids)]


def task_texts(n: int, seed: int, exclude_ids: set[int], directory: str | Path | None = None
               ) -> tuple[list[tuple[TaskKind, str]], int]:
    """task_prompts' `n` prompts, function stubs from MBPP train tasks outside `exclude_ids` (the held-out ones),
    less any that equal a benchmark prompt, and how many were dropped so. A template can write one by chance
    (session 42: "Simplify $\\sqrt{242}$." is math500's), so each is checked, not assumed impossible."""
    mbpp = [(text, test) for tid, text, test in mbpp_train_tasks(directory) if tid not in exclude_ids]
    texts = task_prompts(n, seed, mbpp)
    tests = {p.text for b in Benchmark if (benchmarks_dir(directory) / b.filename).is_file()
             for p in load_prompts(b, directory)}
    kept = [(kind, t) for kind, t in texts if t not in tests]
    return kept, len(texts) - len(kept)


def hold_out_tasks(texts: list[tuple[TaskKind, str]], n: int, seed: int, held_stubs: list[str]
                   ) -> tuple[list[tuple[TaskKind, str]], list[tuple[TaskKind, str]]]:
    """(the task prompts that train, n held out), with nothing held out also trained on: a template repeats its
    texts (4096 drawn hold ~3400 distinct), so a held-out text leaves training in every copy; and a trained MBPP
    task's stub is the same task reworded, so the held-out stubs are `held_stubs` (those of the held-out MBPP
    tasks, trained in no form), a third of the share at most, the rest drawn from the distinct template texts."""
    n_stubs = min(len(held_stubs), max(n, 0) // 3)
    kind_of = {t: k for k, t in texts if k is not TaskKind.FUNCTION_STUB}
    _, drawn = split_off(list(kind_of), n - n_stubs, seed)
    aside = set(drawn)
    return ([(k, t) for k, t in texts if t not in aside],
            [(kind_of[t], t) for t in drawn] + [(TaskKind.FUNCTION_STUB, s) for s in held_stubs[:n_stubs]])


def held_out_stubs(task_ids: set[int], directory: str | Path | None = None) -> list[str]:
    """The function stubs of the held-out MBPP train tasks (`task_ids`), in task order."""
    stubs = (function_stub(text, test) for tid, text, test in mbpp_train_tasks(directory) if tid in task_ids)
    return [s for s in stubs if s is not None]


@dataclass(frozen=True)
class PromptSet:
    """Tokenized training prompts plus held-out ones (for the acceptance measurement), and how many tokens of
    each free-generation prompt are sampled rather than greedy."""

    train: tuple[tuple[int, ...], ...]
    free: tuple[tuple[int, ...], ...]  # free-generation starts: the chat frame's prefix, BOS or a random token
    held_out: tuple[tuple[int, ...], ...]
    sources: dict[str, Any]
    user_turn_end: tuple[int, ...] = ()  # chat frame: ids closing a sampled user turn and opening the answer
    user_turn_start: tuple[int, ...] = ()  # chat frame: ids up to a user turn's text


def chat_frame(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(ids up to a user turn's text, ids from its end through the assistant's generation prompt) of the chat
    template, or None without one (or when the turn's end, the first id of the second part, is not a special
    token)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    mark = "\u2063SPLIT\u2063"  # invisible separators: no template rewrites them
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                         tokenize=False)
    head, sep, tail = text.partition(mark)
    if not sep:
        raise ValueError("the chat template does not render the user message verbatim")
    encode = lambda t: tuple(tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
    head_ids, tail_ids = encode(head), encode(tail)
    if not tail_ids or tail_ids[0] not in set(getattr(tokenizer, "all_special_ids", ())):
        return None  # the turn does not end in a special token ([INST]-style templates): no reliable stop to sample to
    return head_ids, tail_ids


def split_off(items: list, n: int, seed: int) -> tuple[list, list]:
    """(the rest, n items drawn from anywhere in `items`, seeded), both in list order: a held-out share of a list
    made in order (task kinds in turn, steered turns start by start); evenly spaced picks would alias with the
    order's period."""
    picked = set(random.Random(seed).sample(range(len(items)), min(max(n, 0), len(items))))
    return [x for i, x in enumerate(items) if i not in picked], [x for i, x in enumerate(items) if i in picked]


def build_prompts(tokenizer: Any | None, vocab: int, mbpp: int, free: int, held_out: int, seed: int,
                  random_len: int = 8, directory: str | Path | None = None, chat: bool = True,
                  tasks: int = 0, tasks_held: int = 0) -> PromptSet:
    """MBPP train prompts (when the target has a tokenizer) else random token prefixes, shuffled with `seed`;
    the last `held_out` of them are kept aside. Plus `tasks` synthetic task prompts (task_prompts), `tasks_held` of
    them held out (default none, so the held-out set stays the one earlier runs measured), and
    `free` free-generation starts: the chat frame's (chat=True and a template) or BOS / a random token."""
    rng = random.Random(seed)
    if tokenizer is not None and mbpp > 0:
        texts = mbpp_train_texts(directory)
        rng.shuffle(texts)
        texts = texts[:mbpp + held_out]
        prompts = [tuple(apply_chat_template(tokenizer, t, require_template=False)) for _, t in texts]
        source = {"kind": "mbpp-train", "task_ids": sorted(tid for tid, _ in texts[:len(texts) - held_out]),
                  "held_out_task_ids": sorted(tid for tid, _ in texts[len(texts) - held_out:])}
    else:
        n = mbpp + held_out
        prompts = [tuple(rng.randrange(3, vocab) for _ in range(random_len)) for _ in range(n)]
        source = {"kind": "random-prefixes", "count": n, "length": random_len}
    if len(prompts) <= held_out:
        raise ValueError(f"{len(prompts)} prompts cannot leave {held_out} held out and still train")
    frame = chat_frame(tokenizer) if chat else None
    train, held = tuple(prompts[:len(prompts) - held_out]), tuple(prompts[len(prompts) - held_out:])
    if tasks:
        if tokenizer is None:
            raise ValueError("task prompts need the target's tokenizer (this target has none)")
        held_ids = set(source.get("held_out_task_ids", ()))
        texts, dropped = task_texts(tasks, seed, held_ids, directory)
        stubs = held_out_stubs(held_ids, directory) if tasks_held else []
        texts, aside = hold_out_tasks(texts, tasks_held, seed, stubs)
        chat_ids = lambda ts: tuple(tuple(apply_chat_template(tokenizer, t, require_template=False)) for _, t in ts)  # noqa: E731
        train, held = train + chat_ids(texts), held + chat_ids(aside)
        source = {**source, "task_prompts": {k.value: sum(kind is k for kind, _ in texts) for k in TaskKind},
                  "task_prompts_dropped_as_benchmark_prompts": dropped}
        if aside:
            source["held_out_task_prompts"] = {k.value: sum(kind is k for kind, _ in aside) for k in TaskKind}
    if frame is not None:
        return PromptSet(train, (frame[0],) * free, held, {**source, "free_generations": free,
                                                            "free_start": "chat-user-turn"},
                         user_turn_end=frame[1], user_turn_start=frame[0])
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    starts = tuple((bos,) if bos is not None else (rng.randrange(3, vocab),) for _ in range(free))
    return PromptSet(train, starts, held,
                     {**source, "free_generations": free, "free_start": "bos" if bos is not None else "random-token"})
