"""Block drafter checkpoints: SpecPilot's own format and the published DFlash format.

Ours: a directory with
  config.json        {"format": "specpilot-block-drafter", "version": 1,
                      "drafter": BlockDrafterConfig fields (vocab, hidden, layers, heads, kv_heads, head_dim,
                                 intermediate, block_size, target_layers, rms_eps, rope_theta, qk_norm,
                                 attention_bias, input_scale, logit_scale, logit_softcap, mask_token_id),
                      "target": {"layers", "hidden", "vocab", "model_type"}  (the target it was trained for),
                      "training": free-form provenance (optional)}
  model.safetensors  BlockDrafterModel.state_dict(): the DFlash tensor names below plus `mask_embed`
                     [block_size-1, hidden] (the learned mask inputs), in bf16; or, with config.json's
                     "storage": "int8-rows" (a drafter too large for the 16 MB a shipped one may take), each
                     projection weight as int8 plus `<name>.row_scale` float32 [rows] (weight = int8 x its row's
                     scale), everything else bf16.

DFlash (z-lab/dflash `DFlashDraftModel`, as SGLang loads it): a Hugging Face directory with
  config.json   hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (default
                hidden/heads), intermediate_size, rms_norm_eps, rope_theta or rope_parameters.rope_theta (default
                rotary only), attention_bias, vocab_size, num_target_layers (checked against the target);
                block_size: dflash_config.block_size, else top-level block_size;
                target_layer_ids: dflash_config.target_layer_ids, else top-level, else DFlash's rule
                  (num_target_layers // 2 for one draft layer, else num_hidden_layers ids spread evenly from
                  1 to num_target_layers-3; for targets of >= 5 layers). Ids name decoder-layer outputs before
                  the final norm (HF hidden_states[id + 1]), which is what the runner captures;
                mask_token_id: dflash_config.mask_token_id, else top-level, else the caller's argument;
                optional dflash_config.input_embedding_scale, output_multiplier, final_logit_softcapping.
                Refused: DFlash2 (architectures DFlash2DraftModel, attention_conv / candidate_selector
                tensors), is_causal = true, use_sliding_window = true, non-default rope types.
  *.safetensors fc.weight [hidden, k*hidden], hidden_norm.weight, norm.weight, and per layer N:
                layers.N.{input_layernorm,post_attention_layernorm}.weight,
                layers.N.self_attn.{q,k,v,o}_proj.weight (+ .bias when attention_bias),
                layers.N.self_attn.{q,k}_norm.weight (optional: present = Qwen3-style q/k norm),
                layers.N.mlp.{gate,up,down}_proj.weight. A leading "model." is stripped; rotary_emb buffers
                and copies of the target's embed_tokens / lm_head are ignored (the target's own are used).
The mask inputs are the target's embedding of mask_token_id, so loading a DFlash drafter needs the target.
"""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from specpilot.drafting.token_ranking import TokenRankingError, load_token_ranking
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel, default_target_layers
from specpilot.engines.llama import LlamaModel
from specpilot.engines.shapes import UnsupportedModelError

FORMAT = "specpilot-block-drafter"
VERSION = 1
_IGNORED = ("rotary_emb.", "embed_tokens.", "lm_head.")


class DrafterCheckpointError(ValueError):
    """A drafter checkpoint is missing, malformed, or does not fit the target."""


class WeightStorage(str, Enum):
    BF16 = "bf16"
    FP32 = "fp32"  # exact (tests, round trips)
    INT8_ROWS = "int8-rows"  # projection weights as int8 with a float32 scale per output row


ROW_SCALE = ".row_scale"


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name != "mask_embed"  # the projections (fc and every layer's)


def stored_tensors(state: dict[str, torch.Tensor], storage: WeightStorage) -> dict[str, torch.Tensor]:
    """A state dict as the checkpoint holds it (CPU, contiguous)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().float().cpu()
        if storage is WeightStorage.INT8_ROWS and _quantized(name, t):
            scale = t.abs().amax(dim=1).clamp_min(1e-30) / 127.0
            out[name] = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + ROW_SCALE] = scale.contiguous()
        else:
            out[name] = (t if storage is WeightStorage.FP32 else t.to(torch.bfloat16)).contiguous()
    return out


def loaded_tensors(stored: dict[str, torch.Tensor], storage: WeightStorage, where: Path) -> dict[str, torch.Tensor]:
    """stored_tensors' inverse (float32)."""
    if storage is not WeightStorage.INT8_ROWS:
        return {k: v.float() for k, v in stored.items()}
    out = {}
    for name, t in stored.items():
        if name.endswith(ROW_SCALE):
            continue
        if t.dtype == torch.int8:
            scale = stored.get(name + ROW_SCALE)
            if scale is None or scale.shape != (t.shape[0],):
                raise DrafterCheckpointError(f"{where}: {name} is int8 without a [{t.shape[0]}] {name + ROW_SCALE}")
            out[name] = t.float() * scale.float()[:, None]
        else:
            out[name] = t.float()
    return out


def as_stored(model: BlockDrafterModel, storage: WeightStorage) -> BlockDrafterModel:
    """`model` with the weights a checkpoint of `storage` gives back (rounded to bf16 or int8 rows), in place: what
    a trainer measures before it saves is then what the checkpoint holds."""
    current = model.state_dict()
    state = loaded_tensors(stored_tensors(current, storage), storage, Path("<memory>"))
    model.load_state_dict({k: v.to(current[k].dtype) for k, v in state.items()})
    return model


def save_drafter(model: BlockDrafterModel, out_dir: str | Path, target: LlamaModel,
                 training: dict[str, Any] | None = None, storage: WeightStorage = WeightStorage.BF16) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sh = target.shape
    meta = {"format": FORMAT, "version": VERSION, "drafter": model.config.to_dict(),
            "target": {"layers": sh.layers, "hidden": sh.hidden, "vocab": sh.vocab, "model_type": sh.model_type},
            "training": training or {}}
    if storage is not WeightStorage.BF16:
        meta["storage"] = storage.value
    save_file(stored_tensors(model.state_dict(), storage), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    return out


def load_drafter(path: str | Path, target: LlamaModel, mask_token_id: int | None = None) -> BlockDrafterModel:
    """Loads either format (told apart by config.json's "format"), checked against the target; float32."""
    cfg = read_config(Path(path))
    if cfg.get("format") == FORMAT:
        return _load_ours(Path(path), cfg, target)
    return load_dflash(path, target, mask_token_id)


def read_config(path: Path) -> dict[str, Any]:
    """A drafter directory's config.json (either format), or DrafterCheckpointError."""
    f = path / "config.json"
    if not f.is_file():
        raise DrafterCheckpointError(f"{path} has no config.json: not a drafter checkpoint directory")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DrafterCheckpointError(f"{f} is not valid JSON: {e}") from None


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"{path} has no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                out[name.removeprefix("model.")] = fh.get_tensor(name)
    return out


def _build(config: BlockDrafterConfig, state: dict[str, torch.Tensor], target: LlamaModel, where: Path) -> BlockDrafterModel:
    try:
        config.check_target(target.shape)
    except ValueError as e:
        raise DrafterCheckpointError(f"{where}: {e}") from None
    model = BlockDrafterModel(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise DrafterCheckpointError(f"{where}: weights missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise DrafterCheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, config implies "
                                         f"{tuple(expected[name].shape)}")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.float().eval()


def _load_ours(path: Path, cfg: dict[str, Any], target: LlamaModel) -> BlockDrafterModel:
    if cfg.get("version") != VERSION:
        raise DrafterCheckpointError(f"{path}: checkpoint version {cfg.get('version')} (this build reads {VERSION})")
    trained = cfg.get("target", {})
    if trained.get("layers") not in (None, target.shape.layers):
        raise DrafterCheckpointError(f"{path}: trained for a {trained['layers']}-layer target, this one has "
                                     f"{target.shape.layers}")
    try:
        config = BlockDrafterConfig.from_dict(cfg["drafter"])
        storage = WeightStorage(cfg.get("storage", WeightStorage.BF16.value))
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterCheckpointError(f"{path}: bad drafter config: {e}") from None
    model = _build(config, loaded_tensors(_tensors(path), storage, path), target, path)
    try:
        model.token_ranking = load_token_ranking(path, config.vocab)
    except TokenRankingError as e:
        raise DrafterCheckpointError(str(e)) from None
    return model


def load_dflash(path: str | Path, target: LlamaModel, mask_token_id: int | None = None) -> BlockDrafterModel:
    path = Path(path)
    cfg = read_config(path)
    dfc = cfg.get("dflash_config") or {}
    if "DFlash2DraftModel" in (cfg.get("architectures") or []) or cfg.get("is_causal") or cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{path}: DFlash2 / causal / sliding-window drafters are not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UnsupportedModelError(f"{path}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
    n_target = cfg.get("num_target_layers")
    if n_target is not None and n_target != target.shape.layers:
        raise DrafterCheckpointError(f"{path}: trained for a {n_target}-layer target, this one has {target.shape.layers}")
    mask = dfc.get("mask_token_id", cfg.get("mask_token_id", mask_token_id))
    if mask is None:
        raise DrafterCheckpointError(f"{path}: no mask_token_id in the config; pass the id of the tokenizer's mask "
                                     "token (DFlash adds '<|MASK|>')")
    state = {k: v for k, v in _tensors(path).items() if not k.startswith(_IGNORED)}
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        ids = dfc.get("target_layer_ids", cfg.get("target_layer_ids")) or default_target_layers(
            int(n_target or target.shape.layers), layers)
        config = BlockDrafterConfig(
            vocab=int(cfg.get("vocab_size", target.shape.vocab)), hidden=int(cfg["hidden_size"]), layers=layers,
            heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate=int(cfg["intermediate_size"]), block_size=int(dfc.get("block_size", cfg.get("block_size", 16))),
            target_layers=tuple(ids), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            qk_norm="layers.0.self_attn.q_norm.weight" in state, attention_bias=bool(cfg.get("attention_bias", False)),
            input_scale=float(dfc.get("input_embedding_scale", 1.0)), logit_scale=float(dfc.get("output_multiplier", 1.0)),
            logit_softcap=float(dfc.get("final_logit_softcapping") or 0.0), mask_token_id=int(mask))
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterCheckpointError(f"{path}: bad DFlash config: {e}") from None
    if not 0 <= config.mask_token_id < target.shape.vocab:
        raise DrafterCheckpointError(f"{path}: mask_token_id {config.mask_token_id} is outside the target's vocabulary")
    row = target.embed_tokens.weight[config.mask_token_id].detach().float().cpu()
    state["mask_embed"] = row.expand(config.block_size - 1, -1).clone()
    return _build(config, state, target, path)


def save_dflash(model: BlockDrafterModel, out_dir: str | Path, target: LlamaModel, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the DFlash layout. Only a drafter whose mask inputs are the target's embedding of its
    mask_token_id can be written (DFlash has no learned mask embeddings)."""
    from safetensors.torch import save_file

    c = model.config
    if c.mask_token_id is None:
        raise DrafterCheckpointError("this drafter has learned mask embeddings: DFlash's format cannot hold them")
    row = target.embed_tokens.weight[c.mask_token_id].detach().float().cpu()
    if not torch.equal(model.mask_embed.detach().float().cpu(), row.expand_as(model.mask_embed)):
        raise DrafterCheckpointError(f"mask inputs differ from the target's embedding of token {c.mask_token_id}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dflash = {"block_size": c.block_size, "target_layer_ids": list(c.target_layers), "mask_token_id": c.mask_token_id,
              "input_embedding_scale": c.input_scale, "output_multiplier": c.logit_scale}
    if c.logit_softcap > 0:
        dflash["final_logit_softcapping"] = c.logit_softcap
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden,
           "num_hidden_layers": c.layers, "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads,
           "head_dim": c.head_dim, "intermediate_size": c.intermediate, "rms_norm_eps": c.rms_eps,
           "rope_theta": c.rope_theta, "attention_bias": c.attention_bias, "vocab_size": c.vocab,
           "num_target_layers": target.shape.layers, "block_size": c.block_size, "hidden_act": "silu",
           "tie_word_embeddings": False, "dflash_config": dflash}
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items() if k != "mask_embed"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
