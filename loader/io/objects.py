"""Object stores: every byte the project writes, and its whole-object reads, go through here.

``open_store(location)`` gives an ``ObjectStore`` rooted at a local folder or at
``s3://bucket/prefix``; keys are ``/``-separated paths below that root. One API both ways:

  get / get_range / head / list / list_prefixes      reads (``open_url`` serves byte streams;
                                                     ``open_ranged``: a seekable file of ranges)
  put (bytes, a file path or a binary stream)        S3: multipart above ``multipart_threshold``
  put_if_absent / put_if_match                       conditional writes (``If-None-Match: *``,
                                                     ``If-Match: <etag>``) for pointers and leases
  copy (inside one store: server-side on S3) / delete / delete_many

Errors are the project's (``loader/io/errors.py``): ``ObjectNotFoundError`` (a
``FileNotFoundError``), ``PreconditionFailedError``, ``BucketNotFoundError`` and ``StorageError``,
each naming the URL and what to check. S3's come from the one translator, ``s3_error``. Retries
are botocore's, as the ``S3Settings`` given say (``max_attempts``); a store adds none.

Server facts the API smooths over: SeaweedFS answers ``If-Match`` on a missing key with 412
(AWS: 404), so ``put_if_match`` on a missing key is a ``PreconditionFailedError`` on both; SeaweedFS
creates a bucket on a first PUT, so ``check_bucket`` asks for the bucket before anything is written.

A new backend is one more ``ObjectStore`` subclass here and one entry in ``urls.KINDS``.
"""

from __future__ import annotations

import base64
import fcntl
import io
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from . import urls
from .errors import ObjectNotFoundError, PreconditionFailedError
from .s3_client import S3Settings, is_s3_exception, s3_client, s3_error
from .seekable import SeekableReader

Data = bytes | bytearray | memoryview | str | os.PathLike | IO[bytes]
"""What ``put`` takes: bytes, a local file's path (``str`` or ``PathLike``), or a binary stream."""

# boto3's transfer manager defaults: objects above 8 MiB go up in 8 MiB parts.
DEFAULT_MULTIPART_THRESHOLD = 8 << 20
DEFAULT_MULTIPART_CHUNK = 8 << 20
_TMP_PREFIX = ".tmp-put-"  # a local put's temporary file: never listed


@dataclass(frozen=True)
class ObjectInfo:
    """One object: ``key`` relative to the store's root; ``etag`` as the backend spells it (S3:
    with its quotes), what ``put_if_match`` takes; ``modified`` in seconds since the epoch."""

    key: str
    size: int
    etag: str | None
    modified: float
    version: str | None = None  # S3's VersionId, in a versioned bucket (head only)
    # The sha256 (hex) the server computed of the whole object when it was written with one
    # (``put(..., sha256=)`` in one request, or a copy of such an object); None where the backend
    # keeps none (a local folder, an S3 multipart upload: its checksum is of the parts). Head only.
    sha256: str | None = None


class ObjectStore(ABC):
    """Objects below one root. Keys are ``/``-separated and relative (``versions/v1/a.tar``)."""

    root: str

    def url(self, key: str = "") -> str:
        """The location of ``key`` in the root's own syntax (for messages and readers)."""
        return f"{self.root.rstrip('/')}/{key}" if key else self.root

    @abstractmethod
    def get(self, key: str, *, if_match: str | None = None, max_bytes: int | None = None) -> bytes:
        """The object's bytes (at most its first ``max_bytes``, without a range request: an empty
        object has no range). ``if_match``: ``PreconditionFailedError`` unless its ETag is that."""

    @abstractmethod
    def get_tagged(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str | None]:
        """The object's bytes (at most its first ``max_bytes``) and its ETag, from one request."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int, *, if_match: str | None = None) -> bytes:
        """``length`` bytes from ``start`` (fewer at the end of the object)."""

    @abstractmethod
    def open(self, key: str) -> IO[bytes]:
        """A stream of the whole object, for chunked reads of a big one (close it)."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo: ...

    def open_ranged(self, key: str) -> RangedObject:
        """A seekable read-only file of the object, each read one range request pinned to the
        ETag it had when opened (a replaced object fails the next read rather than mixing two
        versions' bytes): for a reader that wants a few parts of a big object, as pyarrow does
        of a parquet file's footer and row groups."""
        info = self.head(key)
        return RangedObject(self, key, info.size, info.etag)

    def get_or_none(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """``get`` (at most the first ``max_bytes``), or ``None`` when there is no such object."""
        try:
            return self.get(key, max_bytes=max_bytes)
        except ObjectNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a string prefix, as S3's), in key order,
        page by page."""

    @abstractmethod
    def list_prefixes(self, prefix: str = "") -> Iterator[str]:
        """The names one level below ``prefix`` (which ends in ``/`` or is empty) that hold
        objects: S3's common prefixes, a local folder's sub-folders. Sorted."""

    @abstractmethod
    def list_names(self, prefix: str = "") -> list[str]:
        """The names directly inside ``prefix`` (which ends in ``/`` or is empty): objects and
        sub-prefixes (folders) alike, sorted; ``[]`` when there is nothing there."""

    @abstractmethod
    def put(self, key: str, data: Data, *, content_type: str | None = None,
            metadata: dict[str, str] | None = None, sha256: str | None = None) -> str | None:
        """Write the object in one step: readers see the old bytes or the new ones, never part.
        Its new ETag (S3's multipart transfers: read back by a HEAD). ``sha256`` (hex): the
        bytes' digest, sent as S3's ``ChecksumSHA256`` where the object goes in one request (the
        server refuses bytes that do not match it and reports it on ``head``); ignored elsewhere."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes, *, content_type: str | None = None) -> str | None:
        """Write only if there is no object at ``key``; its new ETag. ``PreconditionFailedError`` if there is."""

    @abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str, *, content_type: str | None = None) -> str | None:
        """Replace the object only if its ETag is ``etag``; its new ETag. ``PreconditionFailedError``
        if it is not, or if the object is gone."""

    @abstractmethod
    def copy(self, src_key: str, dst_key: str) -> None:
        """Copy inside the store (server-side on S3: no byte crosses the network).
        ``ObjectNotFoundError`` when ``src_key`` is missing."""

    @abstractmethod
    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete the object; a missing one is no error (as S3). ``if_match``: only if its ETag is
        that, else ``PreconditionFailedError`` (also when it is gone); servers without conditional
        deletes answer ``UnsupportedRequestError``."""

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete these objects; how many were asked for."""
        n = 0
        for key in keys:
            self.delete(key)
            n += 1
        return n

    @abstractmethod
    def check_bucket(self) -> None:
        """Raise unless the root can be reached: ``BucketNotFoundError`` / ``StorageError`` on S3,
        ``ObjectNotFoundError`` for a local root that is not a folder. Writes nothing: some
        servers create a bucket on a first PUT."""


def open_store(location: str | os.PathLike[str], *, s3_settings: S3Settings | None = None,
               what: str = "storage location") -> ObjectStore:
    """The store rooted at ``location``: a local folder (or ``file://``) or ``s3://bucket/prefix``."""
    text = os.fspath(location)
    if urls.kind(text, allowed=("local", "s3"), what=what) == "s3":
        return S3Objects(text, s3_settings)
    return LocalObjects(urls.local_path(text))


# -- S3 ------------------------------------------------------------------------------------------

class S3Objects(ObjectStore):
    """``s3://bucket/prefix`` through the project's one client factory (``s3_client``).

    Pickles without its client (a build worker makes its own from the same settings; freeze
    credentials with ``S3Settings.frozen_credentials`` before handing a store to spawned workers).
    """

    def __init__(self, url: str, settings: S3Settings | None = None, *,
                 multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
                 multipart_chunk: int = DEFAULT_MULTIPART_CHUNK) -> None:
        self.bucket, self.prefix = urls.split_s3(url)
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.settings = settings or S3Settings()
        self.multipart_threshold = multipart_threshold
        self.multipart_chunk = multipart_chunk
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def __repr__(self) -> str:  # never the credentials
        return f"S3Objects({self.root!r}, endpoint={self.settings.where()!r})"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.settings)
        return self._client

    def key(self, key: str = "") -> str:
        """The full S3 key of ``key`` (the root's prefix prepended)."""
        return "/".join(p for p in (self.prefix, key) if p)

    @contextmanager
    def _errors(self, what: str, key: str | None = None) -> Iterator[None]:
        url = self.url(key) if key is not None else self.root
        try:
            yield
        except Exception as e:
            if not is_s3_exception(e):
                raise
            raise s3_error(e, self.settings, f"{what} {url}", self.bucket, url) from e

    def get(self, key: str, *, if_match: str | None = None, max_bytes: int | None = None) -> bytes:
        cond = {"IfMatch": if_match} if if_match else {}
        with self._errors("reading", key):
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(key), **cond)["Body"]
            try:
                return body.read() if max_bytes is None else body.read(max_bytes)
            finally:
                body.close()

    def get_tagged(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str | None]:
        with self._errors("reading", key):
            got = self.client.get_object(Bucket=self.bucket, Key=self.key(key))
            try:
                return (got["Body"].read() if max_bytes is None else got["Body"].read(max_bytes)), got.get("ETag")
            finally:
                got["Body"].close()

    def get_range(self, key: str, start: int, length: int, *, if_match: str | None = None) -> bytes:
        if start < 0 or length <= 0:
            raise ValueError(f"{self.url(key)}: a range needs start >= 0 and length > 0 (got {start}, {length})")
        cond = {"IfMatch": if_match} if if_match else {}
        with self._errors("reading", key):
            resp = self.client.get_object(Bucket=self.bucket, Key=self.key(key),
                                          Range=f"bytes={start}-{start + length - 1}", **cond)
            return resp["Body"].read()

    def open(self, key: str) -> IO[bytes]:
        with self._errors("reading", key):
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(key))["Body"]
        return _Body(body, lambda: self._errors("reading", key))

    def head(self, key: str) -> ObjectInfo:
        with self._errors("reading", key):
            h = self.client.head_object(Bucket=self.bucket, Key=self.key(key), ChecksumMode="ENABLED")
        return ObjectInfo(key, int(h["ContentLength"]), h.get("ETag"), h["LastModified"].timestamp(),
                          h.get("VersionId"), _whole_sha256(h.get("ChecksumSHA256")))

    def _pages(self, prefix: str, delimiter: bool) -> Iterator[dict]:
        full = self.key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        extra = {"Delimiter": "/"} if delimiter else {}
        with self._errors("listing", prefix):
            yield from self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full, **extra)

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1:] if self.prefix else full_key

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for page in self._pages(prefix, delimiter=False):
            for obj in page.get("Contents", []):
                yield ObjectInfo(self._rel(obj["Key"]), int(obj["Size"]), obj.get("ETag"),
                                 obj["LastModified"].timestamp())

    def list_prefixes(self, prefix: str = "") -> Iterator[str]:
        names: list[str] = []
        base = self._rel(self.key(prefix)) if prefix else ""
        for page in self._pages(prefix, delimiter=True):
            for cp in page.get("CommonPrefixes", []):
                name = self._rel(cp["Prefix"])[len(base):].strip("/")
                if name:
                    names.append(name)
        yield from sorted(names)

    def list_names(self, prefix: str = "") -> list[str]:
        names: set[str] = set()
        base = self._rel(self.key(prefix)) if prefix else ""
        for page in self._pages(prefix, delimiter=True):
            names.update(self._rel(cp["Prefix"])[len(base):].rstrip("/") for cp in page.get("CommonPrefixes", ()))
            names.update(self._rel(o["Key"])[len(base):] for o in page.get("Contents", ()))
        names.discard("")  # a "folder marker" object named like the prefix itself
        return sorted(names)

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold, multipart_chunksize=self.multipart_chunk)

    def put(self, key: str, data: Data, *, content_type: str | None = None,
            metadata: dict[str, str] | None = None, sha256: str | None = None) -> str | None:
        extra: dict[str, Any] = {}
        if content_type:
            extra["ContentType"] = content_type
        if metadata:
            extra["Metadata"] = dict(metadata)
        full = self.key(key)
        with self._errors("writing", key):
            if isinstance(data, (str, os.PathLike)) and sha256 is not None \
                    and os.path.getsize(data) <= self.multipart_threshold:
                data = Path(data).read_bytes()  # one request, so the server checks the whole object's sha256
            if isinstance(data, (bytes, bytearray, memoryview)):
                if len(data) <= self.multipart_threshold:
                    if sha256 is not None:
                        extra["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
                    return self.client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data), **extra).get("ETag")
                data = io.BytesIO(data)
            if isinstance(data, (str, os.PathLike)):
                # The transfer manager: multipart (parts sent in parallel) above the threshold.
                self.client.upload_file(os.fspath(data), self.bucket, full, ExtraArgs=extra or None,
                                        Config=self._transfer_config())
            else:
                self.client.upload_fileobj(data, self.bucket, full, ExtraArgs=extra or None,
                                           Config=self._transfer_config())
        return self.head(key).etag  # the transfer manager does not hand it back

    def _put_conditional(self, key: str, data: bytes, cond: dict[str, str], content_type: str | None) -> str | None:
        extra = {"ContentType": content_type} if content_type else {}
        with self._errors("writing", key):
            resp = self.client.put_object(Bucket=self.bucket, Key=self.key(key), Body=bytes(data), **cond, **extra)
        return resp.get("ETag")

    def put_if_absent(self, key: str, data: bytes, *, content_type: str | None = None) -> str | None:
        return self._put_conditional(key, data, {"IfNoneMatch": "*"}, content_type)

    def put_if_match(self, key: str, data: bytes, etag: str, *, content_type: str | None = None) -> str | None:
        try:
            return self._put_conditional(key, data, {"IfMatch": etag}, content_type)
        except ObjectNotFoundError:
            # AWS answers If-Match on a missing key with 404, SeaweedFS with 412: the same refusal.
            raise PreconditionFailedError(f"writing {self.url(key)}: refused, there is no object to match "
                                          f"ETag {etag} (it was deleted)") from None

    def copy(self, src_key: str, dst_key: str) -> None:
        try:
            # The transfer manager's copy: server-side, in parts above its threshold.
            self.client.copy({"Bucket": self.bucket, "Key": self.key(src_key)}, self.bucket, self.key(dst_key))
        except Exception as e:
            if not is_s3_exception(e):
                raise
            raise s3_error(e, self.settings, f"copying {self.url(src_key)} to {self.url(dst_key)}", self.bucket,
                           self.url(src_key)) from e

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        cond = {"IfMatch": if_match} if if_match else {}
        try:
            with self._errors("deleting", key):
                self.client.delete_object(Bucket=self.bucket, Key=self.key(key), **cond)
        except ObjectNotFoundError:
            if not if_match:
                raise
            raise PreconditionFailedError(f"deleting {self.url(key)}: refused, there is no object to match "
                                          f"ETag {if_match} (it was deleted)") from None

    def delete_many(self, keys: Iterable[str]) -> int:
        batch: list[str] = []
        n = 0

        def flush() -> None:
            with self._errors("deleting under", ""):
                self.client.delete_objects(Bucket=self.bucket,
                                           Delete={"Objects": [{"Key": self.key(k)} for k in batch], "Quiet": True})

        for key in keys:
            batch.append(key)
            n += 1
            if len(batch) == 1000:  # S3's limit per DeleteObjects request
                flush()
                batch.clear()
        if batch:
            flush()
        return n

    def make_bucket(self) -> None:
        """Make the bucket (demos and tests; a production bucket is made by whoever owns it)."""
        with self._errors("creating the bucket of", ""):
            self.client.create_bucket(Bucket=self.bucket)

    def check_bucket(self) -> None:
        from .errors import BucketNotFoundError

        try:
            with self._errors("reaching", ""):
                self.client.head_bucket(Bucket=self.bucket)
        except ObjectNotFoundError:  # HEAD has no body: a missing bucket is a bare 404
            raise BucketNotFoundError(f"reaching {self.root}: bucket {self.bucket!r} does not exist at "
                                      f"{self.settings.where()}; create it or fix the s3:// URL") from None


class RangedObject(SeekableReader):
    """``ObjectStore.open_ranged``: reads at any offset, each one ``get_range`` request (``if_match``
    the ETag seen when opened, where the backend gives one)."""

    def __init__(self, store: ObjectStore, key: str, size: int, etag: str | None) -> None:
        self.store, self.key, self.etag = store, key, etag
        super().__init__(size)
        self.requests = 0  # range requests made: what a reader of a few row groups pays

    @property
    def name(self) -> str:
        return self.store.url(self.key)

    def _take(self, n: int) -> bytes:
        self.requests += 1
        return self.store.get_range(self.key, self._pos, n, if_match=self.etag)


class _Body(io.RawIOBase):
    """An object's body whose read errors come out translated, like every other request's."""

    def __init__(self, body: Any, errors: Any) -> None:
        self._body, self._errors = body, errors

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        with self._errors():
            return self._body.read(None if n is None or n < 0 else n)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def list_buckets(settings: S3Settings | None = None) -> list[str]:
    """The buckets this identity sees at the endpoint (a signed request: a readiness probe)."""
    settings = settings or S3Settings()
    try:
        return sorted(b["Name"] for b in s3_client(settings).list_buckets().get("Buckets", []))
    except Exception as e:
        if not is_s3_exception(e):
            raise
        raise s3_error(e, settings, f"listing the buckets at {settings.where()}", "") from e


# -- local folders -------------------------------------------------------------------------------

class LocalObjects(ObjectStore):
    """A local folder as an object store: keys are relative paths, a put writes a temporary file
    then renames it, conditional puts hold an ``flock`` on the object's folder.

    The ETag is ``"<mtime_ns>-<size>-<inode>"`` in hex: every put makes a new file (a new inode and
    time), so a changed object has a changed ETag without reading its bytes.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path_root = Path(root)
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"LocalObjects({self.root!r})"

    def path(self, key: str) -> Path:
        if key.startswith("/") or "\\" in key or any(p in ("..", ".") for p in key.split("/")):
            raise ValueError(f"bad key {key!r} under {self.root}: want a relative 'a/b/c' path")
        return self.path_root / key if key else self.path_root

    def url(self, key: str = "") -> str:
        return os.fspath(self.path(key))

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return f'"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"'

    @contextmanager
    def _missing(self, key: str, what: str = "reading") -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(self.url(key), f"{what} {self.url(key)}") from None
        except IsADirectoryError:
            raise ObjectNotFoundError(self.url(key), f"{what} {self.url(key)} (a folder)") from None

    def _check_etag(self, key: str, fh: IO[bytes], if_match: str | None) -> None:
        if if_match is not None and self._etag(os.fstat(fh.fileno())) != if_match:
            raise PreconditionFailedError(f"reading {self.url(key)}: it changed (its ETag is not {if_match})")

    def get(self, key: str, *, if_match: str | None = None, max_bytes: int | None = None) -> bytes:
        with self._missing(key), open(self.path(key), "rb") as fh:
            self._check_etag(key, fh, if_match)
            return fh.read() if max_bytes is None else fh.read(max_bytes)

    def get_tagged(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str | None]:
        with self._missing(key), open(self.path(key), "rb") as fh:
            return (fh.read() if max_bytes is None else fh.read(max_bytes)), self._etag(os.fstat(fh.fileno()))

    def get_range(self, key: str, start: int, length: int, *, if_match: str | None = None) -> bytes:
        if start < 0 or length <= 0:
            raise ValueError(f"{self.url(key)}: a range needs start >= 0 and length > 0 (got {start}, {length})")
        with self._missing(key), open(self.path(key), "rb") as fh:
            self._check_etag(key, fh, if_match)
            fh.seek(start)
            return fh.read(length)

    def open(self, key: str) -> IO[bytes]:
        with self._missing(key):
            return open(self.path(key), "rb")

    def head(self, key: str) -> ObjectInfo:
        with self._missing(key):
            st = self.path(key).stat()
            if not self.path(key).is_file():
                raise IsADirectoryError(self.url(key))
        return ObjectInfo(key, st.st_size, self._etag(st), st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        folder_rel, _, _ = prefix.rpartition("/")
        folder = self.path(folder_rel)
        if not folder.is_dir():
            return
        found: list[tuple[str, Path]] = []
        for dirpath, dirs, files in os.walk(folder):
            base = Path(dirpath).relative_to(self.path_root).as_posix()
            base = "" if base == "." else base + "/"
            dirs[:] = [d for d in dirs if (base + d + "/").startswith(prefix) or prefix.startswith(base + d + "/")]
            found += [(base + f, Path(dirpath) / f) for f in files
                      if (base + f).startswith(prefix) and not f.startswith(_TMP_PREFIX)]
        for key, path in sorted(found):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted since the walk
            yield ObjectInfo(key, st.st_size, self._etag(st), st.st_mtime)

    def list_prefixes(self, prefix: str = "") -> Iterator[str]:
        folder = self.path(prefix.rstrip("/"))
        if not folder.is_dir():
            return
        yield from sorted(p.name for p in folder.iterdir() if p.is_dir())

    def list_names(self, prefix: str = "") -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.path(prefix.rstrip("/"))) if not n.startswith(_TMP_PREFIX))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _temp_beside(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"

    def _write_temp(self, target: Path, data: Data) -> Path:
        tmp = self._temp_beside(target)
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                with open(tmp, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
            elif isinstance(data, (str, os.PathLike)):
                shutil.copyfile(os.fspath(data), tmp)
            else:
                with open(tmp, "wb") as fh:
                    shutil.copyfileobj(data, fh, 1 << 20)
                    fh.flush()
                    os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: Data, *, content_type: str | None = None,
            metadata: dict[str, str] | None = None, sha256: str | None = None) -> str | None:
        target = self.path(key)
        os.replace(self._write_temp(target, data), target)
        return self._etag(target.stat())

    @contextmanager
    def _folder_lock(self, target: Path) -> Iterator[None]:
        # Conditional puts of one folder take turns: the check and the rename are one step to others.
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _require_etag(self, target: Path, etag: str, doing: str) -> None:
        """``PreconditionFailedError`` unless the file at ``target`` has ETag ``etag`` (taken under
        its folder lock, so the check and the change after it are one step to other writers)."""
        try:
            now = self._etag(target.stat())
        except FileNotFoundError:
            raise PreconditionFailedError(f"{doing} {target}: refused, there is no object to match "
                                          f"ETag {etag} (it was deleted)") from None
        if now != etag:
            raise PreconditionFailedError(f"{doing} {target}: refused, its ETag is {now}, not {etag} "
                                          "(another writer replaced it)")

    def put_if_absent(self, key: str, data: bytes, *, content_type: str | None = None) -> str | None:
        target = self.path(key)
        tmp = self._write_temp(target, data)
        try:
            with self._folder_lock(target):
                try:
                    os.link(tmp, target)  # fails if the name exists, whoever wrote it, locked or not
                except FileExistsError:
                    raise PreconditionFailedError(f"writing {target}: refused, an object is already there") from None
                return self._etag(target.stat())
        finally:
            tmp.unlink(missing_ok=True)

    def put_if_match(self, key: str, data: bytes, etag: str, *, content_type: str | None = None) -> str | None:
        target = self.path(key)
        tmp = self._write_temp(target, data)
        try:
            with self._folder_lock(target):
                self._require_etag(target, etag, "writing")
                os.replace(tmp, target)
                return self._etag(target.stat())
        finally:
            tmp.unlink(missing_ok=True)

    def copy(self, src_key: str, dst_key: str) -> None:
        src, dst = self.path(src_key), self.path(dst_key)
        with self._missing(src_key, "copying"):
            tmp = self._write_temp(dst, src)
        os.replace(tmp, dst)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        target = self.path(key)
        if if_match is None:
            target.unlink(missing_ok=True)
            return
        with self._folder_lock(target):
            self._require_etag(target, if_match, "deleting")
            target.unlink()

    def check_bucket(self) -> None:
        if not self.path_root.is_dir():
            raise ObjectNotFoundError(self.root, f"reaching {self.root} (not a folder)")


def _whole_sha256(checksum: str | None) -> str | None:
    """S3's ``ChecksumSHA256`` (base64) as hex when it is of the whole object (a multipart
    upload's ends in ``-<parts>``: a digest of its parts' digests, not of the bytes)."""
    if not checksum or "-" in checksum:
        return None
    try:
        raw = base64.b64decode(checksum, validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 32 else None


__all__ = ["DEFAULT_MULTIPART_THRESHOLD", "Data", "LocalObjects", "ObjectInfo", "ObjectStore", "S3Objects",
           "list_buckets", "open_store"]
