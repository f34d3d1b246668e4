"""The artifact store interface, its errors, keys and content hashing.

A store holds immutable-by-convention objects under slash-separated keys (`runs/r1/profile/steps.parquet`)
and names each one by a URI (`file:///...` or `s3://bucket/...`) that manifests record. Every read takes a
`ref`: either such a URI (it must belong to this store) or a bare key, so callers can pass what a manifest
says without parsing it.
"""
from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

BLOB_PREFIX = "blobs/sha256"
CHUNK_BYTES = 1 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class StoreError(RuntimeError):
    """A store operation failed; the message names the store (directory, or endpoint and bucket) and key."""


class ArtifactNotFoundError(StoreError, FileNotFoundError):
    """The named artifact does not exist; the message names its URI."""

    def __init__(self, uri: str) -> None:
        super().__init__(f"artifact not found: {uri}")
        self.uri = uri


class StoreUnreachableError(StoreError):
    """The store's backend could not be reached (network, DNS, timeouts)."""


@dataclass(frozen=True)
class Digest:
    """sha256 and size of an object's bytes."""
    sha256: str
    bytes: int

    def __post_init__(self) -> None:
        if not _SHA256_HEX.match(self.sha256):
            raise ValueError(f"not a lowercase hex sha256: {self.sha256!r}")
        if self.bytes < 0:
            raise ValueError(f"negative size: {self.bytes}")


def digest_chunks(chunks: Iterable[bytes]) -> Digest:
    h, n = hashlib.sha256(), 0
    for chunk in chunks:
        h.update(chunk)
        n += len(chunk)
    return Digest(h.hexdigest(), n)


def read_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        yield chunk


def digest_file(path: Path) -> Digest:
    with open(path, "rb") as f:
        return digest_chunks(read_chunks(f))


def digest_bytes(data: bytes) -> Digest:
    return Digest(hashlib.sha256(data).hexdigest(), len(data))


def blob_key(sha256: str) -> str:
    return f"{BLOB_PREFIX}/{sha256}"


def validate_key(key: str) -> str:
    """Keys are relative POSIX paths with no empty, '.' or '..' segments, so they mean the same on every store."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"artifact key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "://" in key:
        raise ValueError(f"artifact key must be a relative POSIX path, got {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"artifact key has an empty, '.' or '..' segment: {key!r}")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty (everything) or a key, optionally ending in '/'; matching is by string prefix."""
    if prefix:
        validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class ArtifactStore(ABC):
    """Where stage inputs and outputs live. Implementations: LocalStore (default) and S3Store."""

    @property
    @abstractmethod
    def root_uri(self) -> str:
        """A URI that `store_from_uri` turns back into an equivalent store."""

    @abstractmethod
    def uri_for(self, key: str) -> str:
        """The URI that names `key` in this store."""

    @abstractmethod
    def key_for(self, ref: str) -> str:
        """The key named by `ref` (a URI of this store, or a key); ValueError if the URI is another store's."""

    def owns(self, ref: str) -> bool:
        try:
            self.key_for(ref)
        except ValueError:
            return False
        return True

    @abstractmethod
    def put_file(self, local_path: Path, key: str) -> str:
        """Upload a local file under `key` (replacing any object there); return its URI."""

    @abstractmethod
    def put_bytes(self, data: bytes, key: str) -> str:
        """Store `data` under `key` (replacing any object there); return its URI."""

    @abstractmethod
    def get_file(self, ref: str, dest: Path) -> Path:
        """Download the object to `dest` (parents created, replaced atomically); return `dest`."""

    @abstractmethod
    def get_bytes(self, ref: str) -> bytes:
        """The object's bytes; ArtifactNotFoundError naming the URI if it does not exist."""

    @abstractmethod
    def exists(self, ref: str) -> bool: ...

    @abstractmethod
    def delete(self, ref: str) -> None:
        """Remove the object; deleting a missing object is not an error (as in S3)."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with `prefix` (string match, as in S3), sorted."""

    @abstractmethod
    def iter_chunks(self, ref: str) -> Iterator[bytes]:
        """Stream the object's bytes, so large artifacts can be hashed without holding them in memory."""

    def digest(self, ref: str) -> Digest:
        """Re-hash the stored bytes (what an audit trusts, rather than any recorded checksum)."""
        return digest_chunks(self.iter_chunks(ref))

    def put_blob(self, local_path: Path) -> str:
        """Store a file content-addressed under blobs/sha256/<hash>; identical content is uploaded once."""
        digest = digest_file(Path(local_path))
        key = blob_key(digest.sha256)
        if not self.exists(key):
            self.put_file(Path(local_path), key)
        return self.uri_for(key)

    def put_blob_bytes(self, data: bytes) -> str:
        key = blob_key(digest_bytes(data).sha256)
        if not self.exists(key):
            self.put_bytes(data, key)
        return self.uri_for(key)
