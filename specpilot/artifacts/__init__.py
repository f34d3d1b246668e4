"""Artifact store (local directory by default, S3 through boto3), manifests, content addressing, audits."""
from specpilot.artifacts.audit import AuditFailure, AuditReport, Problem, StageEntry, audit_run, format_audit
from specpilot.artifacts.factory import STORE_ENV, default_store_uri, s3_config_from_uri, store_from_uri
from specpilot.artifacts.local import LocalStore
from specpilot.artifacts.manifest import (
    MANIFEST_NAME, ArtifactEntry, Manifest, new_run_id, read_manifest, run_prefix, stage_prefix, store_output,
    store_output_bytes, write_manifest,
)
from specpilot.artifacts.s3 import S3Config, S3Store
from specpilot.artifacts.store import (
    BLOB_PREFIX, ArtifactNotFoundError, ArtifactStore, Digest, StoreError, StoreUnreachableError, blob_key,
    digest_bytes, digest_file,
)

__all__ = [
    "ArtifactEntry", "ArtifactNotFoundError", "ArtifactStore", "AuditFailure", "AuditReport", "BLOB_PREFIX",
    "Digest", "LocalStore", "MANIFEST_NAME", "Manifest", "Problem", "S3Config", "S3Store", "STORE_ENV",
    "StageEntry", "StoreError", "StoreUnreachableError", "audit_run", "blob_key", "default_store_uri",
    "digest_bytes", "digest_file", "format_audit", "new_run_id", "read_manifest", "run_prefix",
    "s3_config_from_uri", "stage_prefix", "store_from_uri", "store_output", "store_output_bytes",
    "write_manifest",
]
