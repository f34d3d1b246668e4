"""The W12 file layout: pack a bf16 model, load it back with its round trip checked, verify it against the source.

A packed directory holds
- `model-NNNNN.w12`: safetensors shards of the component arrays, key `<tensor name>:<component>` (lo, codes,
  tables, group_ends, escapes; see format.py). The extension keeps Hugging Face loaders from globbing them;
- `w12.json`: the manifest: format, source, group_rows, per tensor its shape, shard, sha256 of the original bf16
  bytes and stats (escapes, escape rate, bytes per weight), the totals, and every shard's sha256;
- the source's other files (config.json, tokenizer, generation config), so the directory describes its model.
Tensor names are the source's: Hugging Face names for a model directory, module names for a LlamaModel.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from specpilot.weights.format import (W12Error, W12Stats, W12Tensor, bitwise_equal, decode, encode, sha256_bf16,
                                      sum_stats)

MANIFEST_NAME = "w12.json"
FORMAT = "specpilot-w12/1"
SHARD_BYTES = 2 << 30  # a shard is closed once it holds this many bytes
_SEP = ":"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    file: str  # the shard holding its components
    sha256: str  # of the source bf16 bytes: what decoding must reproduce
    stats: W12Stats

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "file": self.file, "sha256": self.sha256,
                **self.stats.as_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorEntry":
        stats = W12Stats(d["numel"], d["escapes"], d["groups"], d["stored_bytes"], d["kernel_bytes"])
        return cls(d["name"], tuple(d["shape"]), d["file"], d["sha256"], stats)


@dataclass(frozen=True)
class W12Manifest:
    source: str
    group_rows: int | None
    tensors: tuple[TensorEntry, ...]
    files: tuple[tuple[str, str], ...]  # (shard name, sha256)

    @property
    def totals(self) -> W12Stats:
        return sum_stats(e.stats for e in self.tensors)

    def entry(self, name: str) -> TensorEntry:
        for e in self.tensors:
            if e.name == name:
                return e
        raise W12Error(f"tensor {name!r} is not in the W12 pack")

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "source": self.source, "group_rows": self.group_rows,
                           "totals": self.totals.as_dict(), "files": {n: h for n, h in self.files},
                           "tensors": [e.to_dict() for e in self.tensors]}, indent=1)

    @classmethod
    def read(cls, packed_dir: Path) -> "W12Manifest":
        path = Path(packed_dir) / MANIFEST_NAME
        if not path.is_file():
            raise W12Error(f"{packed_dir} has no {MANIFEST_NAME}: not a W12 pack")
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT:
                raise W12Error(f"{path}: format {d.get('format')!r}, expected {FORMAT!r}")
            return cls(d["source"], d["group_rows"], tuple(TensorEntry.from_dict(e) for e in d["tensors"]),
                       tuple(sorted(d["files"].items())))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise W12Error(f"{path} is not a valid W12 manifest: {e!r}") from None


def iter_source(source: Path | torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight: a model directory's safetensors in file and key order, or a module's state."""
    if isinstance(source, torch.nn.Module):
        yield from source.state_dict().items()
        return
    from safetensors import safe_open

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise W12Error(f"{source} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in sorted(fh.keys()):
                yield name, fh.get_tensor(name)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pack_model(source: Path | torch.nn.Module, out_dir: Path, *, group_rows: int | None = None,
               shard_bytes: int = SHARD_BYTES) -> W12Manifest:
    """Encode every tensor of a bf16 model (directory or LlamaModel) into a W12 pack in out_dir, one at a time."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: list[TensorEntry] = []
    files: list[tuple[str, str]] = []
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.w12"
        save_file(shard, str(out_dir / name), metadata={"format": FORMAT})
        files.append((name, _file_sha256(out_dir / name)))
        shard.clear()

    for name, t in iter_source(source):
        if _SEP in name:
            raise W12Error(f"tensor name {name!r} contains {_SEP!r}, the pack's key separator")
        if t.dtype != torch.bfloat16:
            raise W12Error(f"{name} is {t.dtype}: W12 packs bf16 models only")
        w = encode(t, group_rows=group_rows)
        if not bitwise_equal(decode(w), t):
            raise W12Error(f"{name}: W12 round trip is not exact")
        shard.update({f"{name}{_SEP}{k}": v.cpu() for k, v in w.components().items()})
        entries.append(TensorEntry(name, tuple(t.shape), f"model-{len(files) + 1:05d}.w12", sha256_bf16(t), w.stats))
        if sum(v.numel() * v.element_size() for v in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    if isinstance(source, torch.nn.Module):
        shape = getattr(source, "shape", None)
        if shape is not None and hasattr(shape, "to_hf_config"):
            (out_dir / "config.json").write_text(json.dumps(shape.to_hf_config(), indent=2))
    else:
        for f in sorted(Path(source).iterdir()):  # config, tokenizer, generation config: not the bf16 weights
            if f.is_file() and not f.name.startswith(".") and ".safetensors" not in f.name:
                shutil.copy(f, out_dir / f.name)
    manifest = W12Manifest(str(source if not isinstance(source, torch.nn.Module) else type(source).__name__),
                           group_rows, tuple(entries), tuple(files))
    (out_dir / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def _read_tensor(packed_dir: Path, entry: TensorEntry, device: torch.device | str) -> W12Tensor:
    from safetensors import safe_open

    path = Path(packed_dir) / entry.file
    if not path.is_file():
        raise W12Error(f"{entry.name}: shard {path} is missing")
    with safe_open(str(path), framework="pt", device=str(device)) as fh:
        keys = [k for k in fh.keys() if k.rpartition(_SEP)[0] == entry.name]
        parts = {k.rpartition(_SEP)[2]: fh.get_tensor(k) for k in keys}
    w = W12Tensor.from_components(entry.shape, parts)
    if w.stats != entry.stats:
        raise W12Error(f"{entry.name}: stored arrays give {w.stats}, the manifest says {entry.stats}")
    return w


def load_w12(packed_dir: Path, device: torch.device | str = "cpu", *, check: bool = True) -> dict[str, W12Tensor]:
    """Every tensor of a W12 pack, by source name. check: decode each and compare its sha256 with the source's
    (the round trip is exact or loading fails)."""
    manifest = W12Manifest.read(packed_dir)
    out = {}
    for entry in manifest.tensors:
        w = _read_tensor(packed_dir, entry, device)
        if check and sha256_bf16(decode(w)) != entry.sha256:
            raise W12Error(f"{entry.name}: decoded bytes differ from the source (sha256 mismatch): the pack is corrupt")
        out[entry.name] = w
    return out


@dataclass(frozen=True)
class VerifyRow:
    name: str
    shape: tuple[int, ...]
    stats: W12Stats | None  # None: in the source but not in the pack
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class VerifyReport:
    rows: tuple[VerifyRow, ...]
    bad_files: tuple[str, ...]  # shards whose sha256 differs from the manifest

    @property
    def ok(self) -> bool:
        return not self.bad_files and all(r.ok for r in self.rows)

    @property
    def totals(self) -> W12Stats:
        return sum_stats(r.stats for r in self.rows if r.stats is not None)


def verify(packed_dir: Path, against: Path | torch.nn.Module) -> VerifyReport:
    """Decode every packed tensor and compare it bit for bit with the source; every source tensor must be packed."""
    packed_dir = Path(packed_dir)
    manifest = W12Manifest.read(packed_dir)
    bad = tuple(n for n, h in manifest.files if not (packed_dir / n).is_file() or _file_sha256(packed_dir / n) != h)
    by_name = {e.name: e for e in manifest.tensors}
    rows = []
    for name, t in iter_source(against):
        entry = by_name.pop(name, None)
        if entry is None:
            rows.append(VerifyRow(name, tuple(t.shape), None, False, "not in the pack"))
            continue
        try:
            d = decode(_read_tensor(packed_dir, entry, "cpu"))
        except W12Error as e:
            rows.append(VerifyRow(name, entry.shape, entry.stats, False, str(e)))
            continue
        reason = ""
        if not bitwise_equal(d, t.cpu()):
            reason = "decoded bits differ from the source"
        elif sha256_bf16(d) != entry.sha256:
            reason = "the manifest's sha256 differs from the source's"
        rows.append(VerifyRow(name, entry.shape, entry.stats, not reason, reason))
    rows += [VerifyRow(e.name, e.shape, e.stats, False, "not in the source") for e in by_name.values()]
    return VerifyReport(tuple(rows), bad)


def format_stats_table(rows: list[tuple[str, tuple[int, ...], W12Stats, str]]) -> str:
    """Fixed-width table: name, shape, escapes, escape rate, bytes/weight, status; then the overall line."""
    lines = [f"{'tensor':<52}{'shape':>16}{'escapes':>10}{'esc rate':>10}{'B/weight':>10}  status"]
    for name, shape, st, status in rows:
        lines.append(f"{name:<52}{'x'.join(map(str, shape)):>16}{st.escapes:>10}{st.escape_rate:>10.2e}"
                     f"{st.bytes_per_weight:>10.4f}  {status}")
    tot = sum_stats(r[2] for r in rows)
    if rows:
        lines.append(f"{'overall (' + str(len(rows)) + ' tensors, ' + str(tot.numel) + ' weights)':<68}"
                     f"{tot.escapes:>10}{tot.escape_rate:>10.2e}{tot.bytes_per_weight:>10.4f}"
                     f"  {tot.stored_bytes / 2 ** 20:.1f} MiB vs bf16 {tot.numel * 2 / 2 ** 20:.1f} MiB "
                     f"({2 * tot.numel / tot.stored_bytes:.3f}x fewer bytes)")
    return "\n".join(lines)
