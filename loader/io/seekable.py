"""A read-only, seekable file of a known size whose bytes come from ranged reads.

The one base for the project's random-access readers (pyarrow reads a parquet file's footer and
row groups through these): ``objects.RangedObject`` over an ``ObjectStore``, and the LeRobot
reader's ``RangeFile`` over its retrying fetcher. A subclass says how to get ``n`` bytes at the
position (``_take``); the position, seeking and the read calls are here.
"""

from __future__ import annotations

import io


class SeekableReader(io.RawIOBase):
    """``size`` bytes read at any position; not for sharing between threads (it has a position)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"{self.name}: size must be >= 0, got {size}")
        self._size = int(size)
        self._pos = 0

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def size(self) -> int:
        return self._size

    def _take(self, n: int) -> bytes:
        """The ``n`` (> 0, within the file) bytes at the position; the subclass's one job."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence!r}")
        if pos < 0:
            raise OSError(f"{self.name}: negative seek position {pos}")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        # Overridden so a large read hands the caller the fetched bytes as they are (no copies).
        self._checkClosed()
        if size is None or size < 0:
            size = self._size - self._pos
        n = min(size, self._size - self._pos)
        data = self._take(n) if n > 0 else b""
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self._checkClosed()
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._size - self._pos)
        data = self._take(n) if n > 0 else b""
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)
