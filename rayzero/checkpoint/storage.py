"""Opening a run's storage URI with pyarrow.fs, honouring the AWS SDK's endpoint variables.

[Note: S3-compatible endpoints]
MinIO, Ceph, on-premises and test S3 servers are reached through an endpoint URL. boto3 and the AWS
CLI take it from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`; pyarrow's `S3FileSystem` ignores both
(apache/arrow#49643), and pyarrow's other way, `?endpoint_override=` in the URI, does not survive
joining paths onto the URI (`<storage>/<run>/checkpoints`). So every place rayzero opens storage goes
through `filesystem_from_uri`: for an s3:// URI with one of those variables set it builds the
`S3FileSystem` with that endpoint (credentials and region from the usual AWS variables); anything
else is `pyarrow.fs.FileSystem.from_uri` unchanged. Workers and the controller see the same
variables as the driver on one machine; on a cluster they must be set on every node, like the
credentials.
"""
from __future__ import annotations

import os
from urllib.parse import urlparse

import pyarrow.fs as pafs


def s3_endpoint() -> str | None:
    """The S3 endpoint URL the AWS SDK would use, from the environment (None: AWS's own)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def filesystem_from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for `uri` ([Note: S3-compatible endpoints])."""
    endpoint = s3_endpoint()
    if not uri.startswith("s3://") or endpoint is None or "?" in uri:
        return pafs.FileSystem.from_uri(uri)
    parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    filesystem = pafs.S3FileSystem(endpoint_override=parsed.netloc, scheme=parsed.scheme, region=region)
    return filesystem, uri.removeprefix("s3://").rstrip("/")
