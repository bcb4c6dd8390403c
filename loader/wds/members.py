"""Iterate the members of one tar stream (``loader.formats.twin_tar.iter_tar`` reads the tar)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from loader.formats.twin_tar import TarReadError, iter_tar
from loader.wds.errors import ChecksumError, ShardReadError


def open_stream(url: str, start: int = 0, stream_config=None, stats=None):
    if "://" not in url or url.startswith("file://"):
        path = url.removeprefix("file://")
        fh = open(path, "rb")  # noqa: SIM115 - closed by the caller
        if start:
            fh.seek(start)
        return fh
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


def iter_members(url: str, start: int = 0, stream_config=None, stats=None,
                 sha256: str | None = None) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of each regular file, from byte ``start`` (a header boundary).

    ``sha256``: the tar's checksum from its manifest; read from byte 0, every byte is hashed and,
    once the members are exhausted, the rest of the file too, then compared (``ChecksumError``).
    """
    if sha256 is not None and start:
        raise ValueError("a checksum covers the whole tar: read it from byte 0")
    try:
        stream = open_stream(url, start, stream_config, stats)
    except FileNotFoundError:
        raise ShardReadError(f"{url}: tar not found; is the manifest stale? rebuild or re-sync the dataset") from None
    with stream:
        source = _Hashing(stream) if sha256 is not None else stream
        try:
            yield from iter_tar(source, url, start)
        except TarReadError as exc:
            stale = ""
            if start and exc.offset == start:
                stale = (f" (reading started at byte {start}, where the key index puts a member: if the tar was "
                         "rewritten after its key index was built, the index is stale - rebuild it)")
            raise ShardReadError(
                f"{url}: unreadable tar ({exc.problem}){stale}; the file is truncated or corrupt - rebuild the "
                "shard or set shard_error_policy='skip'"
            ) from exc
        except (EOFError, OSError) as exc:
            raise ShardReadError(
                f"{url}: unreadable tar after byte {start} ({type(exc).__name__}: {exc}); "
                "the file is truncated or corrupt - rebuild the shard or set shard_error_policy='skip'"
            ) from exc
        if sha256 is not None:
            while source.read(1 << 20):
                pass
            got = source.digest.hexdigest()
            if got != sha256:
                raise ChecksumError(
                    f"{url}: sha256 {got} differs from the {sha256} its manifest lists; the tar changed or "
                    "is damaged - rebuild or re-sync it, or set shard_error_policy='skip'"
                )


def split_key(name: str, known: dict | set | None = None) -> tuple[str, str]:
    """Key and extension of a member name, the WebDataset way (first dot of the basename).

    With ``known`` keys (index mode), a name like ``a.b.jpg`` whose key really is ``a.b`` is
    matched too: the longest known prefix ending at a dot wins.
    """
    slash = name.rfind("/") + 1
    base = name[slash:]
    if known is not None and "." in base:
        dot = len(name)
        while (dot := name.rfind(".", slash, dot)) != -1:
            if name[:dot] in known:
                return name[:dot], name[dot + 1 :]
    if "." not in base:
        return name, ""
    dot = slash + base.index(".")
    return name[:dot], name[dot + 1 :]
