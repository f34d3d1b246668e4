"""Shared fixtures for the tuning-loop tests: tiny real deployments and one Prefect test harness.

The tiny target is a real Llama-family model directory (SmolLM2's tokenizer, a tiny shape) whose weights make
its greedy output repetitive in a known way: it recites the system prompt SmolLM2's chat template puts in
every prompt ("You are a helpful AI assistant named SmolLM, trained by Hugging Face") over and over. Every
attention and MLP output projection is zero, so each layer passes its input through, and the LM head maps
each of those tokens to the next one (the last back to the first, and the newline that ends the prompt to
the first). The n-gram drafter finds the text in the prompt from the first step, so its proposals are as long
as its draft length allows: a longer draft than stock's 5 wins measurably, as on real repetitive outputs.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Without CUDA the Triton kernels run under the interpreter. It must be on before triton is first imported:
    # whatever was decorated earlier (triton.language's own jit functions included) stays compiled for good.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specpilot.engines.loader import random_model, save_model
from specpilot.engines.shapes import LlamaShape

# SmolLM2's vocabulary (its tokenizer), everything else as small as a Llama shape allows: fast on two cores.
ECHO_SHAPE = LlamaShape(vocab=49152, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8, intermediate=32,
                        rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def system_prompt_cycle(tokenizer) -> tuple[list[int], int]:
    """The chat template's default system prompt tokens (distinct) and the newline token that precedes them."""
    from specpilot.workload import apply_chat_template

    ids = apply_chat_template(tokenizer, "x")
    newline, end = ids[2], ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    cycle = ids[3:end]
    assert len(set(cycle)) == len(cycle) <= ECHO_SHAPE.hidden and newline not in cycle
    return cycle, newline


def write_echo_model(out_dir: Path, seed: int) -> Path:
    """An ECHO_SHAPE model that recites the default system prompt cyclically after any prompt."""
    from transformers import AutoTokenizer

    from specpilot.testbed import fetch_smollm2

    tokenizer_dir = Path(fetch_smollm2())
    cycle, newline = system_prompt_cycle(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    model = random_model(ECHO_SHAPE, torch.float32, "cpu", seed=seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, token in enumerate(cycle):
            direction = torch.zeros(ECHO_SHAPE.hidden)
            direction[i] = 1.0
            model.embed_tokens.weight[token] = direction
            model.lm_head.weight[cycle[(i + 1) % len(cycle)]] = direction * 4.0
        model.embed_tokens.weight[newline] = model.embed_tokens.weight[cycle[-1]]  # "\n" -> the first token too
    save_model(model, out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def write_deployment(root: Path, name: str, model_dir: Path, max_new_tokens: int = 32) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(f"""
name: {name}
description: tiny echo model for the tuning-loop tests
target: {{path: {model_dir}}}
drafters:
  - kind: ngram
device: {{kind: cpu}}
workload: {{benchmarks: [gsm8k, humaneval], prompts_per_benchmark: 1, max_new_tokens: {max_new_tokens}, seed: 0}}
engine: {{dtype: float32, cuda_graphs: false, max_seq_len: 1024}}
""")
    return path


def pytest_collection_modifyitems(config, items):
    """`interpreter` tests launch kernels on CPU tensors: a GPU host runs them only under the interpreter (as
    scripts/test.sh does); run bare there (compiled kernels, the GPU checks), they skip instead of failing."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="launches Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
    for item in items:
        if item.get_closest_marker("interpreter"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls run fastest on one torch thread, and 20-50x slower when two threads contend with other jobs for
    2 cores. Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-deployments")


@pytest.fixture(scope="session")
def tiny_deployment(tiny_root) -> Path:
    """Deployment `tiny-a` (YAML path): the echo model on CPU, one ngram drafter, 2 benchmarks x 1 prompt."""
    return write_deployment(tiny_root, "tiny-a", write_echo_model(tiny_root / "model-a", seed=3))


@pytest.fixture(scope="session")
def tiny_deployment_b(tiny_root) -> Path:
    """A different deployment (another model of the same family) for memory-first tests."""
    return write_deployment(tiny_root, "tiny-b", write_echo_model(tiny_root / "model-b", seed=4))


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's test harness (a temporary database and API), started once per session (~8 s)."""
    import os
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness():
        yield


@pytest.fixture(scope="session", autouse=True)
def no_agent_api_key():
    """Tests never reach the Anthropic API: the agent proposer runs only against recorded responses, injected
    as a client. Without this, a key in the developer's environment would switch it on in every explore stage."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("ANTHROPIC_API_KEY", raising=False)
        yield
