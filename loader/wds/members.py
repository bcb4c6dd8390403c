"""One tar of a shard, opened for reading (``loader.formats.twin_tar.TarCursor`` reads the tar)."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator

from loader.formats.twin_tar import TarCursor, TarReadError
from loader.io import urls
from loader.wds.errors import ChecksumError, ShardReadError

# What repairs a dataset whose tar is missing or differs from its manifest (pid_platform/cli.py).
REPAIR_HINT = ("repair it by running the build that wrote it again with --repair (pid-shard --input-dir <its source> "
               "--output-dir <this output> --repair): it rewrites or re-uploads every missing or damaged tar")
SMALL_MEMBERS = 16 << 10  # a tar whose members average less than this is read through a buffer
SMALL_MEMBERS_BUFFER = 64 << 10


def open_stream(url: str, start: int = 0, stream_config=None, stats=None, members: int | None = None,
                ahead=None, limit: int | None = None):
    """A byte stream of ``url`` from byte ``start``. ``members``: how many members the file
    holds, if known: a local tar of small members (captions, embeddings) is read through a
    64 KiB buffer, one system call for many members; one of large members is read unbuffered,
    each member's data straight into the bytes handed on (a buffer would copy it twice).
    ``ahead`` (a ``loader.io.read_ahead.ReadAhead``): a remote file is read through it, its
    ranges fetched ahead up to byte ``limit`` (None: its end)."""
    if urls.is_local(url):
        path = urls.local_path(url)
        fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
        if start:
            fh.seek(start)
        if members and os.fstat(fh.fileno()).st_size < members * SMALL_MEMBERS:
            return io.BufferedReader(fh, SMALL_MEMBERS_BUFFER)
        return fh
    if ahead is not None:
        return ahead.open(url, start, limit)
    from loader.io import open_url

    return open_url(url, start=start, config=stream_config, stats=stats)


class _Hashing:
    """A read-only stream that hashes every byte read through it."""

    def __init__(self, raw):
        self.raw = raw
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.digest.update(data)
        return data


class OpenTar:
    """One modality tar of a shard, open at a header boundary: ``cursor`` reads its members.

    ``sha256``: the tar's checksum from its manifest; reading starts at byte 0, every byte is
    hashed, and :meth:`check_sha256` (once the members are exhausted) reads the rest and compares.
    """

    __slots__ = ("url", "start", "stream", "source", "cursor")

    def __init__(self, url: str, start: int = 0, stream_config=None, stats=None, sha256: str | None = None,
                 members: int | None = None, ahead=None, limit: int | None = None, stream=None):
        """``stream``: the tar's stream from ``start``, opened already (read-ahead streams of a
        shard's tars are all opened before the first is read: their first bytes come at once)."""
        if sha256 is not None and start:
            raise ValueError("a checksum covers the whole tar: read it from byte 0")
        self.url, self.start = url, start
        try:
            self.stream = stream if stream is not None else open_stream(url, start, stream_config, stats, members,
                                                                        ahead, limit)
        except FileNotFoundError:
            raise self.read_error(FileNotFoundError(url)) from None
        self.source = _Hashing(self.stream) if sha256 is not None else self.stream
        try:
            self.cursor = TarCursor(self.source, url, start)
        except (TarReadError, EOFError, OSError) as exc:
            self.stream.close()
            raise self.read_error(exc) from None if isinstance(exc, FileNotFoundError) else exc
        except BaseException:
            self.stream.close()
            raise

    def read_error(self, exc: BaseException) -> ShardReadError:
        """The loader's error for a failure while reading this tar (a ``TarReadError`` or an I/O error)."""
        if isinstance(exc, FileNotFoundError):  # a read-ahead stream learns it at its first read
            return ShardReadError(f"{self.url}: tar not found, though its manifest lists it; {REPAIR_HINT}")
        if isinstance(exc, TarReadError):
            stale = ""
            if self.start and exc.offset == self.start:
                stale = (f" (reading started at byte {self.start}, where the key index puts a member: if the tar was "
                         "rewritten after its key index was built, the index is stale - rebuild it)")
            return ShardReadError(
                f"{self.url}: unreadable tar ({exc.problem}){stale}; the file is truncated or corrupt - rebuild the "
                "shard or set shard_error_policy='skip'"
            )
        return ShardReadError(
            f"{self.url}: unreadable tar after byte {self.start} ({type(exc).__name__}: {exc}); "
            "the file is truncated or corrupt - rebuild the shard or set shard_error_policy='skip'"
        )

    def check_sha256(self, sha256: str) -> None:
        assert isinstance(self.source, _Hashing)
        while self.source.read(1 << 20):
            pass
        got = self.source.digest.hexdigest()
        if got != sha256:
            raise ChecksumError(
                f"{self.url}: sha256 {got} differs from the {sha256} its manifest lists; the tar changed or "
                f"is damaged - {REPAIR_HINT}, or set shard_error_policy='skip'"
            )

    def close(self) -> None:
        self.stream.close()


def iter_members(url: str, start: int = 0, stream_config=None, stats=None,
                 sha256: str | None = None) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of each regular file, from byte ``start`` (a header boundary);
    with ``sha256``, the whole tar is checked once its members are exhausted (``ChecksumError``)."""
    tar = OpenTar(url, start, stream_config, stats, sha256)
    try:
        nxt = tar.cursor.next
        while True:
            try:
                member = nxt()
            except (TarReadError, EOFError, OSError) as exc:
                raise tar.read_error(exc) from exc
            if member is None:
                break
            yield member
        if sha256 is not None:
            tar.check_sha256(sha256)
    finally:
        tar.close()


def split_key(name: str, known: dict | set | None = None) -> tuple[str, str]:
    """Key and extension of a member name, the WebDataset way (first dot of the basename).

    With ``known`` keys (index mode), a name like ``a.b.jpg`` whose key really is ``a.b`` is
    matched too: the longest known prefix ending at a dot wins.
    """
    slash = name.rfind("/") + 1
    if known is not None:
        dot = len(name)
        while (dot := name.rfind(".", slash, dot)) != -1:
            if name[:dot] in known:
                return name[:dot], name[dot + 1 :]
    dot = name.find(".", slash)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])
