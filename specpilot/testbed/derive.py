"""Derive a small draft model from a target: its first N decoder layers, final norm and LM head.

The result shares the target's tokenizer and embeddings, so it is a real (if weak) draft model for the
testbed: its predictions come from the target's own early layers read out through the target's head.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from tqdm import tqdm

from specpilot.testbed.modeldir import (ModelDirError, Stamp, StampKind, check_model_dir, copy_tokenizer,
                                        model_identity, replace_dir, scratch_dir, weight_files)

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_PER_LAYER_LISTS = ("layer_types",)  # config entries with one item per layer


def derive_truncated(src_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], layers: int) -> Path:
    """Write `out_dir`: the model in `src_dir` cut to its first `layers` decoder layers; return `out_dir`.

    The tokenizer files (if the source has any) and generation config are copied unchanged.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = check_model_dir(src_dir, require_tokenizer=False), Path(out_dir).expanduser()
    cfg = json.loads((src / "config.json").read_text())
    total = cfg.get("num_hidden_layers")
    if not isinstance(total, int):
        raise ModelDirError(f"{src / 'config.json'} has no integer num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ModelDirError(f"layers={layers!r}: a truncated draft needs 1 <= layers < {total} "
                            f"(num_hidden_layers of {src})")
    if out.resolve() == src.resolve():
        raise ModelDirError(f"derive output {out} must differ from its source")
    tensors = {}
    for shard in weight_files(src):
        with safe_open(str(shard), framework="pt") as f:
            for key in tqdm(list(f.keys()), desc=f"derive {out.name} from {shard.name}", leave=False):
                m = _LAYER_KEY.match(key)
                if m is None or int(m.group(1)) < layers:
                    tensors[key] = f.get_tensor(key).contiguous()
    kept_layers = {int(m.group(1)) for k in tensors if (m := _LAYER_KEY.match(k))}
    if kept_layers != set(range(layers)):
        raise ModelDirError(f"{src} does not hold weights for layers {sorted(set(range(layers)) - kept_layers)}")
    if "model.norm.weight" not in tensors:
        raise ModelDirError(f"{src} has no model.norm.weight (final norm); not a Llama-layout model")
    if "lm_head.weight" not in tensors and not cfg.get("tie_word_embeddings", False):
        raise ModelDirError(f"{src} has no lm_head.weight and its embeddings are not tied")
    cfg["num_hidden_layers"] = layers
    for key in _PER_LAYER_LISTS:
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    if isinstance(cfg.get("max_window_layers"), int):
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    source = model_identity(src)
    source_sha = _identity_sha(source)
    tmp = scratch_dir(out)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        copy_tokenizer(src, tmp, extra=("generation_config.json",), required=False)  # shared with the source
        for p in tmp.iterdir():
            p.chmod(0o644)
        Stamp.for_dir(tmp, StampKind.DERIVE, source_sha,
                      {"source": str(src), "source_identity": source, "layers": layers,
                       "source_layers": total}).write(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def derived_source_sha(src_dir: Path) -> str:
    """The stamp source sha256 `derive_truncated` records for a model derived from `src_dir`."""
    return _identity_sha(model_identity(src_dir))


def _identity_sha(identity: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
