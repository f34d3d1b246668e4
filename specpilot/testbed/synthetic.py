"""Random-weight models in the Hugging Face Llama layout, for kernels and cost (never for acceptance).

Each tensor is drawn from its own generator seeded by (seed, tensor name), so the same shape and seed give
the same weights whether they are generated in memory by the engine (`random_weights`) or written to a
model directory (`make_random_model`), in any order and any sharding. Scales follow a trained model's
initialization: linear and embedding weights ~ N(0, 0.02), norm weights near 1, so logits are finite and
vary from token to token.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from specpilot.engines.config import DType
from specpilot.engines.family import TargetFamily, TargetShape
from specpilot.engines.hybrid.config import QWEN3_NEXT_80B_LAYERS, QWEN3_NEXT_TINY
from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M, LlamaShape
from specpilot.testbed.modeldir import (ModelDirError, Stamp, StampKind, copy_tokenizer, replace_dir, scratch_dir,
                                        tokenizer_vocab_size)

WEIGHT_STD = 0.02
NORM_STD = 0.02
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}
# A tiny Llama with SmolLM2's vocabulary (so it can borrow SmolLM2's tokenizer) and an untied head.
TINY = LlamaShape(vocab=49152, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
# A micro Llama (64-token vocabulary, one layer) for CPU runs of the Triton kernels under the interpreter, where
# every program instance costs: the batched engine steps in ~0.1 s. With weights this small a token's greedy
# successor barely depends on context, so greedy outputs fall into short cycles within a few tokens: n-gram
# drafts get accepted, which makes it a development target for the batch regime (no tokenizer: prompts are ids).
MICRO = LlamaShape(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                   rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)


class ShapeName(str, Enum):
    TINY = "tiny"
    MICRO = "micro"
    SMOLLM2_135M = "smollm2-135m"
    LLAMA3_8B = "llama3-8b"
    # Hybrid recurrent targets (Qwen3-Next layout): generated in memory by the engine only (random_target).
    QWEN3_NEXT_TINY = "qwen3-next-tiny"
    QWEN3_NEXT_80B_LAYERS = "qwen3-next-80b-layers"

    @property
    def shape(self) -> TargetShape:
        return {ShapeName.TINY: TINY, ShapeName.MICRO: MICRO, ShapeName.SMOLLM2_135M: SMOLLM2_135M,
                ShapeName.LLAMA3_8B: LLAMA3_8B, ShapeName.QWEN3_NEXT_TINY: QWEN3_NEXT_TINY,
                ShapeName.QWEN3_NEXT_80B_LAYERS: QWEN3_NEXT_80B_LAYERS}[self]

    @property
    def family(self) -> TargetFamily:
        return TargetFamily.of_shape(self.shape)


class Init(str, Enum):
    NORMAL = "normal"  # N(0, WEIGHT_STD)
    NORM = "norm"  # 1 + N(0, NORM_STD)


@dataclass(frozen=True)
class WeightSpec:
    name: str
    dims: tuple[int, ...]
    init: Init

    def __post_init__(self) -> None:
        if not self.dims or any(d <= 0 for d in self.dims):
            raise ValueError(f"{self.name}: dims {self.dims} must be non-empty and positive")


def weight_specs(shape: LlamaShape) -> list[WeightSpec]:
    """Every tensor of a Llama-layout checkpoint of this shape, in the order Hugging Face lists them."""
    h, n = shape.hidden, Init.NORMAL
    specs = [WeightSpec("model.embed_tokens.weight", (shape.vocab, h), n)]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        specs += [WeightSpec(p + "self_attn.q_proj.weight", (shape.q_dim, h), n),
                  WeightSpec(p + "self_attn.k_proj.weight", (shape.kv_dim, h), n),
                  WeightSpec(p + "self_attn.v_proj.weight", (shape.kv_dim, h), n),
                  WeightSpec(p + "self_attn.o_proj.weight", (h, shape.q_dim), n)]
        if shape.attention_bias:
            specs += [WeightSpec(p + f"self_attn.{x}_proj.bias", (d,), n)
                      for x, d in (("q", shape.q_dim), ("k", shape.kv_dim), ("v", shape.kv_dim))]
        if shape.qk_norm:
            specs += [WeightSpec(p + f"self_attn.{x}_norm.weight", (shape.head_dim,), Init.NORM) for x in ("q", "k")]
        specs += [WeightSpec(p + "mlp.gate_proj.weight", (shape.intermediate, h), n),
                  WeightSpec(p + "mlp.up_proj.weight", (shape.intermediate, h), n),
                  WeightSpec(p + "mlp.down_proj.weight", (h, shape.intermediate), n),
                  WeightSpec(p + "input_layernorm.weight", (h,), Init.NORM),
                  WeightSpec(p + "post_attention_layernorm.weight", (h,), Init.NORM)]
    specs.append(WeightSpec("model.norm.weight", (h,), Init.NORM))
    if not shape.tie_embeddings:
        specs.append(WeightSpec("lm_head.weight", (shape.vocab, h), n))
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_tensor(spec: WeightSpec, seed: int, dtype: DType = DType.BF16, device: str = "cpu"):
    """One tensor of a random model; identical for a given (spec, seed) on every device."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, spec.name))
    t = torch.randn(spec.dims, generator=gen, dtype=torch.float32)
    t = t.mul_(WEIGHT_STD) if spec.init is Init.NORMAL else t.mul_(NORM_STD).add_(1.0)
    return t.to(device=device, dtype=DType(dtype).torch)


def random_weights(shape: LlamaShape, seed: int, dtype: DType = DType.BF16, device: str = "cpu") -> Iterator[tuple[str, object]]:
    """(name, tensor) for every weight of a random model, generated one at a time."""
    for spec in weight_specs(shape):
        yield spec.name, random_tensor(spec, seed, dtype, device)


def random_config(shape: LlamaShape, dtype: DType = DType.BF16) -> dict:
    """config.json for a random model of `shape`."""
    cfg = shape.to_hf_config()
    cfg["architectures"] = [ARCHITECTURES[shape.model_type]]
    cfg["rope_parameters"] = {"rope_theta": shape.rope_theta, "rope_type": "default"}
    cfg["dtype"] = DType(dtype).value
    cfg["initializer_range"] = WEIGHT_STD
    return cfg


def make_random_model(shape: LlamaShape | ShapeName | str, out_dir: str | os.PathLike[str], seed: int = 0,
                      dtype: DType = DType.BF16, tokenizer_dir: str | os.PathLike[str] | None = None,
                      max_shard_gb: float = 2.0) -> Path:
    """Write a random-weight model directory of `shape` (a LlamaShape or a ShapeName); return `out_dir`.

    With `tokenizer_dir`, its tokenizer files (and bos/eos ids from its config.json) are copied; the
    tokenizer must fit the shape's vocabulary. Weights above `max_shard_gb` GiB are sharded with an index.
    """
    from safetensors.torch import save_file

    name = getattr(shape, "value", shape)
    if not isinstance(shape, LlamaShape):
        try:
            shape = ShapeName(shape).shape
        except ValueError:
            raise ValueError(f"shape={shape!r}: expected a LlamaShape or one of {[s.value for s in ShapeName]}") from None
    if not isinstance(shape, LlamaShape):
        raise ValueError(f"shape={name!r}: model directories are written in the Llama layout; hybrid shapes are "
                         "generated in memory by the engine (a deployment's target: {random: <shape>})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative integer")
    dtype, out = DType(dtype), Path(out_dir).expanduser()
    cfg = random_config(shape, dtype)
    tok_dir = Path(tokenizer_dir).expanduser() if tokenizer_dir is not None else None
    if tok_dir is not None:
        if not tok_dir.is_dir():
            raise ModelDirError(f"tokenizer directory {tok_dir} does not exist")
        vocab = tokenizer_vocab_size(tok_dir)
        if vocab is not None and vocab > shape.vocab:
            raise ModelDirError(f"tokenizer in {tok_dir} has {vocab} tokens but the shape's vocabulary is {shape.vocab}")
        if (tok_dir / "config.json").is_file():
            src_cfg = json.loads((tok_dir / "config.json").read_text())
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in src_cfg:
                    cfg[key] = src_cfg[key]
    specs = weight_specs(shape)
    shard_bytes = max(1, int(max_shard_gb * (1 << 30)))
    itemsize = {DType.BF16: 2, DType.FP16: 2, DType.FP32: 4}[dtype]
    shards: list[list[WeightSpec]] = [[]]
    fill = 0
    for spec in specs:
        size = itemsize * _numel(spec.dims)
        if shards[-1] and fill + size > shard_bytes:
            shards.append([])
            fill = 0
        shards[-1].append(spec)
        fill += size
    tmp = scratch_dir(out)
    try:
        weight_map: dict[str, str] = {}
        with tqdm(total=len(specs), desc=f"random {out.name}", unit="tensor") as bar:
            for i, group in enumerate(shards):
                fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                tensors = {}
                for spec in group:
                    tensors[spec.name] = random_tensor(spec, seed, dtype)
                    weight_map[spec.name] = fname
                    bar.update(1)
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
                del tensors
        if len(shards) > 1:
            total = sum(itemsize * _numel(s.dims) for s in specs)
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps({**gen, "do_sample": False}, indent=2))
        if tok_dir is not None:
            copy_tokenizer(tok_dir, tmp)
        for p in tmp.iterdir():
            p.chmod(0o644)
        identity = {"shape": vars(shape), "seed": seed, "dtype": dtype.value}
        source_sha = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        Stamp.for_dir(tmp, StampKind.RANDOM, source_sha, identity).write(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
