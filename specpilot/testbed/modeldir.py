"""Model directories: the cache location, validation, hashing and the testbed stamp file.

A model directory is the layout Hugging Face uses: `config.json`, one `model.safetensors` (or shards plus
`model.safetensors.index.json`) and tokenizer files. Directories the testbed writes carry a stamp,
`.specpilot-testbed.json`, naming the source they were made from (sha256) and the size and sha256 of every
file written, so a second fetch or derive can tell a finished directory from a half-written one.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Iterator

STAMP_NAME = ".specpilot-testbed.json"
STAMP_FORMAT = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")
_CHUNK = 8 << 20


class ModelDirError(ValueError):
    """A model directory is missing or lacks a file the engine needs."""


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The testbed cache: `override`, else `$SPECPILOT_CACHE`, else `~/.cache/specpilot`."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("SPECPILOT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specpilot"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files a model directory holds (shards in index order when an index exists)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def check_model_dir(path: str | os.PathLike[str], require_tokenizer: bool = True) -> Path:
    """Return `path` as a Path if it is a usable model directory; raise ModelDirError saying what is wrong."""
    model_dir = Path(path).expanduser()
    if not model_dir.exists():
        raise ModelDirError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir} is not a directory (expected a model directory with config.json)")
    config = model_dir / "config.json"
    if not config.is_file():
        raise ModelDirError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{config} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelDirError(f"{config} has no model_type")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = weight_files(model_dir)
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelDirError(f"{index} is not a valid safetensors index: {e!r}") from None
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise ModelDirError(f"{model_dir} lacks weight shard(s) named in its index: {', '.join(missing)}")
    elif not weight_files(model_dir):
        raise ModelDirError(f"{model_dir} has no *.safetensors weights")
    if require_tokenizer and not has_tokenizer(model_dir):
        raise ModelDirError(f"{model_dir} has no tokenizer (expected one of {', '.join(_TOKENIZER_MARKERS)})")
    return model_dir


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / m).is_file() for m in _TOKENIZER_MARKERS)


def copy_tokenizer(src_dir: Path, dst_dir: Path, extra: Iterable[str] = (), required: bool = True) -> list[str]:
    """Copy the tokenizer files (and `extra` names) that exist in `src_dir`; return the names copied."""
    if required and not has_tokenizer(src_dir):
        raise ModelDirError(f"{src_dir} has no tokenizer (expected one of {', '.join(_TOKENIZER_MARKERS)})")
    copied = []
    for name in (*TOKENIZER_FILES, *extra):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def tokenizer_vocab_size(tokenizer_dir: Path) -> int | None:
    """Highest token id + 1 in `tokenizer.json` (None when the tokenizer is not stored that way)."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


class StampKind(str, Enum):
    GGUF = "gguf"  # converted from a GGUF file
    DERIVE = "derive"  # truncated from another model directory
    RANDOM = "random"  # random weights from a shape and a seed


@dataclass(frozen=True)
class Stamp:
    """What a testbed directory was made from, and the files it holds."""

    kind: StampKind
    source_sha256: str
    details: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"size", "mtime_ns", "sha256"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StampKind(self.kind))
        if len(self.source_sha256) != 64:
            raise ValueError(f"source_sha256={self.source_sha256!r}: expected 64 hex digits")

    @classmethod
    def for_dir(cls, model_dir: Path, kind: StampKind, source_sha256: str, details: dict[str, Any]) -> "Stamp":
        files = {p.name: {"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns, "sha256": sha256_file(p)}
                 for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != STAMP_NAME}
        return cls(kind=kind, source_sha256=source_sha256, details=details, files=files)

    def write(self, model_dir: Path) -> Path:
        path = model_dir / STAMP_NAME
        path.write_text(json.dumps({"format": STAMP_FORMAT, "kind": self.kind.value, "source_sha256": self.source_sha256,
                                    "details": self.details, "files": self.files}, indent=1, sort_keys=True))
        return path

    @classmethod
    def read(cls, model_dir: Path) -> "Stamp | None":
        path = model_dir / STAMP_NAME
        try:
            data = json.loads(path.read_text())
            if data.get("format") != STAMP_FORMAT:
                return None
            return cls(kind=data["kind"], source_sha256=data["source_sha256"], details=data.get("details", {}),
                       files=data.get("files", {}))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def matches(self, model_dir: Path, deep: bool = False) -> bool:
        """True if every stamped file is present, unmodified since stamping (same size and mtime) and, if
        `deep`, has its recorded sha256."""
        for name, meta in self.files.items():
            p = model_dir / name
            if not p.is_file():
                return False
            st = p.stat()
            if st.st_size != meta.get("size") or st.st_mtime_ns != meta.get("mtime_ns"):
                return False
            if deep and sha256_file(p) != meta["sha256"]:
                return False
        return bool(self.files)


def valid_stamp(model_dir: Path, source_sha256: str | None = None, deep: bool = False) -> Stamp | None:
    """The directory's stamp if it exists, names `source_sha256` (when given) and matches the files."""
    if not model_dir.is_dir():
        return None
    stamp = Stamp.read(model_dir)
    if stamp is None or (source_sha256 is not None and stamp.source_sha256 != source_sha256):
        return None
    return stamp if stamp.matches(model_dir, deep=deep) else None


def replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Move a finished temporary directory into place, replacing whatever was at `out_dir`."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
        tmp_dir.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp_dir.rename(out_dir)


def scratch_dir(out_dir: Path) -> Path:
    """A fresh temporary sibling of `out_dir` (same filesystem, so the final rename is atomic)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def model_identity(model_dir: Path) -> dict[str, str]:
    """sha256 of config.json and of the weights (the shard index when sharded, else every weight file).

    Weight files unmodified since a valid testbed stamp was written (same size and mtime) use the sums
    the stamp records instead of being read again; config.json and the index are always hashed.
    """
    model_dir = check_model_dir(model_dir, require_tokenizer=False)
    stamp = valid_stamp(model_dir)
    known = stamp.files if stamp is not None else {}

    def digest(p: Path) -> str:
        small = p.suffix == ".json"
        return known[p.name]["sha256"] if p.name in known and not small else sha256_file(p)

    index = model_dir / "model.safetensors.index.json"
    weights = [index] if index.is_file() else weight_files(model_dir)
    combined = hashlib.sha256("".join(f"{p.name}:{digest(p)}\n" for p in weights).encode()).hexdigest()
    return {"config_sha256": digest(model_dir / "config.json"), "weights_sha256": combined}


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (one writer per cached model across processes)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
