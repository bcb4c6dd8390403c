"""Reading what a build published to S3, for comparisons with a local build, and recording the
requests that got it there (no tests here)."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

from loader.formats.version_pointer import POINTER_NAME


def objects(client: Any, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every object under ``s3://bucket/prefix/``, keyed by its path relative to the prefix."""
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            found[obj["Key"][len(prefix):]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return dict(sorted(found.items()))


def keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    names = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        names += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
    return sorted(names)


def pointer(client: Any, bucket: str, prefix: str) -> dict:
    key = f"{prefix.strip('/')}/{POINTER_NAME}"
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def current_version(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """The files of the version the pointer names (tars, key indexes, manifests, settings)."""
    version = pointer(client, bucket, prefix)["version"]
    return objects(client, bucket, f"{prefix.strip('/')}/versions/{version}")


class S3Requests:
    """Every S3 request botocore makes in this process while the ``with`` block runs, as
    (operation, key, range), each passed on to the real server. Only its own patch is undone on
    leaving, so fixtures' environment (``s3_env``) stays as it was."""

    WRITES = ("PutObject", "CopyObject", "UploadPart", "CreateMultipartUpload", "UploadPartCopy")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None]] = []

    def __enter__(self) -> S3Requests:
        import botocore.client

        self._real = real = botocore.client.BaseClient._make_api_call
        calls = self.calls

        def recording(client: Any, operation: str, params: dict) -> Any:
            calls.append((operation, params.get("Key") or params.get("Prefix") or "", params.get("Range")))
            return real(client, operation, params)

        botocore.client.BaseClient._make_api_call = recording
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        import botocore.client

        botocore.client.BaseClient._make_api_call = self._real

    def ops(self, *operations: str) -> list[tuple[str, str]]:
        """(operation, key) of every request, or of those of ``operations``, in order."""
        return [(op, key) for op, key, _ in self.calls if not operations or op in operations]

    def writes(self) -> list[tuple[str, str]]:
        return self.ops(*self.WRITES)
