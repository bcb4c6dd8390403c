"""Where raw sources live: one interface, a local and an S3 implementation.

A raw root holds one folder per source (a raw drop); each source holds one folder per modality
(``image/``, ``caption/``, ``umt5/`` ...). Listings are sorted so every later step is
deterministic.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from pid_platform.build.errors import SourceNotFoundError


@dataclass(frozen=True)
class FileEntry:
    modality: str
    name: str  # file name inside the modality folder
    size: int
    fingerprint: str  # changes when the file's bytes may have changed
    local_path: str | None = None  # set when the bytes can be copied without reading them


@dataclass
class Listing:
    entries: list[FileEntry] = field(default_factory=list)
    # (path relative to the source, reason) of every file that was looked at and not used.
    skipped: list[tuple[str, str]] = field(default_factory=list)


class SourceStore(ABC):
    """Read-only access to a raw root."""

    uri: str

    @abstractmethod
    def list_sources(self) -> list[str]: ...

    @abstractmethod
    def list_modalities(self, source: str) -> list[str]: ...

    @abstractmethod
    def list_files(self, source: str, modality: str) -> Listing: ...

    @abstractmethod
    def read(self, source: str, entry: FileEntry) -> bytes: ...

    def describe(self, source: str, entry: FileEntry) -> str:
        return f"{self.uri.rstrip('/')}/{source}/{entry.modality}/{entry.name}"


class LocalSourceStore(SourceStore):
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).resolve()
        self.uri = str(self.root)

    def _source_dir(self, source: str) -> Path:
        d = self.root / source
        if not d.is_dir():
            raise SourceNotFoundError(
                f"source {source!r} not found: {d} is not a folder; "
                f"sources under {self.root} are {self.list_sources()}"
            )
        return d

    def list_sources(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))

    def list_modalities(self, source: str) -> list[str]:
        d = self._source_dir(source)
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))

    def list_files(self, source: str, modality: str) -> Listing:
        src_root = self._source_dir(source).resolve()
        folder = src_root / modality
        out = Listing()
        for name in sorted(os.listdir(folder)):
            rel = f"{modality}/{name}"
            if name.startswith("."):
                out.skipped.append((rel, "hidden_file"))
                continue
            p = folder / name
            if p.is_symlink():
                target = p.resolve()
                # Following a link out of the source would let one drop read arbitrary files.
                if not target.is_relative_to(src_root):
                    out.skipped.append((rel, "symlink_outside_root"))
                    continue
                if not target.exists():
                    out.skipped.append((rel, "broken_symlink"))
                    continue
            if not p.is_file():
                out.skipped.append((rel, "not_a_regular_file"))
                continue
            st = p.stat()
            fp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
            out.entries.append(FileEntry(modality, name, st.st_size, fp, str(p)))
        return out

    def read(self, source: str, entry: FileEntry) -> bytes:
        path = entry.local_path or str(self.root / source / entry.modality / entry.name)
        with open(path, "rb") as fh:
            return fh.read()


class S3SourceStore(SourceStore):
    """``s3://bucket/prefix``; the endpoint comes from the argument or ``AWS_ENDPOINT_URL``."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3:// URI: {uri!r}")
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        self._client = None

    def __getstate__(self):  # boto3 clients do not pickle; worker processes make their own
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    @property
    def client(self):
        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint_url)
        return self._client

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _prefixes(self, prefix: str) -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, Delimiter="/"
        ):
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(prefix) :].strip("/")
                if name and not name.startswith((".", "_")):
                    out.append(name)
        return sorted(out)

    def list_sources(self) -> list[str]:
        return self._prefixes(self._key() + "/" if self.prefix else "")

    def list_modalities(self, source: str) -> list[str]:
        mods = self._prefixes(self._key(source) + "/")
        if not mods:
            raise SourceNotFoundError(
                f"source {source!r} not found under {self.uri}: no modality folders at "
                f"s3://{self.bucket}/{self._key(source)}/"
            )
        return mods

    def list_files(self, source: str, modality: str) -> Listing:
        prefix = self._key(source, modality) + "/"
        out = Listing()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                rel = f"{modality}/{name}"
                if "/" in name:
                    out.skipped.append((rel, "nested_object"))
                elif name.startswith("."):
                    out.skipped.append((rel, "hidden_file"))
                else:
                    etag = str(obj.get("ETag", "")).strip('"')
                    out.entries.append(FileEntry(modality, name, int(obj["Size"]), f"{obj['Size']}:{etag}"))
        out.entries.sort(key=lambda e: e.name)
        return out

    def read(self, source: str, entry: FileEntry) -> bytes:
        resp = self.client.get_object(Bucket=self.bucket, Key=self._key(source, entry.modality, entry.name))
        return resp["Body"].read()


def open_source_store(root: str, endpoint_url: str | None = None) -> SourceStore:
    if root.startswith("s3://"):
        return S3SourceStore(root, endpoint_url)
    if "://" in root and not root.startswith("file://"):
        raise ValueError(f"unsupported source root {root!r}: use a local path or s3://bucket/prefix")
    return LocalSourceStore(root.removeprefix("file://"))
