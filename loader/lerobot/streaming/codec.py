"""Decoder set-up from a sidecar's ``stsd`` box: which FFmpeg decoder, and its extradata.

Packets are fed straight to a PyAV codec context (no container), so the decoder needs what a
demuxer would have given it: the codec configuration record (``avcC``/``hvcC``/``av1C``) that
sits inside the track's first sample entry. ``stsd`` is stored whole in the sidecar, so nothing
more is read from the MP4.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import av

from loader.lerobot.mp4 import boxes
from loader.lerobot.mp4.errors import Mp4FormatError

# Sample-entry 4cc -> (FFmpeg decoder, configuration box). libdav1d rather than FFmpeg's native
# "av1" decoder: the native one needs a hardware device and decodes nothing in software.
DECODERS: dict[str, tuple[str, str]] = {
    "av01": ("libdav1d", "av1C"),
    "avc1": ("h264", "avcC"),
    "avc3": ("h264", "avcC"),
    "hvc1": ("hevc", "hvcC"),
    "hev1": ("hevc", "hvcC"),
}
# SampleEntry (6 reserved + data_reference_index) + VisualSampleEntry fields: 8 + 70 bytes
# before the entry's child boxes.
_VISUAL_ENTRY_FIELDS = 78


class UnsupportedCodecError(ValueError):
    """The video's sample entry is not one this reader decodes (or its config box is missing)."""


def decoder_config(rel: str, stsd: bytes) -> tuple[str, str, bytes]:
    """(sample-entry 4cc, FFmpeg decoder name, extradata) for the ``stsd`` box of MP4 ``rel``.

    The extradata is the payload of the entry's configuration box (what FFmpeg's demuxer hands
    the decoder). Raises ``UnsupportedCodecError`` naming the file and the codec.
    """
    try:
        stsd_box = _top_box(stsd)
        _, _, pos = boxes.full_box(stsd, stsd_box)
        entries = list(boxes.children(stsd, pos + 4, stsd_box.end))
    except Mp4FormatError as e:
        raise UnsupportedCodecError(f"{rel}: the sidecar's 'stsd' box is unreadable ({e}); "
                                    "rebuild the sidecar") from e
    if not entries:
        raise UnsupportedCodecError(f"{rel}: the sidecar's 'stsd' box has no sample entry; rebuild the sidecar")
    entry = entries[0]
    known = DECODERS.get(entry.type)
    if known is None:
        raise UnsupportedCodecError(
            f"{rel}: video codec {entry.type!r} is not supported by the streaming reader (it decodes "
            f"{', '.join(sorted(DECODERS))}); re-encode the videos to AV1 (LeRobot's default, e.g. "
            "ffmpeg -c:v libsvtav1 -g 2) or H.264 (-c:v libx264), or use LeRobot's map-style dataset")
    decoder, config_type = known
    if decoder not in av.codecs_available:
        raise UnsupportedCodecError(f"{rel}: codec {entry.type!r} needs FFmpeg's {decoder!r} decoder, "
                                    "which this PyAV build lacks; install a PyAV wheel built with it")
    try:
        config = next((b for b in boxes.children(stsd, entry.body + _VISUAL_ENTRY_FIELDS, entry.end)
                       if b.type == config_type), None)
    except Mp4FormatError as e:
        raise UnsupportedCodecError(f"{rel}: sample entry {entry.type!r} is malformed ({e}); "
                                    "rebuild the sidecar or re-mux the video") from e
    if config is None:
        raise UnsupportedCodecError(f"{rel}: sample entry {entry.type!r} has no {config_type!r} box, so "
                                    "the decoder cannot be configured; re-mux the video (ffmpeg -c copy)")
    return entry.type, decoder, bytes(stsd[config.body:config.end])


def open_decoder(decoder: str, extradata: bytes) -> av.CodecContext:
    """A fresh single-threaded decoding context: parallelism comes from decoding several
    episodes at once on threads (PyAV releases the GIL while decoding)."""
    ctx = av.CodecContext.create(decoder, "r")
    ctx.extradata = extradata
    ctx.thread_count = 1
    return ctx


# Decoders whose flushed context decodes exactly as a fresh one (see SpareContexts).
REUSABLE = frozenset({"libdav1d"})


class SpareContexts:
    """Up to ``capacity`` flushed decoding contexts kept for reuse, newest first.

    A decoder lets its context go whenever it is drained at a closed-GOP start (``EpisodeVideo``),
    which with LeRobot's AV1 (a keyframe every 2 frames) is every other frame; opening a fresh
    libdav1d context and decoding its first frame costs about 1.4 ms more at 640x480 than
    decoding that frame on a flushed one (its frame pool and tile buffers are allocated again).
    A flushed libdav1d context is as good as a fresh one (``dav1d_flush`` drops every reference
    picture, the sequence header and the stream state) and keeps its allocations, so a few
    spares serve the decoders that resume; more would only hold memory (about 1.5 MB each at
    640x480). Only libdav1d's are kept: FFmpeg's H.264 and HEVC decoders keep the parameter sets
    they saw in-band across a flush, which a fresh context (only the extradata's) would not have.

    ``take`` gives a spare opened with the same decoder and extradata, else a new context;
    ``give`` flushes a context and keeps it, or drops it when ``capacity`` are kept.
    Thread-safe. One per process: a forked child starts with none (its parent's are not its own).
    """

    def __init__(self, capacity: int = 4):
        if capacity < 0:
            raise ValueError(f"spare context capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._spares: deque[tuple[str, bytes, av.CodecContext]] = deque()
        self._lock = threading.Lock()
        self.reused = 0
        self.opened = 0

    def take(self, decoder: str, extradata: bytes) -> av.CodecContext:
        with self._lock:
            for i, (name, extra, ctx) in enumerate(self._spares):
                if name == decoder and extra == extradata:
                    del self._spares[i]
                    self.reused += 1
                    return ctx
            self.opened += 1
        return open_decoder(decoder, extradata)

    def give(self, decoder: str, extradata: bytes, ctx: av.CodecContext) -> None:
        if not self.capacity or decoder not in REUSABLE:
            return
        ctx.flush_buffers()          # its reference pictures go; its buffers stay for reuse
        with self._lock:
            self._spares.appendleft((decoder, extradata, ctx))
            while len(self._spares) > self.capacity:
                self._spares.pop()   # the oldest: the others were used more recently

    def clear(self) -> None:
        with self._lock:
            self._spares.clear()

    def __len__(self) -> int:
        return len(self._spares)


SPARE_CONTEXTS = SpareContexts()
if hasattr(os, "register_at_fork"):
    # A DataLoader worker forked from a process that decoded must not share its contexts.
    os.register_at_fork(after_in_child=lambda: SPARE_CONTEXTS.__init__(SPARE_CONTEXTS.capacity))


def _top_box(data: bytes) -> boxes.Box:
    box_type, size, header = boxes.parse_header(data, 0, len(data))
    if box_type != "stsd" or size is None or size > len(data):
        raise Mp4FormatError(f"expected an 'stsd' box of {len(data)} bytes, found {box_type!r} of size {size}")
    return boxes.Box(box_type, 0, size, header)
