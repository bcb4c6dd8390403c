"""Where raw sources live: one interface, a local and an S3 implementation.

A raw root holds one folder per source (a raw drop); each source holds one folder per modality
(``image/``, ``caption/``, ``umt5/`` ...). Listings are sorted so every later step is
deterministic.
"""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from loader.formats.atomic import atomic_write_bytes
from loader.io import errors as io_errors
from loader.io import urls
from pid_platform.sharding.compute import ascending, pc
from pid_platform.sharding.errors import BuildError, PlannedFileChangedError, SourceNotFoundError

if TYPE_CHECKING:  # boto3 and the HTTP stack: imported where S3 is used, not for a local listing
    from loader.io.objects import S3Objects
    from loader.io.s3_client import S3Settings


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One listed file. Slotted, and the folder is one string shared by every file of a listing:
    a source of a million files is held in a few hundred MB."""

    modality: str
    name: str  # file name inside the modality folder
    size: int
    # Changes when the file's bytes may have changed: local ``size:mtime_ns:ctime_ns:inode`` (the
    # identity loader.lerobot.fs.file_identity computes; a rewrite in place moves the times, an
    # atomic replace the inode), S3 ``size:etag``.
    fingerprint: str
    folder: str | None = None  # local folder holding the file: its bytes can be copied without reading

    @property
    def local_path(self) -> str | None:
        """Set when the bytes can be copied without reading them."""
        return None if self.folder is None else f"{self.folder}/{self.name}"


# A modality folder's files as columns, sorted by name (UTF-8 byte order is code point order, so
# this is Python's order of the names too).
FILES_SCHEMA = pa.schema([("name", pa.string()), ("size", pa.int64()), ("fingerprint", pa.string())])
_CHUNK_FILES = 64 * 1024  # files gathered as Python values before they become Arrow arrays


class FileColumns:
    """Listed files gathered a chunk at a time into Arrow arrays: a listing of ten million files
    holds its names and fingerprints as column bytes, never as a Python object per file."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._sizes: list[int] = []
        self._fingerprints: list[str] = []
        self._batches: list[pa.RecordBatch] = []

    def add(self, name: str, size: int, fingerprint: str) -> None:
        self._names.append(name)
        self._sizes.append(size)
        self._fingerprints.append(fingerprint)
        if len(self._names) >= _CHUNK_FILES:
            self._flush()

    def _flush(self) -> None:
        if self._names:
            columns = [self._names, self._sizes, self._fingerprints]
            self._batches.append(pa.record_batch(columns, schema=FILES_SCHEMA))  # each list typed by the schema
            self._names, self._sizes, self._fingerprints = [], [], []

    def table(self) -> pa.Table:
        """Every file added, sorted by name, in one chunk."""
        self._flush()
        table = pa.Table.from_batches(self._batches, schema=FILES_SCHEMA)
        self._batches = []
        if not ascending(table["name"]):
            table = table.take(pc.sort_indices(table["name"]))
        return table.combine_chunks()


@dataclass
class Listing:
    """One modality folder's listing."""

    modality: str
    # name, size, fingerprint of every file kept (``FILES_SCHEMA``), sorted by name.
    files: pa.Table = field(default_factory=FILES_SCHEMA.empty_table)
    # The local folder holding the files (their bytes can be copied without reading); None on S3.
    folder: str | None = None
    # (path relative to the source, reason) of every file that was looked at and not used.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # Set when the modality folder is a link to another modality folder of the source: the same
    # files again, so not a modality of its own.
    duplicate_of: str | None = None

    def __len__(self) -> int:
        return self.files.num_rows


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
    def read(self, source: str, entry: FileEntry, n: int | None = None) -> bytes:
        """The file's bytes; with ``n``, its first ``n`` (enough to sniff a format without
        fetching the whole file)."""

    def planned_path(self, source: str, entry: FileEntry) -> str | None:
        """A local file to copy a planned file's bytes from, once checked to be the file the
        plan fingerprinted (``PlannedFileChangedError`` otherwise); None where the bytes are
        read with ``read`` (an object store checks them there, by ETag)."""
        return None

    def describe(self, source: str, entry: FileEntry) -> str:
        return f"{self.uri.rstrip('/')}/{source}/{entry.modality}/{entry.name}"

    def source_file_uri(self, source: str, name: str) -> str:
        """Where a file at the top of a source folder (beside its modality folders) lives."""
        return f"{self.uri.rstrip('/')}/{source}/{name}"

    @abstractmethod
    def read_source_file(self, source: str, name: str, max_bytes: int | None = None) -> bytes | None:
        """A file at the top of the source folder (its settings), or ``None`` if there is none;
        at most its first ``max_bytes`` bytes (a settings file someone made huge is not read whole)."""

    @abstractmethod
    def write_source_file(self, source: str, name: str, data: bytes) -> None:
        """Replace a file at the top of the source folder in one step."""


def _is_utf8(name: str) -> bool:
    # os.listdir turns bytes that are not UTF-8 into lone surrogates (PEP 383).
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(name: str) -> str:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def plain_name(name: object, what: str) -> str:
    """``name`` as one path component (no folder, no ``..``): what a plan may name a file or a
    modality folder by. A plan file is read from a shared folder or bucket, so it is checked."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise PlannedFileChangedError(f"the plan names {what} {name!r}, not a file name of the source: the plan "
                                      "files were changed after the plan; run the plan again")
    return name


class LocalSourceStore(SourceStore):
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).resolve()
        self.uri = str(self.root)
        self._modality_dirs: dict[tuple[str, str], tuple[str, Path]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_modality_dirs": {}}

    def _modality_dir(self, source: str, modality: str) -> tuple[str, Path]:
        """(the modality folder, resolved; the source folder, resolved), once per folder."""
        found = self._modality_dirs.get((source, modality))
        if found is None:
            src_root = self._source_dir(plain_name(source, "the source")).resolve()
            folder = (src_root / plain_name(modality, "the modality folder")).resolve()
            if not folder.is_relative_to(src_root):
                raise PlannedFileChangedError(f"{src_root / modality}: links out of the source {src_root}; its files "
                                              "are not read (the listing skips such a folder)")
            found = self._modality_dirs[(source, modality)] = (os.fspath(folder), src_root)
        return found

    def _path(self, source: str, entry: FileEntry) -> str:
        """The file ``entry`` names, by name under its modality folder of ``source``: never a path
        a plan or cache carries, so a changed plan file cannot make a build read another file."""
        folder, _ = self._modality_dir(source, entry.modality)
        return os.path.join(folder, plain_name(entry.name, "the file"))

    def planned_path(self, source: str, entry: FileEntry) -> str:
        path = self._path(source, entry)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):  # as the listing: a link must stay in the source
                _, src_root = self._modality_dir(source, entry.modality)
                if not Path(path).resolve().is_relative_to(src_root):
                    raise PlannedFileChangedError(f"{path}: links out of the source {src_root}; not read")
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        now = None if st is None else f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
        if now != entry.fingerprint:
            raise PlannedFileChangedError(
                f"{path}: the source changed after the plan ({'gone' if st is None else 'rewritten or replaced'}: "
                f"identity {now or '-'}, planned {entry.fingerprint}); run the plan again")
        return path

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
        out = Listing(modality)
        if not folder.resolve().is_relative_to(src_root):
            # A modality folder linked elsewhere would read arbitrary files, like a linked file.
            out.skipped.append((modality, "symlink_outside_root"))
            return out
        if folder.is_symlink():
            target = folder.resolve()
            for other in self.list_modalities(source):
                if other != modality and not (src_root / other).is_symlink() and (src_root / other).resolve() == target:
                    out.skipped.append((modality, "duplicate_modality"))
                    out.duplicate_of = other
                    return out
        base = os.fspath(folder)
        out.folder = base
        files = FileColumns()
        skipped: list[tuple[str, str, str]] = []  # (raw name, shown path, reason), sorted by raw name
        # One scandir pass and one stat per file: the entry's type comes with the listing, and a
        # million names are never held twice.
        with os.scandir(base) as it:
            for d in it:
                name = d.name
                rel = f"{modality}/{name}"
                if not _is_utf8(name):
                    # Keys, key indexes and manifests are UTF-8 text; such a name cannot be carried.
                    skipped.append((name, f"{modality}/{_printable(name)}", "name_not_utf8"))
                    continue
                if name.startswith("."):
                    skipped.append((name, rel, "hidden_file"))
                    continue
                if d.is_symlink():
                    p = Path(d.path)
                    if not p.exists():  # dangling, wherever it points: nothing to read, nothing to leak
                        skipped.append((name, rel, "broken_symlink"))
                        continue
                    # Following a link out of the source would let one drop read arbitrary files.
                    if not p.resolve().is_relative_to(src_root):
                        skipped.append((name, rel, "symlink_outside_root"))
                        continue
                if not d.is_file():
                    skipped.append((name, rel, "not_a_regular_file"))
                    continue
                st = d.stat()
                fp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
                files.add(name, st.st_size, fp)
        out.files = files.table()
        skipped.sort()
        out.skipped.extend((rel, reason) for _, rel, reason in skipped)
        return out

    def read(self, source: str, entry: FileEntry, n: int | None = None) -> bytes:
        with open(self._path(source, entry), "rb") as fh:
            return fh.read(n)

    def read_source_file(self, source: str, name: str, max_bytes: int | None = None) -> bytes | None:
        path = self._source_dir(source) / name
        try:
            # O_NONBLOCK: a named pipe put there must not hang the reader (and every sensor tick).
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BuildError(f"{path} is not a regular file (a folder, a pipe or a device); it must be a "
                             "file, or absent")
        with os.fdopen(fd, "rb") as fh:
            return fh.read() if max_bytes is None else fh.read(max_bytes)

    def write_source_file(self, source: str, name: str, data: bytes) -> None:
        atomic_write_bytes(self._source_dir(source) / name, data)


class S3SourceStore(SourceStore):
    """``s3://bucket/prefix``; the endpoint comes from the argument (or ``settings``) or
    ``AWS_ENDPOINT_URL(_S3)``.

    Clients come from the project's one factory (``loader.io.s3_client``); credentials and
    region from boto3's usual chain in the process that makes the store. A pickled store (a
    build worker's copy) carries the credentials that chain resolved, not a client: spawned
    workers see the environment of when the pool started them, which may predate the
    credentials. Errors become ``SourceNotFoundError`` / ``BuildError`` naming the object, the
    endpoint and what to check.
    """

    def __init__(self, uri: str, endpoint_url: str | None = None, *, settings: S3Settings | None = None):
        try:
            self.bucket, self.prefix = urls.split_s3(uri)
        except ValueError:
            raise ValueError(f"not an s3:// URI: {uri!r}") from None
        self.uri = uri.rstrip("/")
        from loader.io.s3_client import S3Settings

        settings = settings or S3Settings()
        # The endpoint is fixed when the store is made, like the client the store keeps.
        self.settings = replace(settings, endpoint_url=endpoint_url or settings.endpoint())
        self._frozen: S3Settings | None = None
        self._objects: S3Objects | None = None

    def __getstate__(self) -> dict[str, Any]:  # boto3 clients do not pickle; credentials travel resolved
        # Resolved once per store: every task of a worker pool pickles the store again.
        if self._frozen is None:
            self._frozen = self.settings.frozen_credentials()
        return {**self.__dict__, "settings": self._frozen, "_objects": None}

    def __repr__(self) -> str:  # never the credentials
        return f"S3SourceStore({self.uri!r}, endpoint_url={self.settings.endpoint()!r})"

    @property
    def objects(self) -> S3Objects:
        """The bucket below ``s3://bucket`` (keys here carry the root's prefix)."""
        if self._objects is None:
            from loader.io.objects import S3Objects

            self._objects = S3Objects(f"s3://{self.bucket}", self.settings)
        return self._objects

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The storage layer's errors as build errors (the boto3 exception stays the cause)."""
        try:
            yield
        except io_errors.BucketNotFoundError as e:
            raise SourceNotFoundError(str(e).replace("the s3:// URL", "the s3:// root")) from e.__cause__
        except io_errors.PreconditionFailedError as e:
            what = str(e).split(": S3 at ", 1)[0]
            raise BuildError(f"{what}: the object changed since it was listed (its ETag differs); "
                             "re-run the build once the source has stopped changing") from e.__cause__
        # Gone since it was listed, refused, unreachable.
        except (io_errors.StorageError, io_errors.ObjectNotFoundError) as e:
            raise BuildError(str(e)) from e.__cause__

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _prefixes(self, prefix: str) -> list[str]:
        with self._errors():
            return [n for n in self.objects.list_prefixes(prefix) if not n.startswith((".", "_"))]

    def list_sources(self) -> list[str]:
        return self._prefixes(self._key() + "/" if self.prefix else "")

    def list_modalities(self, source: str) -> list[str]:
        mods = self._prefixes(self._key(source) + "/")
        if not mods:
            raise SourceNotFoundError(
                f"source {source!r} not found under {self.uri}: no modality folders at "
                f"s3://{self.bucket}/{self._key(source)}/; sources there are {self.list_sources()}"
            )
        return mods

    def list_files(self, source: str, modality: str) -> Listing:
        prefix = self._key(source, modality) + "/"
        out = Listing(modality)
        files = FileColumns()
        with self._errors():
            for obj in self.objects.list(prefix):
                name = obj.key[len(prefix) :]
                rel = f"{modality}/{name}"
                if not name:
                    continue  # the folder's own marker object ("image/"): no file, no data
                if "/" in name:
                    out.skipped.append((rel, "nested_object"))
                elif name.startswith("."):
                    out.skipped.append((rel, "hidden_file"))
                else:
                    etag = str(obj.etag or "").strip('"')
                    files.add(name, obj.size, f"{obj.size}:{etag}")
        out.files = files.table()
        return out

    def read(self, source: str, entry: FileEntry, n: int | None = None) -> bytes:
        # If-Match: the bytes written to a tar are the bytes that were listed (and checked).
        etag = entry.fingerprint.partition(":")[2]
        key, if_match = self._key(source, entry.modality, entry.name), f'"{etag}"' if etag else None
        with self._errors():
            if n is None:
                return self.objects.get(key, if_match=if_match)
            return self.objects.get_range(key, 0, n, if_match=if_match)

    def read_source_file(self, source: str, name: str, max_bytes: int | None = None) -> bytes | None:
        with self._errors():
            try:
                # No Range header: S3 refuses a range of an empty object; the body is read only as far as needed.
                return self.objects.get(self._key(source, name), max_bytes=max_bytes)
            except io_errors.ObjectNotFoundError:
                return None

    def write_source_file(self, source: str, name: str, data: bytes) -> None:
        with self._errors():
            self.objects.put(self._key(source, name), data)


def open_source_store(root: str, endpoint_url: str | None = None) -> SourceStore:
    if urls.kind(root, allowed=("local", "s3"), what="source root") == "s3":
        return S3SourceStore(root, endpoint_url)
    return LocalSourceStore(urls.local_path(root))
