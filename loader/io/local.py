"""Local files: a plain file object seeked to ``start``, fenced to ``length`` when one is given."""

from __future__ import annotations

import io
import os

from .config import StreamStats


class FileWindow(io.BufferedIOBase):
    """``[start, start + length)`` of an open file; ``tell()`` stays the offset in the file."""

    def __init__(self, f: io.BufferedReader, end: int | None, stats: StreamStats | None):
        self._f = f
        self._end = end
        self._stats = stats

    @property
    def name(self) -> str:
        return self._f.name

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def _room(self, n: int | None) -> int | None:
        if self._end is None:
            return None if n is None or n < 0 else n
        left = max(0, self._end - self._f.tell())
        return left if n is None or n < 0 else min(n, left)

    def read(self, n: int | None = -1) -> bytes:
        self._checkClosed()
        data = self._f.read(self._room(n))
        self._count(len(data))
        return data

    def read1(self, n: int = -1) -> bytes:
        self._checkClosed()
        room = self._room(n)
        data = self._f.read1(-1 if room is None else room)
        self._count(len(data))
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self._checkClosed()
        view = memoryview(buffer).cast("B")
        room = self._room(len(view))
        n = self._f.readinto(view[:room]) or 0
        self._count(n)
        return n

    readinto1 = readinto

    def close(self) -> None:
        self._f.close()
        super().close()

    def _count(self, n: int) -> None:
        if self._stats is not None and n:
            self._stats.add(bytes_read=n)


def open_local(path: str | os.PathLike[str], start: int, length: int | None,
               stats: StreamStats | None) -> io.BufferedIOBase:
    f = open(path, "rb")  # noqa: SIM115 - the caller owns the file
    try:
        if start:
            f.seek(start)
        if stats is not None:
            stats.add(opens=1)
    except BaseException:
        f.close()
        raise
    if length is None and stats is None:
        return f
    return FileWindow(f, None if length is None else start + length, stats)
