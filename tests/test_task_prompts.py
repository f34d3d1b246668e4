"""Synthetic task prompts for drafter training: seeded, the three kinds in turn, function stubs that are Python, never
a held-out task or a benchmark prompt, and wired through build_prompts, TrainConfig and the command line."""
from __future__ import annotations

import argparse
import ast

import pytest
import torch

from specpilot.drafting import sources
from specpilot.drafting.cli import register_cli
from specpilot.drafting.sources import (TargetBundle, build_prompts, hold_out_tasks, mbpp_train_tasks,
                                        task_texts)
from specpilot.drafting.task_prompts import TaskKind, function_stub, task_prompts
from specpilot.drafting.train import TrainConfig, collect
from specpilot.workload import load_prompts


def stub_function(stub: str) -> ast.FunctionDef:
    fn = ast.parse(stub + "    pass\n").body[-1]  # after the typing import, where there is one
    assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn)
    return fn


def test_kinds_take_turns_and_a_seed_fixes_the_text():
    tasks = [("Write a function to add two numbers.", "assert add(1, 2) == 3")]
    a, b = task_prompts(9, 5, tasks), task_prompts(9, 5, tasks)
    assert a == b and a != task_prompts(9, 6, tasks) and len(a) == 9
    kinds = [k for k, _ in a]
    assert kinds[:3] == [TaskKind.WORD_PROBLEM, TaskKind.LATEX_PROBLEM, TaskKind.FUNCTION_STUB]
    # one MBPP task: one stub; later stub turns fall back to the other two kinds
    assert kinds.count(TaskKind.FUNCTION_STUB) == 1 and len({t for _, t in a}) == 9
    assert all("$" in t for k, t in a if k is TaskKind.LATEX_PROBLEM)
    assert all(t.rstrip().endswith("?") for k, t in a if k is TaskKind.WORD_PROBLEM)
    assert task_prompts(0, 1) == []
    with pytest.raises(ValueError, match="n=-1"):
        task_prompts(-1, 1)


def test_a_stub_is_the_tasks_signature_docstring_and_first_test():
    stub = function_stub("Write a function to find the max of a list and a bound",
                         "assert max_below([3, 9, 4], 8) == 4")
    assert stub.startswith("from typing import List\n\n\ndef max_below(items: List[int], n: int) -> int:\n")
    fn = stub_function(stub)
    assert fn.name == "max_below" and [a.arg for a in fn.args.args] == ["items", "n"]
    doc = ast.get_docstring(fn)
    assert doc.startswith("Write a function to find the max of a list and a bound.")
    assert ">>> max_below([3, 9, 4], 8)\n4" in doc
    # repeated literal kinds get distinct names
    assert [a.arg for a in stub_function(function_stub("t", "assert f('a', 'b') == 'ab'")).args.args] == ["text", "text1"]
    # no obvious hint: a bare name; mixed lists: list
    assert function_stub("t", "assert g(h(1), [1, 'a']) == None").startswith("def g(arg, items: list):\n")


@pytest.mark.parametrize("test", ["assert f(1) != 2", "assert f(x=1) == 2", "assert obj.f(1) == 2", "x = f(1)",
                                  "assert f(1) == 2 == 2", "assert (", ""])
def test_tests_not_of_the_assert_call_equals_form_give_no_stub(test):
    assert function_stub("Write a function.", test) is None


def test_every_mbpp_train_stub_is_python():
    stubs = [s for _, text, test in mbpp_train_tasks() if (s := function_stub(text, test)) is not None]
    assert len(stubs) > 300  # of 374 train tasks
    for s in stubs:
        stub_function(s)


def test_task_texts_skip_held_out_tasks_and_drop_benchmark_prompts(monkeypatch):
    rows = mbpp_train_tasks()
    held = {tid for tid, _, _ in rows[:200]}
    held_stubs = {function_stub(text, test) for tid, text, test in rows if tid in held}
    texts, _ = task_texts(900, 1, held)
    stubs = [t for k, t in texts if k is TaskKind.FUNCTION_STUB]
    assert stubs and not set(stubs) & held_stubs
    test_prompt = load_prompts("math500")[0].text
    mine = (TaskKind.LATEX_PROBLEM, "Simplify $\\sqrt{2}$ once more.")
    monkeypatch.setattr(sources, "task_prompts",
                        lambda n, seed, tasks: [(TaskKind.LATEX_PROBLEM, test_prompt), mine])
    assert task_texts(2, 1, set()) == ([mine], 1)


def test_the_templates_can_write_a_math500_prompt_and_it_is_dropped():
    # session 42's training call stopped on this one: seed 5, 4096 task prompts
    texts, dropped = task_texts(4096, 5, set())
    assert dropped >= 1
    assert "Simplify $\\sqrt{242}$." not in {t for _, t in texts}


def test_build_prompts_trains_on_tasks_and_keeps_the_held_out_set():
    from specpilot.engines.loader import load_tokenizer
    from specpilot.testbed import fetch_smollm2
    tok = load_tokenizer(fetch_smollm2())
    plain = build_prompts(tok, 49152, 20, 3, 4, seed=2)
    with_tasks = build_prompts(tok, 49152, 20, 3, 4, seed=2, tasks=7)
    assert with_tasks.held_out == plain.held_out and with_tasks.free == plain.free
    assert with_tasks.train[:len(plain.train)] == plain.train and len(with_tasks.train) == len(plain.train) + 7
    assert with_tasks.sources["task_prompts"] == {"word_problem": 3, "latex_problem": 2, "function_stub": 2}
    assert "<|im_start|>assistant" in tok.decode(list(with_tasks.train[-1]))  # chat-framed as the benchmarks are
    with pytest.raises(ValueError, match="tokenizer"):
        build_prompts(None, 100, 4, 0, 1, seed=0, tasks=2)


def test_train_config_and_command_line_take_task_prompts(tmp_path):
    with pytest.raises(ValueError, match="task_prompts"):
        TrainConfig(task_prompts=-1)
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["drafter", "train", "--target", "t", "--out", str(tmp_path), "--task-prompts", "64",
                              "--held-out-each", "8"])
    assert (args.task_prompts, args.held_out_each) == (64, 8)


def test_collect_generates_answers_to_the_task_prompts():
    c = TrainConfig(mbpp_prompts=4, free_prompts=0, task_prompts=5, held_out=2, gen_tokens=4, block_size=4,
                    layers=1, progress=False)
    data, held, _, provenance = collect(tiny_chat_bundle(3), c, (0,))
    assert len(data) == 4 + 5 and len(held) == 2
    assert provenance["task_prompts"] == {"word_problem": 2, "latex_problem": 2, "function_stub": 1}

def tiny_chat_bundle(seed: int = 4) -> TargetBundle:
    from specpilot.engines.loader import load_tokenizer, random_model
    from specpilot.engines.shapes import LlamaShape
    from specpilot.testbed import fetch_smollm2
    tok = load_tokenizer(fetch_smollm2())
    shape = LlamaShape(vocab=49152, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8, intermediate=32,
                       rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
    return TargetBundle("tiny-chat", random_model(shape, torch.float32, "cpu", seed=seed), tok,
                        frozenset({tok.eos_token_id}))


def test_steered_generations_open_the_user_turn_with_each_start_in_turn():
    """A steered free generation: the chat frame, one of TURN_STARTS, the target's sampled rest of the turn, the
    frame's close; the starts share the count evenly, the first ones taking the remainder."""
    from specpilot.drafting.task_prompts import TURN_STARTS
    from specpilot.drafting.train import steered_prompts
    bundle = tiny_chat_bundle()
    tok = bundle.tokenizer
    n = 5  # fewer than the starts: the first five take one each
    c = TrainConfig(mbpp_prompts=4, free_prompts=0, steered_prompts=n, held_out=2, user_tokens=5, gen_tokens=4,
                    block_size=4, layers=1, progress=False)
    ps = build_prompts(tok, 49152, 4, 0, 2, seed=0)
    prompts = steered_prompts(bundle, ps, c)
    assert 0 < len(prompts) <= n  # turns the target ended at once are dropped
    head, tail = list(ps.user_turn_start), list(ps.user_turn_end)
    starts = [head + tok.encode(s, add_special_tokens=False) for s in TURN_STARTS]
    opened = [next(i for i, s in enumerate(starts) if p[:len(s)] == s) for p in prompts]
    assert opened == sorted(opened) and max(opened) < n  # start by start, in order
    assert all(p[-len(tail):] == tail and tail[0] not in p[len(starts[i]):-len(tail)] for p, i in zip(prompts, opened))
    assert steered_prompts(bundle, ps, c) == prompts  # seeded
    data, _, _, provenance = collect(bundle, c, (0,))
    assert provenance["steered_generations"] == len(prompts) and provenance["turn_starts"] == len(TURN_STARTS)
    assert len(data) == 4 + len(prompts)


def test_steered_generations_need_a_chat_frame():
    from specpilot.drafting.train import steered_prompts
    bundle = tiny_chat_bundle()
    ps = build_prompts(bundle.tokenizer, 49152, 4, 0, 2, seed=0, chat=False)
    with pytest.raises(ValueError, match="chat template"):
        steered_prompts(bundle, ps, TrainConfig(steered_prompts=3))
    with pytest.raises(ValueError, match="steered_prompts"):
        TrainConfig(steered_prompts=-2)
    with pytest.raises(ValueError, match="no-chat-free"):  # a frame the target has, switched off
        TrainConfig(steered_prompts=3, chat_free=False)


def test_split_off_spaces_the_held_share_through_the_list():
    from specpilot.drafting.sources import split_off
    rest, held = split_off(list(range(12)), 4, seed=3)
    assert len(held) == 4 and sorted(rest + held) == list(range(12)) and held == sorted(held) and rest == sorted(rest)
    assert split_off(list(range(12)), 4, seed=3) == (rest, held) != split_off(list(range(12)), 4, seed=4)
    assert split_off([1, 2], 5, 0) == ([], [1, 2]) and split_off([1, 2], 0, 0) == ([1, 2], [])


def test_a_held_out_task_text_trains_in_no_copy_and_held_out_stubs_are_held_out_tasks():
    W, L, F = TaskKind.WORD_PROBLEM, TaskKind.LATEX_PROBLEM, TaskKind.FUNCTION_STUB
    texts = [(W, "a?"), (L, "$b$"), (F, "def f():"), (W, "a?"), (L, "$c$"), (F, "def g():"), (W, "a?"), (L, "$b$")]
    for seed in range(8):
        rest, aside = hold_out_tasks(texts, 3, seed, ["def held():"])
        assert len(aside) == 3 and (F, "def held():") in aside  # a third of the share: the held-out task's stub
        assert not {t for _, t in rest} & {t for _, t in aside}  # every copy of a held-out text left training
        assert len(rest) == len(texts) - sum(t == h for _, t in texts for _, h in aside)
        assert [x for x in texts if x in rest] == rest  # the rest keeps its order (kinds in turn)
    assert hold_out_tasks(texts, 2, 0, ["def held():"])[1][-1][0] is not F  # 2 // 3: no stub
    assert hold_out_tasks(texts, 0, 0, ["def held():"]) == (texts, [])
    assert hold_out_tasks(texts, 9, 0, [])[1].__len__() == 3  # no more than the distinct non-stub texts


def test_held_out_task_prompts_share_nothing_with_training_at_session_scale():
    """Session 43's data (4096 task prompts, 8 held out of each source): templates repeat their texts, so a held-out
    draw used to sit in training too (17 of 80 in a review's run), and a stub of a trained MBPP task was held out."""
    from specpilot.engines.loader import load_tokenizer
    from specpilot.testbed import fetch_smollm2
    tok = load_tokenizer(fetch_smollm2())
    for held in (8, 240):  # 240: a share large enough that the old draw put 36 held-out prompts in training too
        ps = build_prompts(tok, 49152, 366, 0, 8, seed=7, tasks=4096, tasks_held=held)
        assert len(ps.held_out) == 8 + held and not set(ps.held_out) & set(ps.train)
        n_stubs = ps.sources["held_out_task_prompts"]["function_stub"]
        assert n_stubs == min(held // 3, 8)  # at most the 8 held-out MBPP tasks' stubs
        held_ids = set(ps.sources["held_out_task_ids"])
        stubs = {function_stub(text, test) for tid, text, test in mbpp_train_tasks() if tid in held_ids}
        held_text = [tok.decode(list(p)) for p in ps.held_out]
        assert sum(any(s in h for h in held_text) for s in stubs if s) == n_stubs


def test_held_out_each_holds_out_every_source_it_trains_on():
    """held_out_each: task prompts (each kind), steered turns and free chat turns join the MBPP held-out prompts, so
    the held-out measurement (and the step it keeps) covers the training mix; the rest still trains."""
    base = dict(mbpp_prompts=4, free_prompts=4, task_prompts=6, steered_prompts=4, held_out=2, user_tokens=5,
                gen_tokens=4, block_size=4, layers=1, progress=False)
    bundle = tiny_chat_bundle(5)
    data0, held0, prompts0, prov0 = collect(bundle, TrainConfig(**base), (0,))
    data, held, prompts, prov = collect(bundle, TrainConfig(**base, held_out_each=2), (0,))
    assert len(prompts0) == 2 and prov0["held_out_prompts"] == 2 and "held_out_task_prompts" not in prov0
    assert sum(prov["held_out_task_prompts"].values()) == 2
    assert sum(prov["task_prompts"].values()) == 4  # 6 written, 2 of them held out
    assert prompts[:2] == prompts0  # the MBPP ones first, as before
    assert len(prompts) == prov["held_out_prompts"] == 2 + 2 + 2 + 2  # + tasks, steered turns, chat turns
    assert len(held) == len(prompts) and len(data) == len(data0) - 6
    trained = {tuple(data.tokens[i, :int(data.prompt_len[i])].tolist()) for i in range(len(data))}
    assert not trained & {tuple(p) for p in prompts}  # nothing held out is trained on
    with pytest.raises(ValueError, match="held_out_each"):
        TrainConfig(held_out_each=-1)
    for name in ("free_prompts", "task_prompts", "steered_prompts"):  # a source held out whole trains nothing
        with pytest.raises(ValueError, match=f"{name}=3 with held_out_each=3 holds all"):
            TrainConfig(**{name: 3}, held_out_each=3)
    assert TrainConfig(free_prompts=3, held_out_each=3, chat_free=False).free_prompts == 3  # from BOS: none held
