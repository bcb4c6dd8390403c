"""The compact wire form of a ShardTable's columns: what rank 0 broadcasts, and a DataLoader
worker started by ``spawn`` receives.

A million tars' columns are ~95 MB in memory, most of it tar and key-index paths that repeat a
prefix and a counter pattern (``part_000123/123456.tar``) and id columns that are constant per
manifest. Each column is sent as zstd-compressed buffers: strings as their UTF-8 bytes plus the
lengths in the narrowest unsigned type, integers in the narrowest type that holds their range.
zstd finds the repeats by itself, so no naming pattern is assumed: any paths round-trip exactly,
just less compressed when they share nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

_CODEC = "zstd"


def _squeeze(buf: Any) -> tuple[int, bytes]:
    data = memoryview(buf)
    return data.nbytes, pa.compress(data, codec=_CODEC, asbytes=True) if data.nbytes else b""


def _unsqueeze(packed: tuple[int, bytes]) -> pa.Buffer:
    size, data = packed
    return pa.decompress(data, decompressed_size=size, codec=_CODEC) if size else pa.py_buffer(b"")


def _narrowest(a: np.ndarray) -> np.ndarray:
    if a.size == 0 or a.dtype.kind not in "iu":
        return a
    lo, hi = int(a.min()), int(a.max())
    for dt in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return a.astype(dt, copy=False)
    return a


def pack_ints(a: np.ndarray) -> tuple:
    a = np.ascontiguousarray(a)
    small = _narrowest(a)
    return ("ints", str(a.dtype), str(small.dtype), len(a), _squeeze(small))


def unpack_ints(packed: tuple) -> np.ndarray:
    _, dtype, small, n, data = packed
    return np.frombuffer(_unsqueeze(data), dtype=small, count=n).astype(dtype)


def pack_strings(arr: pa.Array) -> tuple:
    """A string (or all-null) Arrow array as (lengths, bytes, validity), each compressed."""
    n = len(arr)
    if arr.type == pa.null():
        return ("strings", "null", n, None, None, None)
    if arr.type != pa.string():
        arr = arr.cast(pa.string())
    validity, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=arr.offset + n + 1)[arr.offset:]
    lengths = np.diff(offsets)
    data = b"" if data_buf is None or n == 0 else memoryview(data_buf)[offsets[0]:offsets[-1]]
    mask = None
    if arr.null_count:
        mask = _squeeze(np.packbits(arr.is_valid().to_numpy(zero_copy_only=False), bitorder="little"))
    return ("strings", "string", n, pack_ints(lengths), _squeeze(data), mask)


def unpack_strings(packed: tuple) -> pa.Array:
    _, kind, n, lengths, data, mask = packed
    if kind == "null":
        return pa.nulls(n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(unpack_ints(lengths), out=offsets[1:])
    validity = None if mask is None else _unsqueeze(mask)
    return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(offsets), _unsqueeze(data)],
                                 null_count=-1 if mask is not None else 0)
