"""``index_mp4``: the video track's sample table from ``ftyp`` + ``moov``, by range reads only.

The top level of the file is walked box header by box header (8 bytes each, 16 for a 64-bit
size); ``ftyp`` and ``moov`` are read whole and everything else (``mdat`` above all) is skipped
by its size, so ``moov`` is found before or after the media data at the same small cost. The
only media bytes ever read are the last byte of each skipped box: reading from one byte before
the next header proves the box is really there (a file cut short inside ``mdat`` would otherwise
look like one that ends cleanly).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from loader.io import StreamConfig, open_url, urls
from loader.io.opener import source_for
from loader.io.source import redact_url

from . import boxes
from .boxes import Box, Edit
from .errors import EditListError, Mp4FormatError

_KEPT = ("ftyp", "moov")
_FRAGMENTED = ("moof", "mfra", "sidx")  # top-level boxes of fragmented files (media in moof/mdat pairs)


@dataclass(frozen=True, eq=False)
class Mp4Index:
    """The video track of one MP4 file, per sample in decode order (all int64 but ``sample_pts``).

    ``sample_pts``: presentation time in seconds (float64), i.e.
    ``(dts + composition_offset - edit.media_time) / timescale + edit.empty_duration / movie_timescale``
    — the time a demuxer that honours the edit list (FFmpeg, PyAV) gives the decoded frame
    (FFmpeg rounds an empty edit to whole media ticks first: up to half a tick apart when the
    empty edit is not a whole number of media ticks).
    ``mdat``: (offset, size) of every top-level ``mdat`` box, header included.
    ``edit``: ``{"empty_duration": movie ticks, "media_time": media ticks}`` or None (no edit list).
    ``edit=None`` also for an ``elst`` with no entries (it maps nothing either).
    ``bytes_read``: bytes the ``requests`` range reads returned (what was asked, short only at
    the end of the file).
    """

    sample_pts: np.ndarray
    sample_durations: np.ndarray
    sample_composition_offsets: np.ndarray
    sample_sizes: np.ndarray
    sample_offsets: np.ndarray
    sync_samples: np.ndarray
    timescale: int
    track_id: int
    ftyp: bytes
    stsd: bytes
    codec: str
    width: int
    height: int
    mdat: list[tuple[int, int]]
    edit: dict[str, int] | None
    file_size: int
    bytes_read: int
    # Beyond the shared interface:
    source: str                 # the source with credentials redacted, for messages
    movie_timescale: int
    moov: tuple[int, int]       # (offset, size) of the moov box
    requests: int

    @property
    def num_samples(self) -> int:
        return len(self.sample_sizes)

    @property
    def sample_dts(self) -> np.ndarray:
        """Decode timestamps in media ticks (0 for the first sample, as stored)."""
        dts = np.zeros(self.num_samples, dtype=np.int64)
        np.cumsum(self.sample_durations[:-1], out=dts[1:])
        return dts


def index_mp4(source: str | os.PathLike[str], *, stream_config: StreamConfig | None = None) -> Mp4Index:
    """Index the (first) video track of the MP4 at ``source`` (a local path or any URL ``open_url``
    takes) from its boxes. Raises ``Mp4FormatError`` / ``EditListError`` naming the file,
    ``FileNotFoundError`` when it is missing."""
    reader = _RangeReader(os.fspath(source), stream_config)
    try:
        return _index(reader)
    except EditListError:
        raise
    except Mp4FormatError as e:
        raise type(e)(f"{reader.name}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Reading


class _RangeReader:
    def __init__(self, source: str, config: StreamConfig | None):
        self.source = source
        self.config = config
        self.name = redact_url(source) if urls.has_scheme(source) else source
        self.bytes_read = 0
        self.requests = 0

    def read(self, start: int, length: int | None) -> bytes:
        """Up to ``length`` bytes from ``start`` (None: to the end); short only at the end of the file."""
        with open_url(self.source, start=start, length=length, config=self.config) as f:
            data = f.read() if length is None else f.read(length)
        self.requests += 1
        self.bytes_read += len(data)
        return data

    def size(self) -> int:
        """The object's size; needed only for a box whose size field says "to the end of the file"."""
        scheme = urls.scheme(self.source)
        if scheme in ("", "file"):
            return os.path.getsize(urls.local_path(self.source))
        opened = source_for(self.source, scheme, self.config or StreamConfig()).open(0, 1, None)
        self.requests += 1
        if opened is None:
            return 0
        opened.body.close()
        if opened.size is None:
            raise Mp4FormatError("a box runs to the end of the file but the server does not say the file size")
        return opened.size


@dataclass
class _TopLevel:
    ftyp: bytes | None = None
    moov: bytes | None = None
    moov_at: int = 0
    mdat: list[tuple[int, int, int]] | None = None   # (offset, size, header length)
    file_size: int = 0


def _walk(reader: _RangeReader) -> _TopLevel:
    top = _TopLevel(mdat=[])
    pos = 0
    head = reader.read(0, boxes.HEADER)
    if not head:
        raise Mp4FormatError("the file is empty")
    while True:
        if len(head) < boxes.HEADER:
            raise Mp4FormatError(f"{len(head)} stray bytes at {pos} after the last box")
        if struct.unpack_from(">I", head)[0] == 1:  # 64-bit size follows the type
            head += reader.read(pos + boxes.HEADER, boxes.LARGE_HEADER - boxes.HEADER)
        box_type, size, header = boxes.parse_header(head, 0, None)
        if not _plausible(box_type):
            what = "not an MP4 file" if pos == 0 else "garbage where a box should start"
            raise Mp4FormatError(f"{what}: box type {box_type!r} at byte {pos}")
        if pos == 0 and box_type != "ftyp":
            raise Mp4FormatError(f"not an MP4 file: it starts with a {box_type!r} box, not 'ftyp'")
        if box_type in _FRAGMENTED:
            raise Mp4FormatError(f"fragmented MP4 ({box_type!r} box at {pos}) is not supported; "
                                 "re-mux it as a regular MP4 (e.g. ffmpeg -i in.mp4 -c copy out.mp4)")
        to_end = size is None
        if to_end:
            size = reader.size() - pos
            if size < header:
                raise Mp4FormatError(f"box {box_type!r} at {pos} runs to the end of a file too short for it")
        end = pos + size
        if box_type in _KEPT:
            # Read the box and the next header in one request.
            data = reader.read(pos, size + (0 if to_end else boxes.HEADER))
            if len(data) < size:
                raise Mp4FormatError(f"box {box_type!r} at {pos} has size {size} but the file ends at {pos + len(data)}")
            if box_type == "moov":
                if top.moov is not None:
                    raise Mp4FormatError(f"a second 'moov' box at {pos}")
                top.moov, top.moov_at = data[:size], pos
            elif top.ftyp is None:
                top.ftyp = data[:size]
            following = data[size:]
        else:
            if box_type == "mdat":
                top.mdat.append((pos, size, header))
            following = b"" if to_end else reader.read(end - 1, 1 + boxes.HEADER)
            if not to_end and not following:
                raise Mp4FormatError(f"box {box_type!r} at {pos} has size {size} but the file ends before byte {end}")
            following = following[1:]
        pos = end
        if not following:
            top.file_size = end
            return top
        head = following


def _plausible(box_type: str) -> bool:
    # Real box types are four printable characters (QuickTime's '©xyz' uses latin-1 0xA9).
    return all(c == "\xa9" or " " <= c <= "~" for c in box_type)


# ---------------------------------------------------------------------------------------------
# Parsing moov


def _index(reader: _RangeReader) -> Mp4Index:
    top = _walk(reader)
    if top.ftyp is None:
        raise Mp4FormatError("no 'ftyp' box")
    if top.moov is None:
        raise Mp4FormatError("no 'moov' box (an unfinished recording, or a fragmented file)")
    data = top.moov
    _, moov_size, header = boxes.parse_header(data, 0, len(data))
    moov = Box("moov", 0, len(data), header)
    if boxes.child(data, moov, "mvex", required=False) is not None:
        raise Mp4FormatError("fragmented MP4 ('mvex' in 'moov') is not supported; re-mux it as a regular MP4")
    movie_timescale = boxes.parse_mvhd(data, boxes.child(data, moov, "mvhd"))

    trak, mdia = _video_track(data, moov)
    track_id, display_w, display_h = boxes.parse_tkhd(data, boxes.child(data, trak, "tkhd"))
    timescale, _ = boxes.parse_mdhd(data, boxes.child(data, mdia, "mdhd"))
    stbl = boxes.child(data, boxes.child(data, mdia, "minf"), "stbl")
    found = {b.type: b for b in reversed(list(boxes.children(data, stbl.body, stbl.end)))}

    stsd = found.get("stsd") or boxes.child(data, stbl, "stsd")
    codec, coded_w, coded_h = boxes.parse_stsd(data, stsd)
    size_box = found.get("stsz") or found.get("stz2")
    if size_box is None:
        raise Mp4FormatError("box 'stbl' has no 'stsz' (or 'stz2') box")
    sizes = boxes.parse_stsz(data, size_box)
    n = len(sizes)

    durations = boxes.parse_stts(data, found.get("stts") or boxes.child(data, stbl, "stts"))
    if len(durations) != n:
        raise Mp4FormatError(f"'stts' describes {len(durations)} samples, 'stsz' {n}")
    if "ctts" in found:
        offsets_ct = boxes.parse_ctts(data, found["ctts"])
        if len(offsets_ct) != n:
            raise Mp4FormatError(f"'ctts' describes {len(offsets_ct)} samples, 'stsz' {n}")
    else:
        offsets_ct = np.zeros(n, dtype=np.int64)
    chunk_box = found.get("stco") or found.get("co64")
    if chunk_box is None:
        raise Mp4FormatError("box 'stbl' has no 'stco' (or 'co64') box")
    sample_offsets = _sample_offsets(boxes.parse_stsc(data, found.get("stsc") or boxes.child(data, stbl, "stsc")),
                                     boxes.parse_chunk_offsets(data, chunk_box), sizes)
    if "stss" in found:
        sync = boxes.parse_stss(data, found["stss"])
        if len(sync) and (sync[0] < 0 or sync[-1] >= n or np.any(np.diff(sync) <= 0)):
            raise Mp4FormatError(f"'stss' lists sample numbers outside 1..{n} or out of order")
    else:
        sync = np.arange(n, dtype=np.int64)  # no stss: every sample is a sync sample
    _check_in_mdat(sample_offsets, sizes, top.mdat)

    edts = boxes.child(data, trak, "edts", required=False)
    elst = boxes.child(data, edts, "elst", required=False) if edts is not None else None
    edits = boxes.parse_elst(data, elst) if elst is not None else []
    # An elst with no entries maps nothing, exactly like having no edit list.
    edit = _accept_edits(reader.name, edits) if edits else None

    dts = np.zeros(n, dtype=np.int64)
    np.cumsum(durations[:-1], out=dts[1:])
    media_time = edit["media_time"] if edit else 0
    pts = (dts + offsets_ct - media_time) / timescale
    if edit and edit["empty_duration"]:
        pts = pts + edit["empty_duration"] / movie_timescale

    return Mp4Index(
        sample_pts=pts, sample_durations=durations, sample_composition_offsets=offsets_ct,
        sample_sizes=sizes, sample_offsets=sample_offsets, sync_samples=sync,
        timescale=timescale, track_id=track_id, ftyp=bytes(top.ftyp),
        stsd=bytes(data[stsd.start:stsd.end]), codec=codec,
        width=coded_w or display_w, height=coded_h or display_h,
        mdat=[(off, size) for off, size, _ in top.mdat], edit=edit, file_size=top.file_size,
        bytes_read=reader.bytes_read, source=reader.name, movie_timescale=movie_timescale,
        moov=(top.moov_at, moov_size), requests=reader.requests,
    )


def _video_track(data: bytes, moov: Box) -> tuple[Box, Box]:
    handlers = []
    for trak in boxes.children(data, moov.body, moov.end):
        if trak.type != "trak":
            continue
        mdia = boxes.child(data, trak, "mdia")
        handler = boxes.parse_hdlr(data, boxes.child(data, mdia, "hdlr"))
        if handler == "vide":
            return trak, mdia
        handlers.append(handler)
    raise Mp4FormatError(f"no video track (track handlers: {handlers or 'none'})")


def _sample_offsets(stsc: np.ndarray, chunk_offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Absolute byte offset of every sample: chunks hold consecutive samples back to back."""
    n, n_chunks = len(sizes), len(chunk_offsets)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if len(stsc) == 0:
        raise Mp4FormatError(f"'stsc' is empty but there are {n} samples")
    first = stsc[:, 0]
    if first[0] != 1 or np.any(np.diff(first) <= 0) or first[-1] > n_chunks:
        raise Mp4FormatError(f"'stsc' first-chunk numbers {first.tolist()[:8]} are not increasing "
                             f"from 1 within the {n_chunks} chunks")
    # Run i of stsc covers chunks [first[i], first[i+1]) with stsc[i, 1] samples each.
    runs = np.diff(np.append(first, n_chunks + 1))
    per_chunk = np.repeat(stsc[:, 1], runs)
    if per_chunk.sum() != n:
        raise Mp4FormatError(f"'stsc' places {int(per_chunk.sum())} samples in {n_chunks} chunks, 'stsz' has {n}")
    chunk_of = np.repeat(np.arange(n_chunks), per_chunk)
    before = np.cumsum(sizes) - sizes                 # bytes of all earlier samples
    chunk_first = np.cumsum(per_chunk) - per_chunk    # first sample of each chunk
    return chunk_offsets[chunk_of] + before - before[chunk_first[chunk_of]]


def _check_in_mdat(offsets: np.ndarray, sizes: np.ndarray, mdat: list[tuple[int, int, int]]) -> None:
    """Every sample must lie inside one mdat payload (else the tables do not match the file)."""
    if not len(offsets):
        return
    spans = sorted((off + header, off + size) for off, size, header in mdat)
    if not spans:
        raise Mp4FormatError("no 'mdat' box, but the track has samples")
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    which = np.searchsorted(starts, offsets, side="right") - 1
    bad = (which < 0) | (offsets + sizes > ends[np.maximum(which, 0)])
    if bad.any():
        i = int(np.argmax(bad))
        raise Mp4FormatError(f"sample {i} (bytes {int(offsets[i])}..{int(offsets[i] + sizes[i])}) "
                             "is not inside an 'mdat' box")


def _accept_edits(name: str, edits: list[Edit]) -> dict[str, int]:
    """One rate-1 media edit, optionally after one empty edit; anything else is refused, because
    mapping presentation times through it would silently misalign frames."""
    media = edits[-1] if edits else None
    ok = (media is not None and not media.empty and media.rate == 1 and media.media_time >= 0
          and (len(edits) == 1 or (len(edits) == 2 and edits[0].empty)))
    if not ok:
        found = "; ".join(e.describe() for e in edits) or "none"
        raise EditListError(
            f"{name}: the video track's edit list has {len(edits)} edit{'s' if len(edits) != 1 else ''} ({found}): only one rate-1 "
            "media edit, optionally after one empty edit, is supported; re-mux the file without edit "
            "lists (e.g. ffmpeg -i in.mp4 -c copy -use_editlist 0 out.mp4) or re-encode it")
    empty = edits[0].segment_duration if len(edits) == 2 else 0
    return {"empty_duration": int(empty), "media_time": int(media.media_time)}
