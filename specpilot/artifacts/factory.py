"""Pick an artifact store from a URI: a local directory, or an S3 bucket (with its endpoint in the query)."""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from specpilot.artifacts.local import LocalStore
from specpilot.artifacts.s3 import S3Config, S3Store
from specpilot.artifacts.store import ArtifactStore

STORE_ENV = "SPECPILOT_STORE"
_S3_QUERY_KEYS = {"endpoint", "region", "connect_timeout", "read_timeout", "max_attempts"}


def default_store_uri() -> str:
    """$SPECPILOT_STORE, else <$SPECPILOT_CACHE or ~/.cache/specpilot>/artifacts (the embedded default)."""
    if uri := os.environ.get(STORE_ENV):
        return uri
    cache = os.environ.get("SPECPILOT_CACHE") or "~/.cache/specpilot"
    return str(Path(cache).expanduser() / "artifacts")


def _single(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    if values is None:
        return None
    if len(values) != 1:
        raise ValueError(f"store URI query parameter {name!r} given {len(values)} times")
    return values[0]


def s3_config_from_uri(uri: str) -> S3Config:
    """s3://bucket[/prefix][?endpoint=http://host:port&region=..&connect_timeout=..&read_timeout=..&max_attempts=..]"""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3://bucket[/prefix] URI: {uri!r}")
    query = parse_qs(parsed.query, keep_blank_values=True)
    unknown = set(query) - _S3_QUERY_KEYS
    if unknown:
        raise ValueError(f"unknown S3 store URI parameter(s) {sorted(unknown)} in {uri!r}; "
                         f"known: {sorted(_S3_QUERY_KEYS)}")
    fields: dict[str, object] = {"bucket": parsed.netloc, "prefix": unquote(parsed.path).strip("/")}
    if (endpoint := _single(query, "endpoint")) is not None:
        fields["endpoint_url"] = endpoint
    if (region := _single(query, "region")) is not None:
        fields["region"] = region
    try:
        if (v := _single(query, "connect_timeout")) is not None:
            fields["connect_timeout_s"] = float(v)
        if (v := _single(query, "read_timeout")) is not None:
            fields["read_timeout_s"] = float(v)
        if (v := _single(query, "max_attempts")) is not None:
            fields["max_attempts"] = int(v)
    except ValueError as e:
        raise ValueError(f"bad number in S3 store URI {uri!r}: {e}") from None
    return S3Config(**fields)  # type: ignore[arg-type]


def store_from_uri(uri: str | Path | None = None) -> ArtifactStore:
    """`file:///dir`, a plain path, or `s3://bucket/prefix?endpoint=...`; None means default_store_uri()."""
    text = default_store_uri() if uri is None else str(uri)
    if not text:
        raise ValueError("empty artifact store URI")
    if isinstance(uri, Path) or "://" not in text:
        return LocalStore(Path(text))
    scheme = urlparse(text).scheme
    if scheme == "file":
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI with a remote host is not supported: {text!r}")
        return LocalStore(Path(unquote(parsed.path)))
    if scheme == "s3":
        return S3Store(s3_config_from_uri(text))
    raise ValueError(f"unsupported artifact store URI {text!r}: "
                     f"use a path, file:///dir or s3://bucket/prefix?endpoint=URL")
