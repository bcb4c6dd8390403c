"""Iterate the members of one tar stream, on top of the webdataset library's tar iteration."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from webdataset.tariterators import tar_file_iterator

from loader.wds.errors import ShardReadError


def _reraise(exc: Exception) -> bool:
    raise exc


def open_stream(url: str, start: int = 0, stream_config=None, stats=None):
    if "://" not in url or url.startswith("file://"):
        path = url.removeprefix("file://")
        fh = open(path, "rb")  # noqa: SIM115 - closed by the caller
        if start:
            fh.seek(start)
        return fh
    from loader.io import open_url

    return open_url(url, start=start, config=stream_config, stats=stats)


def iter_members(url: str, start: int = 0, stream_config=None, stats=None) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of each regular file, from byte ``start`` (a header boundary)."""
    try:
        stream = open_stream(url, start, stream_config, stats)
    except FileNotFoundError:
        raise ShardReadError(f"{url}: tar not found; is the manifest stale? rebuild or re-sync the dataset") from None
    with stream:
        it = tar_file_iterator(stream, skip_meta=None, handler=_reraise)
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise ShardReadError(
                    f"{url}: unreadable tar after byte {start} ({type(exc).__name__}: {exc}); "
                    "the file is truncated or corrupt - rebuild the shard or set shard_error_policy='skip'"
                ) from exc
            yield item["fname"], item["data"]


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
