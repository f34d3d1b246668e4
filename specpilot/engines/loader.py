"""Load a Llama-family model directory (config.json + safetensors) or build one with random weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.engines.llama import LlamaModel
from specpilot.engines.shapes import LlamaShape, UnsupportedModelError


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, or inconsistent."""


class TokenizerMismatchError(ValueError):
    """A drafter's tokenizer does not match the target's."""


def read_shape(model_dir: Path) -> LlamaShape:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
    return LlamaShape.from_hf_config(cfg)


def load_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device) -> LlamaModel:
    """Reads HF tensor names, fusing q/k/v into qkv_proj and gate/up into gate_up_proj."""
    model_dir = Path(model_dir)
    shape = read_shape(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    tensors = read_safetensors(files)
    with torch.device("meta"):
        model = LlamaModel(shape)
    state = {}

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ModelLoadError(f"{model_dir}: weight {name!r} missing") from None

    state["embed_tokens.weight"] = take("model.embed_tokens.weight")
    state["norm.weight"] = take("model.norm.weight")
    if not shape.tie_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    tensors.pop("lm_head.weight", None)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        state[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")])
        if shape.attention_bias:
            state[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
        if shape.qk_norm:
            state[f"layers.{i}.self_attn.q_norm.weight"] = take(a + "q_norm.weight")
            state[f"layers.{i}.self_attn.k_norm.weight"] = take(a + "k_norm.weight")
        state[f"layers.{i}.self_attn.o_proj.weight"] = take(a + "o_proj.weight")
        state[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        state[f"layers.{i}.mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        state[f"layers.{i}.input_layernorm.weight"] = take(p + "input_layernorm.weight")
        state[f"layers.{i}.post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    leftovers = [k for k in tensors if "rotary_emb" not in k]
    if leftovers:
        raise UnsupportedModelError(f"{model_dir}: unexpected weights {leftovers[:5]} (not a plain Llama-family model)")
    for name, t in state.items():
        expected = _param(model, name).shape
        if tuple(t.shape) != tuple(expected):
            raise ModelLoadError(f"{model_dir}: {name} has shape {tuple(t.shape)}, config implies {tuple(expected)}")
    model = model.to_empty(device=device).to(dtype)
    missing, _ = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if missing:
        raise ModelLoadError(f"{model_dir}: weights missing for {missing[:5]}")
    _init_buffers(model, device)  # after the dtype cast: rotary frequencies stay float32
    return model.eval().requires_grad_(False)


def read_safetensors(files, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """Every tensor (whose name `keep` accepts) of the given safetensors files, by name."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if keep(name):
                    tensors[name] = fh.get_tensor(name)
    return tensors


def random_model(shape: LlamaShape, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> LlamaModel:
    """Random weights scaled like a trained model (std 0.02 projections, unit norms): for kernels and cost."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = LlamaModel(shape)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02))
    _init_buffers(model, device)
    return model.eval().requires_grad_(False)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(f"{model_dir} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    return AutoTokenizer.from_pretrained(str(model_dir))


def check_same_tokenizer(target_tok, drafter_tok, drafter_name: str) -> None:
    if target_tok.get_vocab() != drafter_tok.get_vocab():
        raise TokenizerMismatchError(
            f"drafter {drafter_name!r} uses a different tokenizer from the target (vocabularies differ: "
            f"{len(drafter_tok)} vs {len(target_tok)} tokens); a draft model must share the target's tokenizer")


def eos_ids(model_dir: Path | None, tokenizer=None) -> frozenset[int]:
    """EOS ids from generation_config.json / config.json / the tokenizer, all of them (chat models have several)."""
    ids: set[int] = set()
    if model_dir is not None:
        for fname in ("generation_config.json", "config.json"):
            f = Path(model_dir) / fname
            if f.is_file():
                v = json.loads(f.read_text()).get("eos_token_id")
                ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _param(model: torch.nn.Module, name: str) -> torch.Tensor:
    obj = model
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _init_buffers(model: LlamaModel, device) -> None:
    sh = model.shape
    model.inv_freq = 1.0 / (sh.rope_theta ** (torch.arange(0, sh.head_dim, 2, dtype=torch.float32, device=device) / sh.head_dim))


def save_model(model: LlamaModel, out_dir: Path) -> Path:
    """Writes the model as a Hugging Face directory (config.json + model.safetensors, unfused names)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sh = model.shape
    st = model.state_dict()
    out = {"model.embed_tokens.weight": st["embed_tokens.weight"], "model.norm.weight": st["norm.weight"]}
    if not sh.tie_embeddings:
        out["lm_head.weight"] = st["lm_head.weight"]
    for i in range(sh.layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        q, k, v = st[f"layers.{i}.self_attn.qkv_proj.weight"].split([sh.q_dim, sh.kv_dim, sh.kv_dim])
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                    a + "o_proj.weight": st[f"layers.{i}.self_attn.o_proj.weight"]})
        if sh.attention_bias:
            qb, kb, vb = st[f"layers.{i}.self_attn.qkv_proj.bias"].split([sh.q_dim, sh.kv_dim, sh.kv_dim])
            out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
        if sh.qk_norm:
            out[a + "q_norm.weight"] = st[f"layers.{i}.self_attn.q_norm.weight"]
            out[a + "k_norm.weight"] = st[f"layers.{i}.self_attn.k_norm.weight"]
        gate, up = st[f"layers.{i}.mlp.gate_up_proj.weight"].split(sh.intermediate)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": st[f"layers.{i}.mlp.down_proj.weight"],
                    p + "input_layernorm.weight": st[f"layers.{i}.input_layernorm.weight"],
                    p + "post_attention_layernorm.weight": st[f"layers.{i}.post_attention_layernorm.weight"]})
    save_file({k: v.detach().contiguous().cpu() for k, v in out.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(sh.to_hf_config(), indent=2))
    return out_dir
