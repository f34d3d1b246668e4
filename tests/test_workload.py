"""Workload: prompt sets as the benchmarks README describes them, disjoint deterministic splits, chat formatting."""
from __future__ import annotations

import json
import random

import pytest

from specpilot.testbed import cache_dir
from specpilot.workload import (Benchmark, ChatTemplateError, Prompt, WorkloadError, WorkloadSpec, apply_chat_template,
                                benchmarks_dir, load_all, load_prompts, split)

README_COUNTS = {"gsm8k": 1319, "humaneval": 164, "math500": 500, "mbpp": 500, "mt_bench": 80}  # mbpp: test split


@pytest.fixture(scope="module")
def prompts() -> dict[Benchmark, list[Prompt]]:
    return load_all()


def test_counts_match_the_readme(prompts):
    assert {b.value: len(p) for b, p in prompts.items()} == README_COUNTS
    assert all(b.expected_count == README_COUNTS[b.value] for b in Benchmark)
    for bench, ps in prompts.items():
        assert len({p.id for p in ps}) == len(ps) and all(p.benchmark is bench for p in ps)


def test_prompt_fields_follow_the_readme(prompts):
    rows = {b: [json.loads(line) for line in (benchmarks_dir() / b.filename).open()] for b in Benchmark}
    assert [p.text for p in prompts[Benchmark.GSM8K]] == [r["question"] for r in rows[Benchmark.GSM8K]]
    assert [p.text for p in prompts[Benchmark.HUMANEVAL]] == [r["prompt"] for r in rows[Benchmark.HUMANEVAL]]
    assert [p.text for p in prompts[Benchmark.MATH500]] == [r["problem"] for r in rows[Benchmark.MATH500]]
    assert [p.text for p in prompts[Benchmark.MT_BENCH]] == [r["turns"][0] for r in rows[Benchmark.MT_BENCH]]
    test_rows = [r for r in rows[Benchmark.MBPP] if 11 <= r["task_id"] <= 510]
    assert [p.id for p in prompts[Benchmark.MBPP]] == [str(r["task_id"]) for r in test_rows]
    for p, r in zip(prompts[Benchmark.MBPP], test_rows):
        assert p.text.startswith(r["text"]) and p.text.endswith(r["test_list"][0])


def test_benchmarks_dir_search_order(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_BENCHMARKS", str(tmp_path))
    assert benchmarks_dir() == tmp_path
    assert benchmarks_dir(tmp_path / "..") == tmp_path / ".."  # the argument wins over the env var
    monkeypatch.setenv("SPECPILOT_BENCHMARKS", str(tmp_path / "missing"))
    with pytest.raises(WorkloadError, match="no benchmarks directory found"):
        benchmarks_dir()


def test_malformed_files_name_the_line(tmp_path):
    (tmp_path / "mt_bench.questions.jsonl").write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2}\n')
    with pytest.raises(WorkloadError, match=r"mt_bench.questions.jsonl:2: missing or malformed prompt field 'turns'"):
        load_prompts("mt_bench", tmp_path)
    (tmp_path / "gsm8k.test.jsonl").write_text("{not json\n")
    with pytest.raises(WorkloadError, match=r"gsm8k.test.jsonl:1: invalid JSON"):
        load_prompts(Benchmark.GSM8K, tmp_path)
    with pytest.raises(WorkloadError, match="humaneval.jsonl does not exist"):
        load_prompts("humaneval", tmp_path)


def test_splits_are_disjoint_for_every_size_and_seed(prompts):
    for bench, ps in prompts.items():
        pool = len(ps) // 2
        for seed in (0, 1, 7):
            for n in (1, 2, pool // 3, pool):
                s = split(ps, n, n, seed)
                assert len(s.tune) == len(s.validate) == n
                assert not {p.key for p in s.tune} & {p.key for p in s.validate}, (bench, seed, n)


def test_splits_are_deterministic_nested_and_seeded(prompts):
    ps = prompts[Benchmark.HUMANEVAL]
    a = split(ps, 10, 10, seed=0)
    shuffled = list(ps)
    random.Random(5).shuffle(shuffled)
    assert split(shuffled, 10, 10, seed=0) == a  # independent of input order
    bigger = split(ps, 30, 40, seed=0)
    assert bigger.tune[:10] == a.tune and bigger.validate[:10] == a.validate  # more prompts only add
    assert split(ps, 10, 10, seed=1) != a
    full = split(ps, 82, 82, seed=0)
    assert {p.key for p in full.tune} | {p.key for p in full.validate} == {p.key for p in ps}


def test_split_rejects_impossible_requests(prompts):
    ps = prompts[Benchmark.MT_BENCH]
    with pytest.raises(WorkloadError, match="asked for 41 tune"):
        split(ps, 41, 1, seed=0)
    with pytest.raises(WorkloadError, match="must sum to <= 1"):
        split(ps, 1, 1, seed=0, tune_fraction=0.6, validate_fraction=0.6)
    with pytest.raises(WorkloadError, match="tune_n=-1"):
        split(ps, -1, 1, seed=0)
    with pytest.raises(WorkloadError, match="distinct"):
        split([ps[0], ps[0]], 0, 0, seed=0)
    small = split(ps, 8, 4, seed=3, tune_fraction=0.1, validate_fraction=0.05)  # pools of exactly 8 and 4
    assert (len(small.tune), len(small.validate)) == (8, 4) and not set(small.tune) & set(small.validate)
    with pytest.raises(WorkloadError, match="pools of 8 / 4"):
        split(ps, 9, 4, seed=3, tune_fraction=0.1, validate_fraction=0.05)


def test_workload_spec_selects_per_benchmark(prompts):
    spec = WorkloadSpec(benchmarks=("mbpp", "gsm8k"), prompts_per_benchmark=3, max_new_tokens=16, seed=2)
    s = spec.select()
    assert [p.benchmark for p in s.tune] == [Benchmark.MBPP] * 3 + [Benchmark.GSM8K] * 3
    assert not {p.key for p in s.tune} & {p.key for p in s.validate}
    assert spec.select() == s
    with pytest.raises(WorkloadError, match="benchmarks="):
        WorkloadSpec(benchmarks=("gsm8k", "gsm8k"))
    with pytest.raises(WorkloadError, match="max_new_tokens=0"):
        WorkloadSpec(max_new_tokens=0)


def _built_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "hello", "world", "what", "is", "2+2?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    fast.chat_template = chat_template
    return fast


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_template_formats_a_user_turn():
    smollm2 = cache_dir() / "models" / "smollm2-135m"
    if (smollm2 / "tokenizer.json").is_file():  # the real testbed tokenizer when the cache has it
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(smollm2))
        ids = apply_chat_template(tok, "What is 2+2?")
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
        assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(ids[0]) == 3
    else:
        tok = _built_tokenizer(TEMPLATE)
        assert tok.convert_ids_to_tokens(apply_chat_template(tok, "what is 2+2?")) == \
            ["<s>", "<|user|>", "what", "is", "2+2?", "<|assistant|>"]


def test_chat_template_on_a_built_tokenizer_and_the_no_template_fallback():
    tok = _built_tokenizer(TEMPLATE)
    ids = apply_chat_template(tok, "hello world")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "<|user|>", "hello", "world", "<|assistant|>"]  # one BOS only
    plain = _built_tokenizer(None)
    with pytest.raises(ChatTemplateError, match="has no chat template; pass require_template=False"):
        apply_chat_template(plain, "hello world")
    assert plain.convert_ids_to_tokens(apply_chat_template(plain, "hello world", require_template=False)) == \
        ["<s>", "hello", "world"]
