"""The engine's AR output equals transformers' greedy generate (float32, CPU); SmolLM2 end to end."""
from __future__ import annotations

import pytest
import torch
from _tiny import prompt, tiny_model

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import eos_ids, load_model, load_tokenizer, save_model


def hf_greedy(model_dir, ids, n):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("shape,seed", [("gqa", 0), ("mha_tied", 1), ("mqa", 2)])
def test_ar_matches_transformers_generate_tiny(tmp_path, shape, seed):
    model = tiny_model(shape, seed)
    save_model(model, tmp_path)
    reloaded = load_model(tmp_path, torch.float32, "cpu")
    p = prompt(model.shape.vocab, 20, seed)
    ref = hf_greedy(tmp_path, p, 40)
    for invariant in (True, False):
        cfg = EngineConfig(drafter=DrafterKind.NONE, dtype="float32", max_seq_len=128, batch_invariant=invariant)
        assert build_engine(cfg, reloaded, frozenset(), "cpu").generate(p, 40).tokens == ref


@pytest.fixture(scope="module")
def smollm2():
    from specpilot.testbed import fetch_smollm2
    return fetch_smollm2()


@pytest.mark.slow
def test_smollm2_ar_matches_transformers_float32(smollm2):
    tok = load_tokenizer(smollm2)
    model = load_model(smollm2, torch.float32, "cpu")
    for text in ("What is the capital of France?", "Write a Python function that reverses a string."):
        ids = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"])
        ref = hf_greedy(smollm2, ids, 24)
        cfg = EngineConfig(drafter=DrafterKind.NONE, dtype="float32", max_seq_len=256)
        assert build_engine(cfg, model, frozenset(), "cpu").generate(ids, 24).tokens == ref


@pytest.mark.slow
def test_smollm2_spec_equals_ar_on_all_benchmarks(smollm2):
    from specpilot.testbed import resolve_testbed
    from specpilot.workload import ALL_BENCHMARKS, apply_chat_template, load_prompts
    tok = load_tokenizer(smollm2)
    eos = eos_ids(smollm2, tok)
    model = load_model(smollm2, torch.bfloat16, "cpu")
    draft = load_model(resolve_testbed("smollm2-135m-l6"), torch.bfloat16, "cpu")
    engines = {k: build_engine(EngineConfig(drafter=k, max_seq_len=2048), model, eos, "cpu", draft_model=draft)
               for k in (DrafterKind.NONE, DrafterKind.NGRAM, DrafterKind.DRAFT_MODEL)}
    for bench in ALL_BENCHMARKS:
        ids = apply_chat_template(tok, load_prompts(bench)[0].text)
        ref = engines[DrafterKind.NONE].generate(ids, 32).tokens
        for kind in (DrafterKind.NGRAM, DrafterKind.DRAFT_MODEL):
            assert engines[kind].generate(ids, 32).tokens == ref, (bench, kind)
