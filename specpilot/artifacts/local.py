"""LocalStore: the default artifact store, a directory on the local filesystem.

Writes go to a temporary file in the destination directory and are renamed into place, so a reader (or an
audit) never sees a half-written artifact, even if the writer is killed.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator
from urllib.parse import unquote, urlparse

from specpilot.artifacts.store import (
    ArtifactNotFoundError, ArtifactStore, StoreError, read_chunks, validate_key, validate_prefix,
)

_TMP_MARK = ".specpilot-tmp-"


def _stream(f: BinaryIO) -> Iterator[bytes]:
    with f:
        yield from read_chunks(f)


def _atomic_target(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.parent / f"{_TMP_MARK}{uuid.uuid4().hex}-{dest.name}"


def _atomic_copy(src: Path, dest: Path) -> None:
    """Copy src to dest through a temporary file beside dest: a reader never sees a partial file."""
    tmp = _atomic_target(dest)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


class LocalStore(ArtifactStore):
    """Objects are files under `root`; key `a/b.json` is `root/a/b.json`, its URI `file:///<root>/a/b.json`."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"local artifact store root is not a directory: {self.root}")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    @property
    def root_uri(self) -> str:
        return self.root.as_uri()

    def uri_for(self, key: str) -> str:
        return (self.root / validate_key(key)).as_uri()

    def key_for(self, ref: str) -> str:
        if "://" not in ref:
            return validate_key(ref)
        parsed = urlparse(ref)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{ref} is not a URI of the local artifact store at {self.root}")
        path = Path(unquote(parsed.path))
        try:
            return validate_key(path.relative_to(self.root).as_posix())
        except ValueError:
            raise ValueError(f"{ref} is not under the local artifact store at {self.root}") from None

    def path_for(self, ref: str) -> Path:
        """The file that holds (or would hold) the object `ref` names."""
        return self.root / self.key_for(ref)

    def _existing(self, ref: str) -> Path:
        path = self.path_for(ref)
        if not path.is_file():
            raise ArtifactNotFoundError(path.as_uri())
        return path

    def put_file(self, local_path: Path, key: str) -> str:
        src = Path(local_path)
        if not src.is_file():
            raise FileNotFoundError(f"cannot store {key}: local file {src} does not exist")
        dest = self.root / validate_key(key)
        _atomic_copy(src, dest)
        return dest.as_uri()

    def put_bytes(self, data: bytes, key: str) -> str:
        dest = self.root / validate_key(key)
        tmp = _atomic_target(dest)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest.as_uri()

    def get_file(self, ref: str, dest: Path) -> Path:
        dest = Path(dest)
        _atomic_copy(self._existing(ref), dest)
        return dest

    def get_bytes(self, ref: str) -> bytes:
        return self._existing(ref).read_bytes()

    def iter_chunks(self, ref: str) -> Iterator[bytes]:
        return _stream(open(self._existing(ref), "rb"))

    def exists(self, ref: str) -> bool:
        return self.path_for(ref).is_file()

    def delete(self, ref: str) -> None:
        self.path_for(ref).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names; the rest of the prefix filters names.
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not start.is_dir():
            return []
        keys = []
        for dirpath, _, filenames in os.walk(start):
            for name in filenames:
                if name.startswith(_TMP_MARK):
                    continue
                key = (Path(dirpath) / name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)
