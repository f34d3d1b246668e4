"""S3Store: artifacts in an S3 bucket (AWS, or any S3-compatible server such as SeaweedFS or MinIO).

Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) when set, else from
boto3's default chain (config files, instance roles); boto3 itself is imported when a store is opened.
Transient failures are retried by botocore's "standard" retry mode; whatever still fails is raised as a
StoreError naming the endpoint, bucket and key.
"""
from __future__ import annotations

import os
import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlencode, urlparse

from specpilot.artifacts.store import (
    CHUNK_BYTES, ArtifactNotFoundError, ArtifactStore, StoreError, StoreUnreachableError, validate_key,
    validate_prefix,
)

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}


@dataclass(frozen=True)
class S3Config:
    """Where an S3Store keeps its objects and how hard it tries to reach them."""
    bucket: str
    prefix: str = ""  # key prefix inside the bucket, without leading/trailing slashes
    endpoint_url: str | None = None  # None: AWS; else e.g. http://127.0.0.1:8333
    region: str = "us-east-1"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_attempts: int = 5  # total attempts per request, including the first

    def __post_init__(self) -> None:
        if not _BUCKET_NAME.match(self.bucket) or ".." in self.bucket:
            raise ValueError(f"invalid S3 bucket name {self.bucket!r} "
                             f"(3-63 chars: lowercase letters, digits, '.', '-')")
        if self.prefix:
            if self.prefix != self.prefix.strip("/"):
                raise ValueError(f"S3 prefix must not start or end with '/': {self.prefix!r}")
            validate_key(self.prefix)
        if self.endpoint_url is not None:
            parsed = urlparse(self.endpoint_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"S3 endpoint must be an http(s) URL, got {self.endpoint_url!r}")
        if not self.region:
            raise ValueError("S3 region must be non-empty")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("S3 timeouts must be positive")
        if self.max_attempts < 1:
            raise ValueError(f"S3 max_attempts must be >= 1, got {self.max_attempts}")

    @property
    def endpoint_name(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region})"


def _credentials_from_env() -> dict[str, str]:
    key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if bool(key_id) != bool(secret):
        raise ValueError("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither")
    if not key_id:
        return {}  # boto3's default chain decides
    creds = {"aws_access_key_id": key_id, "aws_secret_access_key": secret}
    if token := os.environ.get("AWS_SESSION_TOKEN"):
        creds["aws_session_token"] = token
    return creds


class S3Store(ArtifactStore):
    """Objects live at s3://<bucket>/<prefix>/<key>; that is also their URI."""

    def __init__(self, config: S3Config) -> None:
        # boto3 is imported only when an S3 store is opened: hosts that keep artifacts in a local directory
        # (an offline GPU host, say) need not carry botocore's 16 MB of service models.
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.config = config
        botocore_config = Config(
            region_name=config.region,
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            retries={"max_attempts": config.max_attempts, "mode": "standard"},
            # Custom endpoints (SeaweedFS, MinIO, IP addresses) rarely resolve virtual-host bucket names.
            s3={"addressing_style": "path" if config.endpoint_url else "auto"},
        )
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=config.endpoint_url, config=botocore_config, **_credentials_from_env())
        self._transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20)

    def __repr__(self) -> str:
        return f"S3Store({self.root_uri!r})"

    @property
    def _base(self) -> str:
        return f"s3://{self.config.bucket}/" + (f"{self.config.prefix}/" if self.config.prefix else "")

    @property
    def root_uri(self) -> str:
        query = {"region": self.config.region}
        if self.config.endpoint_url:
            query["endpoint"] = self.config.endpoint_url
        return self._base.rstrip("/") + "?" + urlencode(query)

    def _object_key(self, key: str) -> str:
        return (f"{self.config.prefix}/" if self.config.prefix else "") + key

    def uri_for(self, key: str) -> str:
        return self._base + validate_key(key)

    def key_for(self, ref: str) -> str:
        if "://" not in ref:
            return validate_key(ref)
        if not ref.startswith(self._base):
            raise ValueError(f"{ref} is not a URI of the S3 artifact store at {self._base}")
        return validate_key(ref[len(self._base):])

    @contextmanager
    def _translated(self, action: str, key: str) -> Iterator[None]:
        """Turn botocore's exceptions into StoreErrors that say which endpoint, bucket and key failed."""
        import botocore.exceptions as bce
        from boto3.exceptions import S3UploadFailedError

        where = f"S3 endpoint {self.config.endpoint_name}, bucket {self.config.bucket}"
        try:
            yield
        except (bce.ConnectionError, bce.HTTPClientError) as e:
            raise StoreUnreachableError(f"cannot reach {where} ({action} {key}): {e}") from e
        except bce.NoCredentialsError as e:
            raise StoreError(f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from e
        except (bce.ClientError, S3UploadFailedError) as e:
            # upload_file wraps the ClientError in S3UploadFailedError, leaving it only as the exception context
            client_error = e if isinstance(e, bce.ClientError) else e.__context__
            code = client_error.response.get("Error", {}).get("Code", "") \
                if isinstance(client_error, bce.ClientError) else ""
            if code in _NOT_FOUND_CODES:
                raise ArtifactNotFoundError(self.uri_for(key)) from e
            if code == "NoSuchBucket":
                raise StoreError(f"bucket {self.config.bucket} does not exist at S3 endpoint "
                                 f"{self.config.endpoint_name}") from e
            raise StoreError(f"{action} {key} failed at {where}: {e}") from e

    def put_file(self, local_path: Path, key: str) -> str:
        src = Path(local_path)
        if not src.is_file():
            raise FileNotFoundError(f"cannot store {key}: local file {src} does not exist")
        with self._translated("put", validate_key(key)):
            self._client.upload_file(str(src), self.config.bucket, self._object_key(key), Config=self._transfer)
        return self.uri_for(key)

    def put_bytes(self, data: bytes, key: str) -> str:
        with self._translated("put", validate_key(key)):
            self._client.put_object(Bucket=self.config.bucket, Key=self._object_key(key), Body=data)
        return self.uri_for(key)

    def get_file(self, ref: str, dest: Path) -> Path:
        key, dest = self.key_for(ref), Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".specpilot-tmp-{uuid.uuid4().hex}-{dest.name}"
        try:
            with self._translated("get", key):
                self._client.download_file(self.config.bucket, self._object_key(key), str(tmp), Config=self._transfer)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def _get_object(self, key: str) -> dict[str, Any]:
        with self._translated("get", key):
            return self._client.get_object(Bucket=self.config.bucket, Key=self._object_key(key))

    def get_bytes(self, ref: str) -> bytes:
        key = self.key_for(ref)
        body = self._get_object(key)["Body"]
        with self._translated("get", key):
            return body.read()

    def iter_chunks(self, ref: str) -> Iterator[bytes]:
        key = self.key_for(ref)
        body = self._get_object(key)["Body"]  # raises here, not on first next(), if the object is missing

        def stream() -> Iterator[bytes]:
            with self._translated("get", key):
                yield from body.iter_chunks(CHUNK_BYTES)
        return stream()

    def exists(self, ref: str) -> bool:
        key = self.key_for(ref)
        try:
            with self._translated("head", key):
                self._client.head_object(Bucket=self.config.bucket, Key=self._object_key(key))
        except ArtifactNotFoundError:
            return False
        return True

    def delete(self, ref: str) -> None:
        key = self.key_for(ref)
        with self._translated("delete", key):
            self._client.delete_object(Bucket=self.config.bucket, Key=self._object_key(key))

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        strip = len(self._object_key(""))
        keys: list[str] = []
        with self._translated("list", prefix or "(all)"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=self._object_key(prefix))
            for page in pages:
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        return sorted(keys)

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for local S3 servers and tests; production buckets pre-exist)."""
        import botocore.exceptions as bce

        with self._translated("create bucket", self.config.bucket):
            try:
                self._client.head_bucket(Bucket=self.config.bucket)
            except bce.ClientError as e:
                if e.response.get("Error", {}).get("Code", "") not in _NOT_FOUND_CODES | {"NoSuchBucket"}:
                    raise
                location = {} if self.config.region == "us-east-1" else {
                    "CreateBucketConfiguration": {"LocationConstraint": self.config.region}}
                self._client.create_bucket(Bucket=self.config.bucket, **location)
