"""Reading what a build published to S3, for comparisons with a local build (no tests here)."""

from __future__ import annotations

import json
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
