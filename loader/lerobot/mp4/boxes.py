"""ISO BMFF box parsing on bytes already in memory: headers, children, and the sample tables.

Everything here is pure (no I/O). Functions raise ``Mp4FormatError`` with a message that says
which box is wrong; ``index.py`` prefixes the file name.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import Mp4FormatError

HEADER = 8          # size (u32) + type (4cc)
LARGE_HEADER = 16   # ... + largesize (u64) when size == 1


@dataclass(frozen=True)
class Box:
    """One box: ``type`` and its extent ``[start, end)``, payload from ``body``.

    Offsets are relative to whatever buffer (or file) the box was found in.
    """

    type: str
    start: int
    end: int
    body: int

    @property
    def size(self) -> int:
        return self.end - self.start


def parse_header(data: bytes | memoryview, pos: int, limit: int | None) -> tuple[str, int | None, int]:
    """(type, size or None for "to the end", header length) of the box header at ``data[pos:]``.

    ``limit`` is where the enclosing space ends (None: unknown, e.g. the file's end at top level);
    needed only to resolve size == 0. Needs 8 bytes, or 16 when size == 1.
    """
    if len(data) - pos < HEADER:
        raise Mp4FormatError(f"truncated box header at {pos}")
    size, raw_type = struct.unpack_from(">I4s", data, pos)
    box_type = raw_type.decode("latin-1")
    if size == 1:
        if len(data) - pos < LARGE_HEADER:
            raise Mp4FormatError(f"truncated 64-bit box header of {box_type!r} at {pos}")
        (size,) = struct.unpack_from(">Q", data, pos + HEADER)
        header = LARGE_HEADER
    elif size == 0:  # the box runs to the end of its container (the file, at top level)
        return box_type, (None if limit is None else limit - pos), HEADER
    else:
        header = HEADER
    if size < header:
        raise Mp4FormatError(f"box {box_type!r} at {pos} has size {size}, smaller than its header")
    return box_type, size, header


def children(data: bytes | memoryview, start: int, end: int) -> Iterator[Box]:
    """The boxes packed in ``data[start:end]``, each checked to lie inside it."""
    pos = start
    while pos < end:
        if end - pos < HEADER:
            raise Mp4FormatError(f"{end - pos} stray bytes at {pos} inside a box")
        box_type, size, header = parse_header(data, pos, end)
        assert size is not None
        if pos + size > end:
            raise Mp4FormatError(f"box {box_type!r} at {pos} (size {size}) overruns its parent ending at {end}")
        yield Box(box_type, pos, pos + size, pos + header)
        pos += size


def child(data: bytes | memoryview, parent: Box, box_type: str, *, required: bool = True) -> Box | None:
    """The first child of ``parent`` of type ``box_type`` (None, or an error when required)."""
    for box in children(data, parent.body, parent.end):
        if box.type == box_type:
            return box
    if required:
        raise Mp4FormatError(f"box {parent.type!r} has no {box_type!r} box")
    return None


def full_box(data: bytes | memoryview, box: Box) -> tuple[int, int, int]:
    """(version, flags, payload offset) of a FullBox."""
    if box.end - box.body < 4:
        raise Mp4FormatError(f"box {box.type!r} is too short for a version and flags")
    word = struct.unpack_from(">I", data, box.body)[0]
    return word >> 24, word & 0xFFFFFF, box.body + 4


def _table(data, box: Box, pos: int, count: int, dtype: np.dtype | str, width: int) -> np.ndarray:
    """``count`` big-endian records of ``width`` bytes at ``pos``, checked against the box end."""
    if pos + count * width > box.end:
        raise Mp4FormatError(f"box {box.type!r} claims {count} entries but holds only "
                             f"{max(0, box.end - pos) // width}")
    dtype = np.dtype(dtype)
    return np.frombuffer(data, dtype=dtype, count=count * width // dtype.itemsize, offset=pos)


def _count(data, box: Box, pos: int) -> int:
    if pos + 4 > box.end:
        raise Mp4FormatError(f"box {box.type!r} is too short for its entry count")
    return struct.unpack_from(">I", data, pos)[0]


# ---------------------------------------------------------------------------------------------
# Headers


def parse_mvhd(data, box: Box) -> int:
    """The movie timescale (edit durations are in it)."""
    version, _, pos = full_box(data, box)
    # v1: creation, modification (u64 each) then timescale; v0: u32 each.
    pos += 16 if version == 1 else 8
    if pos + 4 > box.end:
        raise Mp4FormatError("box 'mvhd' is truncated")
    timescale = struct.unpack_from(">I", data, pos)[0]
    if timescale == 0:
        raise Mp4FormatError("box 'mvhd' has timescale 0")
    return timescale


def parse_mdhd(data, box: Box) -> tuple[int, int]:
    """(media timescale, media duration)."""
    version, _, pos = full_box(data, box)
    fmt = ">QQIQ" if version == 1 else ">IIII"
    if pos + struct.calcsize(fmt) > box.end:
        raise Mp4FormatError("box 'mdhd' is truncated")
    _, _, timescale, duration = struct.unpack_from(fmt, data, pos)
    if timescale == 0:
        raise Mp4FormatError("box 'mdhd' has timescale 0")
    return timescale, duration


def parse_tkhd(data, box: Box) -> tuple[int, int, int]:
    """(track_id, display width, display height) — sizes are 16.16 fixed point, rounded down."""
    version, _, pos = full_box(data, box)
    id_pos = pos + (16 if version == 1 else 8)
    size_pos = id_pos + 4 + 4 + (8 if version == 1 else 4) + 8 + 2 + 2 + 2 + 2 + 36
    if size_pos + 8 > box.end:
        raise Mp4FormatError("box 'tkhd' is truncated")
    track_id = struct.unpack_from(">I", data, id_pos)[0]
    width, height = struct.unpack_from(">II", data, size_pos)
    return track_id, width >> 16, height >> 16


def parse_hdlr(data, box: Box) -> str:
    _, _, pos = full_box(data, box)
    if pos + 8 > box.end:
        raise Mp4FormatError("box 'hdlr' is truncated")
    return bytes(data[pos + 4:pos + 8]).decode("latin-1")


def parse_stsd(data, box: Box) -> tuple[str, int | None, int | None]:
    """(codec 4cc, coded width, coded height) of the first sample entry (a VisualSampleEntry)."""
    _, _, pos = full_box(data, box)
    if _count(data, box, pos) < 1:
        raise Mp4FormatError("box 'stsd' has no sample entry")
    entries = list(children(data, pos + 4, box.end))
    if not entries:
        raise Mp4FormatError("box 'stsd' has no sample entry")
    entry = entries[0]
    # SampleEntry: 6 reserved + data_reference_index; VisualSampleEntry: 16 bytes, then width, height.
    size_pos = entry.body + 8 + 16
    if size_pos + 4 > entry.end:
        return entry.type, None, None
    width, height = struct.unpack_from(">HH", data, size_pos)
    return entry.type, width, height


# ---------------------------------------------------------------------------------------------
# Sample tables (all results int64, one entry per sample in decode order unless said)


def parse_stts(data, box: Box) -> np.ndarray:
    """Per-sample durations (decode deltas)."""
    _, _, pos = full_box(data, box)
    n = _count(data, box, pos)
    table = _table(data, box, pos + 4, n, ">u4", 8).reshape(n, 2) if n else np.zeros((0, 2), ">u4")
    return np.repeat(table[:, 1].astype(np.int64), table[:, 0].astype(np.int64))


def parse_ctts(data, box: Box) -> np.ndarray:
    """Per-sample composition offsets (signed).

    Version 1 offsets are signed by definition. Version 0 offsets are unsigned in the spec, but
    muxers have written negative offsets into v0 boxes; like FFmpeg we read both as signed 32-bit
    (a positive offset of 2**31 ticks or more is never meant).
    """
    version, _, pos = full_box(data, box)
    if version > 1:
        raise Mp4FormatError(f"box 'ctts' has unknown version {version}")
    n = _count(data, box, pos)
    table = _table(data, box, pos + 4, n, ">i4", 8).reshape(n, 2) if n else np.zeros((0, 2), ">i4")
    counts = table[:, 0].view(">u4").astype(np.int64)
    return np.repeat(table[:, 1].astype(np.int64), counts)


def parse_stsz(data, box: Box) -> np.ndarray:
    """Per-sample sizes from ``stsz`` or the compact ``stz2``."""
    _, _, pos = full_box(data, box)
    if box.type == "stz2":
        if pos + 8 > box.end:
            raise Mp4FormatError("box 'stz2' is truncated")
        field_size = data[pos + 3]
        n = _count(data, box, pos + 4)
        start = pos + 8
        if field_size == 4:
            packed = _table(data, box, start, (n + 1) // 2, "u1", 1)
            nibbles = np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(-1)
            return nibbles[:n].astype(np.int64)
        if field_size in (8, 16):
            width = field_size // 8
            return _table(data, box, start, n, ">u1" if width == 1 else ">u2", width).astype(np.int64)
        raise Mp4FormatError(f"box 'stz2' has field size {field_size} (4, 8 or 16 expected)")
    if pos + 8 > box.end:
        raise Mp4FormatError("box 'stsz' is truncated")
    constant, n = struct.unpack_from(">II", data, pos)
    if constant:
        return np.full(n, constant, dtype=np.int64)
    return _table(data, box, pos + 8, n, ">u4", 4).astype(np.int64)


def parse_stsc(data, box: Box) -> np.ndarray:
    """Rows of (first_chunk (1-based), samples_per_chunk, sample_description_index)."""
    _, _, pos = full_box(data, box)
    n = _count(data, box, pos)
    if not n:
        return np.zeros((0, 3), np.int64)
    return _table(data, box, pos + 4, n, ">u4", 12).reshape(n, 3).astype(np.int64)


def parse_chunk_offsets(data, box: Box) -> np.ndarray:
    """Absolute chunk offsets from ``stco`` (32-bit) or ``co64`` (64-bit)."""
    _, _, pos = full_box(data, box)
    n = _count(data, box, pos)
    if box.type == "co64":
        return _table(data, box, pos + 4, n, ">u8", 8).astype(np.int64)
    return _table(data, box, pos + 4, n, ">u4", 4).astype(np.int64)


def parse_stss(data, box: Box) -> np.ndarray:
    """0-based indices of the sync samples (the box stores 1-based sample numbers)."""
    _, _, pos = full_box(data, box)
    n = _count(data, box, pos)
    return _table(data, box, pos + 4, n, ">u4", 4).astype(np.int64) - 1


@dataclass(frozen=True)
class Edit:
    segment_duration: int   # movie timescale
    media_time: int         # media timescale; -1: an empty edit
    rate: float             # media_rate as 16.16 fixed point

    @property
    def empty(self) -> bool:
        return self.media_time == -1

    def describe(self) -> str:
        if self.empty:
            return f"empty edit of {self.segment_duration}"
        return f"media edit from {self.media_time} for {self.segment_duration} at rate {self.rate:g}"


def parse_elst(data, box: Box) -> list[Edit]:
    version, _, pos = full_box(data, box)
    if version > 1:
        raise Mp4FormatError(f"box 'elst' has unknown version {version}")
    n = _count(data, box, pos)
    # media_rate_integer and media_rate_fraction together are one signed 16.16 fixed-point number.
    fmt = ">Qqi" if version == 1 else ">Iii"
    width = struct.calcsize(fmt)
    pos += 4
    if pos + n * width > box.end:
        raise Mp4FormatError(f"box 'elst' claims {n} entries but holds only {(box.end - pos) // width}")
    edits = []
    for i in range(n):
        duration, media_time, rate = struct.unpack_from(fmt, data, pos + i * width)
        edits.append(Edit(duration, media_time, rate / 65536))
    return edits
