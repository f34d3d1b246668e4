"""Split a directory into fixed-size parts with a sha256 manifest, and put it back together.

Used to move a model directory to a host that only accepts files up to some size. All files of the
directory (recursively, sorted by relative path) are concatenated into one byte stream that is cut into
parts of at most `part_mb` MiB, so one file may span several parts. `manifest.json` lists every file with
its size and sha256 and every part with its size and sha256; `unpack` checks them all.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tqdm import tqdm

MANIFEST_NAME = "manifest.json"
PACK_FORMAT = "specpilot-pack/1"
_CHUNK = 8 << 20
MIB = 1 << 20


class PackError(ValueError):
    """A pack is incomplete or corrupt, or a pack request is invalid."""


@dataclass(frozen=True)
class PackedFile:
    path: str  # relative, POSIX separators
    size: int
    sha256: str

    def __post_init__(self) -> None:
        p = PurePosixPath(self.path)
        if p.is_absolute() or ".." in p.parts or not self.path:
            raise PackError(f"manifest file path {self.path!r} must be relative and stay inside the output directory")
        if self.size < 0:
            raise PackError(f"manifest file {self.path!r}: negative size {self.size}")


@dataclass(frozen=True)
class PackedPart:
    name: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if "/" in self.name or self.name in ("", ".", "..") or self.size <= 0:
            raise PackError(f"manifest part {self.name!r} (size {self.size}) is not a valid part entry")


def _files_of(src: Path) -> list[Path]:
    return sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.relative_to(src).as_posix())


def pack(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], part_mb: float) -> Path:
    """Split every file under `model_dir` into parts of at most `part_mb` MiB in `out_dir`; return the manifest path."""
    src, out = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    if not src.is_dir():
        raise PackError(f"pack source {src} is not a directory")
    part_bytes = int(part_mb * MIB)
    if part_bytes < 1:
        raise PackError(f"part_mb={part_mb}: must be positive (a part holds at least one byte)")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise PackError(f"pack output {out} must not be inside the source directory {src}")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("part-[0-9][0-9][0-9][0-9][0-9]"), out / MANIFEST_NAME]:  # a previous pack's output
        stale.unlink(missing_ok=True)
    files = _files_of(src)
    total = sum(p.stat().st_size for p in files)
    packed_files: list[PackedFile] = []
    parts: list[PackedPart] = []
    writer: BinaryIO | None = None
    part_hash = hashlib.sha256()
    part_fill = 0

    def close_part() -> None:
        nonlocal writer, part_hash, part_fill
        if writer is not None:
            writer.close()
            parts.append(PackedPart(f"part-{len(parts):05d}", part_fill, part_hash.hexdigest()))
        writer, part_hash, part_fill = None, hashlib.sha256(), 0

    with tqdm(total=total, unit="B", unit_scale=True, desc=f"pack {src.name}") as bar:
        for path in files:
            file_hash = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    file_hash.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        if writer is None:
                            writer = open(out / f"part-{len(parts):05d}", "wb")
                        take = view[: part_bytes - part_fill]
                        writer.write(take)
                        part_hash.update(take)
                        part_fill += len(take)
                        view = view[len(take):]
                        if part_fill == part_bytes:
                            close_part()
                    bar.update(len(chunk))
            packed_files.append(PackedFile(path.relative_to(src).as_posix(), path.stat().st_size, file_hash.hexdigest()))
        close_part()
    manifest = {
        "format": PACK_FORMAT, "source": src.name, "part_bytes": part_bytes, "total_bytes": total,
        "files": [vars(f) for f in packed_files], "parts": [vars(p) for p in parts],
    }
    manifest_path = out / MANIFEST_NAME
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest_path


def read_manifest(parts_dir_or_manifest: str | os.PathLike[str]) -> tuple[Path, list[PackedFile], list[PackedPart]]:
    """(parts directory, files, parts) from a manifest path or a directory holding `manifest.json`."""
    given = Path(parts_dir_or_manifest).expanduser()
    manifest_path = given / MANIFEST_NAME if given.is_dir() else given
    if not manifest_path.is_file():
        raise PackError(f"no pack manifest at {manifest_path}")
    try:
        data = json.loads(manifest_path.read_text())
        if data.get("format") != PACK_FORMAT:
            raise PackError(f"{manifest_path}: format {data.get('format')!r} is not {PACK_FORMAT!r}")
        files = [PackedFile(**f) for f in data["files"]]
        parts = [PackedPart(**p) for p in data["parts"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise PackError(f"{manifest_path} is not a valid pack manifest: {e!r}") from None
    if sum(f.size for f in files) != sum(p.size for p in parts):
        raise PackError(f"{manifest_path}: files total {sum(f.size for f in files)} bytes but parts total "
                        f"{sum(p.size for p in parts)}")
    return manifest_path.parent, files, parts


class _PartReader:
    """Reads the parts in order as one stream, checking each part's sha256 as it is consumed."""

    def __init__(self, parts_dir: Path, parts: list[PackedPart]) -> None:
        self.parts_dir, self.parts, self.index = parts_dir, parts, -1
        self.handle: BinaryIO | None = None
        self.left = 0
        self.hash = hashlib.sha256()

    def _check_current(self) -> None:
        self.handle.close()  # type: ignore[union-attr]
        part = self.parts[self.index]
        if self.hash.hexdigest() != part.sha256:
            raise PackError(f"part {part.name} in {self.parts_dir} is corrupt: sha256 {self.hash.hexdigest()} "
                            f"!= manifest {part.sha256}")

    def read(self, n: int) -> bytes:
        while self.left == 0:
            if self.handle is not None:
                self._check_current()
            self.index += 1
            self.handle = open(self.parts_dir / self.parts[self.index].name, "rb")
            self.left, self.hash = self.parts[self.index].size, hashlib.sha256()
        data = self.handle.read(min(n, self.left))  # type: ignore[union-attr]
        if not data:
            raise PackError(f"part {self.parts[self.index].name} in {self.parts_dir} ended early")
        self.left -= len(data)
        self.hash.update(data)
        return data

    def finish(self) -> None:
        """Check the last part once every byte has been read."""
        if self.handle is not None:
            self._check_current()


def unpack(parts_dir_or_manifest: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Reassemble a pack into `out_dir`, verifying every part and file; return `out_dir`."""
    parts_dir, files, parts = read_manifest(parts_dir_or_manifest)
    for part in parts:  # report a missing or truncated part before writing anything
        path = parts_dir / part.name
        if not path.is_file():
            raise PackError(f"part {part.name} is missing from {parts_dir}")
        if path.stat().st_size != part.size:
            raise PackError(f"part {part.name} in {parts_dir} is corrupt: {path.stat().st_size} bytes, manifest says {part.size}")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    reader = _PartReader(parts_dir, parts)
    written: list[Path] = []
    try:
        with tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, desc=f"unpack {parts_dir.name}") as bar:
            for entry in files:
                dest = out / entry.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                partial = dest.with_name(dest.name + ".partial")
                written.append(partial)
                file_hash, left = hashlib.sha256(), entry.size
                with open(partial, "wb") as f:
                    while left:
                        chunk = reader.read(min(_CHUNK, left))
                        f.write(chunk)
                        file_hash.update(chunk)
                        left -= len(chunk)
                        bar.update(len(chunk))
                if file_hash.hexdigest() != entry.sha256:
                    raise PackError(f"file {entry.path} reassembled from {parts_dir} has sha256 {file_hash.hexdigest()} "
                                    f"!= manifest {entry.sha256}")
            reader.finish()
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    for entry, partial in zip(files, written):
        partial.replace(out / entry.path)
    return out
