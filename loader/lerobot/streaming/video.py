"""Video of one (episode, camera): which MP4 bytes to fetch, and frames decoded from only those.

``plan_video_span`` is a pure function of the sidecar arrays: it maps the episode's frames to
samples (nearest presentation time, within the tolerance, as LeRobot's ``decode_video_frames``)
and the samples to one contiguous byte range of the MP4, from the sync sample at or before the
first needed frame. ``EpisodeVideo`` decodes frames from that byte range by feeding packets
straight to a PyAV codec context. Packets rather than a synthesized mini-MP4: the sidecar
already holds every sample's offset, size and timing, so a packet is a slice of the fetched
bytes and no container is written, parsed or seeked (and no edit list needs rewriting).
``DecoderCache`` (in ``decoder_cache``, re-exported here) keeps the open decoders of recently
used episodes; an open decoder between its episode's turns holds no codec context when a fresh
one could carry on (``EpisodeVideo._release_if_clean``).
"""

from __future__ import annotations

import bisect
import fractions
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from .codec import SPARE_CONTEXTS, UnsupportedCodecError, decoder_config
from .decoder_cache import DecoderCache

if TYPE_CHECKING:
    from loader.lerobot.sidecar.schema import SidecarFile

log = logging.getLogger(__name__)

__all__ = ["DecoderCache", "EpisodeVideo", "frames_held", "UnsupportedCodecError", "VideoDecodeError",
           "Frames", "RgbPlanes", "VideoFrameError", "VideoSpan", "frames_array", "frames_shape", "plan_video_span",
           "rgb_planes", "write_frames"]


class VideoFrameError(ValueError):
    """No video frame within ``tolerance_s`` of a requested time (or outside the fetched span).

    ``rel``, ``time``, ``nearest`` (the closest sample time, None when there is none) and
    ``tolerance_s`` are kept as attributes; the message names them and the fix.
    """

    def __init__(self, message: str, *, rel: str, time: float | None = None,
                 nearest: float | None = None, tolerance_s: float | None = None):
        super().__init__(message)
        self.rel, self.time, self.nearest, self.tolerance_s = rel, time, nearest, tolerance_s


class VideoDecodeError(RuntimeError):
    """The decoder failed on, or produced no frame for, a sample of the fetched span."""


@dataclass(frozen=True)
class VideoSpan:
    """The decode-order samples ``[first_sample, end_sample)`` of MP4 ``rel`` that one episode
    needs, held in the bytes ``[byte_start, byte_end)`` of the file."""

    rel: str                     # MP4 path relative to the dataset root
    first_sample: int            # decode-order index of the sync sample the fetch starts at
    end_sample: int              # one past the last decode-order sample fetched
    byte_start: int              # absolute offset in the MP4 of the first fetched byte
    byte_end: int                # exclusive
    frame_samples: np.ndarray    # int64, decode-order sample index of episode frame k

    @property
    def nbytes(self) -> int:
        """Exactly what will be fetched and held."""
        return self.byte_end - self.byte_start


def plan_video_span(rel: str, arrays: Mapping[str, np.ndarray], *, from_timestamp: float, length: int,
                    fps: int, tolerance_s: float) -> VideoSpan:
    """The span of MP4 ``rel`` holding frames ``from_timestamp + k / fps`` (k < ``length``).

    Each frame's sample is the one whose ``sample_pts`` is nearest; it must be closer than
    ``tolerance_s`` (LeRobot's strict ``<``), else ``VideoFrameError``. The span starts at the
    last sync sample at or before the earliest needed sample in decode order whose presentation
    time is not after any needed frame's (so an open GOP's leading pictures keep their
    references). It ends after the last needed sample or, when presentation order differs from
    decode order anywhere in the span's GOPs (B-frames), at the end of the last needed GOP, so
    every needed frame decodes and decoded frames stay contiguous. Pure: no I/O.
    """
    if length < 1:
        raise ValueError(f"{rel}: an episode needs at least one frame, got length={length}")
    if fps <= 0 or tolerance_s <= 0:
        raise ValueError(f"{rel}: fps and tolerance_s must be positive, got fps={fps}, tolerance_s={tolerance_s}")
    pts = np.asarray(arrays["sample_pts"], dtype=np.float64)
    sync = np.asarray(arrays["sync_samples"]).astype(np.int64)
    n = len(pts)
    times = float(from_timestamp) + np.arange(length, dtype=np.float64) / fps
    samples = _nearest_samples(rel, pts, np.arange(n, dtype=np.int64), times, tolerance_s, "file")

    first_needed, last_needed = int(samples.min()), int(samples.max())
    i = int(np.searchsorted(sync, first_needed, side="right")) - 1
    earliest = float(pts[samples].min())
    while i > 0 and pts[sync[i]] > earliest:
        i -= 1
    if i < 0 or pts[sync[i]] > earliest:
        raise VideoFrameError(
            f"{rel}: no sync sample (keyframe) at or before sample {first_needed} (t={pts[first_needed]:.6f}s), "
            "so the episode's first frame cannot be decoded; re-encode the video with a keyframe "
            "at each episode start, then rebuild the sidecar", rel=rel, time=float(times[0]))
    first = int(sync[i])
    j = int(np.searchsorted(sync, last_needed, side="right"))
    gop_end = int(sync[j]) if j < len(sync) else n
    reorders = bool(np.any(np.diff(pts[first:gop_end]) < 0))
    end = gop_end if reorders else last_needed + 1

    offsets = np.asarray(arrays["sample_offsets"][first:end]).astype(np.int64)
    sizes = np.asarray(arrays["sample_sizes"][first:end]).astype(np.int64)
    return VideoSpan(rel=rel, first_sample=first, end_sample=end, byte_start=int(offsets.min()),
                     byte_end=int((offsets + sizes).max()), frame_samples=samples)


def _nearest_samples(rel: str, pts: np.ndarray, ids: np.ndarray, times: np.ndarray, tolerance_s: float,
                     scope: str) -> np.ndarray:
    """Index (from ``ids``) of the sample nearest each time; VideoFrameError past the tolerance.

    Only samples within ``tolerance_s`` of the asked range can qualify, so those few are sorted
    (the file's samples are in decode order, not presentation order).
    """
    lo, hi = float(times.min()) - tolerance_s, float(times.max()) + tolerance_s
    near = np.flatnonzero((pts > lo) & (pts < hi))
    if len(near):
        cand = near[np.argsort(pts[near], kind="stable")]
        cand_pts = pts[cand]
        right = np.clip(np.searchsorted(cand_pts, times), 0, len(cand) - 1)
        left = np.maximum(right - 1, 0)
        pick = np.where(np.abs(cand_pts[left] - times) <= np.abs(cand_pts[right] - times), left, right)
        dist = np.abs(cand_pts[pick] - times)
        bad = np.flatnonzero(dist >= tolerance_s)
        if not len(bad):
            return ids[cand[pick]]
        k = int(bad[0])
    else:
        k = 0
    t = float(times[k])
    nearest = float(pts[np.argmin(np.abs(pts - t))]) if len(pts) else None
    where = "in the file" if scope == "file" else "in the fetched span of this episode"
    shown = "none" if nearest is None else f"{nearest:.6f}s ({abs(nearest - t):.6f}s away)"
    raise VideoFrameError(
        f"{rel}: no video frame {where} within tolerance_s={tolerance_s} of t={t:.6f}s; the nearest "
        f"sample is at {shown}. The episode's from_timestamp/fps in meta/ do not match this video "
        "(a synchronization problem when the data was recorded, or a re-encoded video): fix the "
        "metadata or the video, leave this episode out (episodes=), or raise tolerance_s",
        rel=rel, time=t, nearest=nearest, tolerance_s=tolerance_s)


def frames_held(reach: int, decode_threads: int) -> tuple[int, int]:
    """(``keep_frames``, ``pending_frames``) of a worker's decoders: ``reach`` is the furthest a
    camera window reaches from its frame (0 without camera deltas).

    Pending (decoded, not yet asked for) YUV frames cover the decode threads asking for
    neighbouring frames of one episode out of order, within the windows. Kept (handed-out) RGB
    frames serve the overlap of neighbouring windows, asked out of order by the decode threads.
    Without windows no frame is asked twice but a padding repeat (a few per epoch, decoded
    again), so none is kept: every open decoder holds its kept frames, at 640x480 an RGB frame
    is 0.9 MB, and a worker has up to pool x cameras decoders open (64 by default), so the
    ``decode_threads + 1`` frames once kept without windows held 170 MB that no request read.
    """
    pending = 2 * reach + decode_threads + 1
    return (pending if reach else 0), pending


def _clean_starts(sync: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Per span sample (decode order): True where a fresh decoder may start and decode every
    later sample as one that fed all the earlier ones: a sync sample that no later sample of
    its GOP precedes in presentation (a closed GOP: no leading picture referencing the GOP
    before). ``sync``: the span's sync samples, relative to the span start."""
    clean = np.zeros(len(pts), dtype=bool)
    if len(sync):
        # min over [sync[k], sync[k + 1]) (the last: to the span's end), for every k at once
        clean[sync] = np.minimum.reduceat(pts, sync) >= pts[sync]
    return clean


_local = threading.local()


def _reformatter() -> VideoReformatter:
    """This thread's YUV->RGB converter. frame.to_ndarray() builds a new swscale context (with
    its own thread pool) per frame, which cost several times the decode itself; one per open
    decoder held 0.3 MB each (64 decoders per worker by default). One per thread, shared by
    every span it converts (it rebuilds its context only when the frame size or format
    changes), single-threaded: parallelism comes from episodes on threads."""
    fmt = getattr(_local, "reformatter", None)
    if fmt is None:
        fmt = _local.reformatter = VideoReformatter()
    return fmt


# Per process: whether swscale's planar RGB (gbrp) of a kind of frame is exactly its packed
# rgb24 (see rgb_planes), by (pixel format, width, height, colorspace, color range).
_PLANAR_EXACT: dict[tuple, bool] = {}
_GBRP_RGB = (2, 0, 1)     # gbrp's plane holding R, G and B
_CHECK_FRAMES = 128       # at most this many synthetic frames per check


RgbPlanes = tuple[np.ndarray, np.ndarray, np.ndarray]  # (R, G, B): read-only (H, W) uint8 planes of a frame


def rgb_planes(frame: av.VideoFrame) -> RgbPlanes:
    """A decoded frame's RGB as three read-only (H, W) uint8 planes (R, G, B: the layout of
    LeRobot's (C, H, W) items), with exactly the values of swscale's packed ``rgb24``
    conversion (what LeRobot's decoders and ``frame.to_ndarray(format="rgb24")`` give).

    Converted to planar ``gbrp`` (no transpose: a 640x480 frame then becomes float32 (C, H, W)
    in 0.4 ms instead of 1.1) where that is exact for this kind of frame, else to ``rgb24`` and
    transposed. Whether it is exact depends on swscale's code paths, which differ with the
    width (at 102x70 gbrp differs from rgb24 in every frame; at 320x240 and 640x480 it equals
    it): checked once per process and kind of frame (``_planar_is_exact``). The gbrp planes are
    views of the converted frame, not copied: they are read once, into the batch (a copy into a
    fresh (3, H, W) array cost ~3% of a 320x240 frame's CPU in a 2-worker run)."""
    fmt = _reformatter()
    if _planar_is_exact(frame):
        planes = fmt.reformat(frame, format="gbrp", threads=1).planes
        out = tuple(_plane_array(planes[p]) for p in _GBRP_RGB)
    else:
        rgb = fmt.reformat(frame, format="rgb24", threads=1).to_ndarray()
        packed = np.ascontiguousarray(rgb.transpose(2, 0, 1))
        out = (packed[0], packed[1], packed[2])
    for plane in out:
        plane.flags.writeable = False
    return out


Frames = np.ndarray | Sequence[Sequence[np.ndarray]]
"""Decoded frames: a (T, C, H, W) uint8 array, or T frames of C (H, W) uint8 planes each
(``EpisodeVideo.rgb_at``: views of the decoder's converted frames)."""


def frames_shape(frames: Frames) -> tuple[int, ...]:
    """(T, C, H, W) of ``frames``."""
    if isinstance(frames, np.ndarray):
        return frames.shape
    return (len(frames), len(frames[0]), *frames[0][0].shape)


def write_frames(out: np.ndarray, frames: Frames) -> None:
    """Write decoded ``frames`` into ``out``, (T, C, H, W) float32 or uint8, plane by plane (no
    intermediate tensors, no transpose: the decoder gives planes). numpy, single-threaded:
    float32(v) / 255 is correctly rounded, so it equals LeRobot's ``tensor.type(torch.float32)
    / 255`` for every v (a multiply by 1/255 would not); torch's intra-op threads would contend
    with the decode threads."""
    if isinstance(frames, np.ndarray):
        pairs = [(out, frames)]
    else:
        pairs = [(out[t, c], plane) for t, planes in enumerate(frames) for c, plane in enumerate(planes)]
    for target, source in pairs:
        if out.dtype == np.uint8:
            np.copyto(target, source)
        else:
            np.divide(source, np.float32(255), out=target, dtype=np.float32)


def frames_array(frames: Frames, dtype: type = np.uint8) -> np.ndarray:
    """Decoded frames as a new (T, C, H, W) array of ``dtype`` (float32: in [0, 1])."""
    out = np.empty(frames_shape(frames), dtype=dtype)
    write_frames(out, frames)
    return out


def _plane_array(plane: av.video.plane.VideoPlane) -> np.ndarray:
    """An 8-bit plane as an (height, width) view (rows may be padded to ``line_size``)."""
    rows = np.frombuffer(plane, dtype=np.uint8, count=plane.line_size * plane.height)
    return rows.reshape(plane.height, plane.line_size)[:, :plane.width]


def _planar_is_exact(frame: av.VideoFrame) -> bool:
    key = (frame.format.name, frame.width, frame.height, frame.colorspace, frame.color_range)
    exact = _PLANAR_EXACT.get(key)
    if exact is None:
        # Threads racing here each check and find the same answer.
        exact = _PLANAR_EXACT[key] = _check_planar(frame)
    return exact


def _check_planar(frame: av.VideoFrame) -> bool:
    """Whether gbrp equals rgb24 on ``frame`` and on synthetic frames of its kind (same format,
    size, colorspace and range) whose bytes cover, for an 8-bit 3-plane YUV format, every
    (U, V) pair with varying Y (frames as needed, at most ``_CHECK_FRAMES``). swscale's paths
    differ systematically (rounding, chroma handling, SIMD tails), not on rare values, so a
    difference shows on these; without one gbrp is used. Any error: not exact (rgb24 is always
    right)."""
    try:
        fmt = VideoReformatter()

        def same(f: av.VideoFrame) -> bool:
            rgb = fmt.reformat(f, format="rgb24", threads=1).to_ndarray()
            planes = fmt.reformat(f, format="gbrp", threads=1).planes
            return all(np.array_equal(_plane_array(planes[p]), rgb[..., c]) for c, p in enumerate(_GBRP_RGB))

        if not same(frame):
            return False
        sizes = [p.line_size * p.height for p in frame.planes]
        chroma = min(sizes[1:3]) if len(sizes) >= 3 else sizes[0]
        count = min(_CHECK_FRAMES, max(2, -(-65536 // max(1, chroma))))
        for k in range(count):
            synthetic = av.VideoFrame(frame.width, frame.height, frame.format.name)
            synthetic.colorspace, synthetic.color_range = frame.colorspace, frame.color_range
            for i, plane in enumerate(synthetic.planes):
                data = np.frombuffer(plane, dtype=np.uint8, count=plane.line_size * plane.height)
                idx = np.arange(len(data), dtype=np.int64) + k * len(data)
                data[:] = (idx >> 8 if i == 1 else idx if i == 2 else idx * 7 + k) & 255
            if not same(synthetic):
                return False
        return True
    except Exception:  # noqa: BLE001 - an unusual format or PyAV version: use the always-exact path
        log.debug("planar RGB check failed for %s %dx%d; using rgb24", frame.format.name, frame.width,
                  frame.height, exc_info=True)
        return False


class EpisodeVideo:
    """Decodes frames of one (episode, camera) from the fetched span bytes.

    Access pattern served: frames mostly in increasing order, plus windows reaching back (and
    sometimes forward) a few frames. A forward request keeps feeding packets to the open
    decoder, jumping to a new decoder at a later sync sample when one lies in between; frames
    that come out before they are asked for wait in ``pending`` (undecoded to RGB); the last
    ``keep_frames`` frames handed out stay in ``kept`` for windows; a request behind both
    restarts at the sync sample at or before it.

    Memory is bounded: ``kept`` holds at most ``keep_frames`` RGB frames (0: none) and ``pending`` at most
    ``pending_frames`` (default ``keep_frames``, at least 1) YUV frames (when full, the earliest in
    presentation order are dropped: they are behind the reader), plus the decoder's own reference pictures and the span bytes, which
    this object holds until ``close()``. The codec context (reference pictures, frame pool) is
    let go whenever a fresh one could carry on (``_release_if_clean``: drained at a closed-GOP
    start, or at the span's end) and taken again, from the process's flushed spares
    (``codec.SPARE_CONTEXTS``) where one fits, when a request needs decoding; ``releases``
    counts those, ``restarts`` only the times decoding started over at a sync sample. Frames handed out are read-only (shared with ``kept``).
    ``frame`` is thread-safe (one lock per object); decoders of different episodes run in
    parallel on threads.
    """

    def __init__(self, span: VideoSpan, file: SidecarFile, arrays: Mapping[str, np.ndarray],
                 payload: bytes | memoryview, *, tolerance_s: float, keep_frames: int = 8,
                 pending_frames: int | None = None):
        pending_frames = max(1, keep_frames) if pending_frames is None else pending_frames
        if keep_frames < 0 or pending_frames < 1:
            raise ValueError(f"keep_frames must be >= 0 and pending_frames >= 1, got {keep_frames} "
                             f"and {pending_frames}")
        if len(payload) != span.nbytes:
            raise ValueError(f"{span.rel}: got {len(payload)} payload bytes for a span of {span.nbytes} "
                             f"(bytes {span.byte_start}..{span.byte_end})")
        self.span, self.rel, self.tolerance_s, self.keep_frames = span, span.rel, tolerance_s, keep_frames
        self.pending_frames = pending_frames
        self.codec, self._decoder, self._extradata = decoder_config(span.rel, file.stsd)
        if file.codec != self.codec:
            raise UnsupportedCodecError(f"{span.rel}: the sidecar says codec {file.codec!r} but its "
                                        f"'stsd' holds {self.codec!r}; rebuild the sidecar")
        first, end = span.first_sample, span.end_sample
        self._first = first
        self._payload = memoryview(payload).cast("B")
        self._offsets = np.asarray(arrays["sample_offsets"][first:end]).astype(np.int64) - span.byte_start
        self._sizes = np.asarray(arrays["sample_sizes"][first:end]).astype(np.int64)
        # dts: the sum of all earlier durations (the first sample's dts is 0, as stored).
        durations = arrays["sample_durations"]
        self._dts = np.zeros(end - first, dtype=np.int64)
        self._dts[0] = int(np.sum(durations[:first], dtype=np.int64))
        np.cumsum(np.asarray(durations[first:end - 1]).astype(np.int64), out=self._dts[1:])
        self._dts[1:] += self._dts[0]
        self._pts_ticks = self._dts + np.asarray(arrays["sample_composition_offsets"][first:end]).astype(np.int64)
        # Decoded frames carry their packet's pts: that is how a frame finds its sample.
        self._sample_of_pts = {int(p): first + i for i, p in enumerate(self._pts_ticks)}
        if len(self._sample_of_pts) != end - first:
            raise VideoDecodeError(f"{span.rel}: two samples of the span share a presentation time, so "
                                   "decoded frames cannot be told apart; re-mux or re-encode the video")
        self._ids = np.arange(first, end, dtype=np.int64)
        self._pts = np.asarray(arrays["sample_pts"][first:end], dtype=np.float64)
        # The span in presentation order, once: a lookup per sample is then a binary search.
        by_time = np.argsort(self._pts, kind="stable")
        self._sorted_pts, self._sorted_ids = self._pts[by_time], self._ids[by_time]
        # The same as lists: one frame's lookup (a camera of an item) as a bisect, without the
        # dozen small numpy calls of the array path (about 1% of a 320x240 frame's CPU).
        self._sorted_pts_list, self._sorted_ids_list = self._sorted_pts.tolist(), self._sorted_ids.tolist()
        sync = np.asarray(arrays["sync_samples"]).astype(np.int64)
        self._sync = sync[(sync >= first) & (sync < end)]
        self._sync_list = self._sync.tolist()
        self._is_sync = np.zeros(end - first, dtype=bool)
        self._is_sync[self._sync - first] = True
        self._clean = _clean_starts(self._sync - first, self._pts)
        self._time_base = fractions.Fraction(1, file.timescale)

        self._lock = threading.Lock()
        self._ctx: av.CodecContext | None = None
        self._next = first               # next sample to feed
        self._flushed = False
        # No context, but everything before _next is out and _next starts a closed GOP: a fresh
        # context fed from _next decodes what the released one would have (_release_if_clean).
        self._parked = False
        self._outstanding: set[int] = set()   # fed, not yet out of the decoder
        self._pending: dict[int, av.VideoFrame] = {}
        self._kept: OrderedDict[int, RgbPlanes] = OrderedDict()
        self._closed = False
        self.decode_seconds = 0.0
        self.frames_decoded = 0
        self.restarts = 0
        self.releases = 0                # contexts let go of at a closed-GOP start (not restarts)

    # -- lookups ---------------------------------------------------------------------------------

    def sample_for_time(self, t: float) -> int:
        """The span's sample nearest ``t`` (seconds in the file); VideoFrameError past the tolerance."""
        return int(self._lookup(np.array([float(t)]))[0])

    def frames_at(self, times: Sequence[float]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB frames at ``times`` (seconds in the file)."""
        return np.stack([self.frame(s) for s in self._samples_at(times)])

    def planes_at(self, times: Sequence[float]) -> np.ndarray:
        """(T, 3, H, W) uint8 RGB frames at ``times`` (seconds in the file), as planes (the
        layout of LeRobot's items); a new array."""
        return frames_array(self.rgb_at(times))

    def rgb_at(self, times: Sequence[float]) -> list[RgbPlanes]:
        """The frames at ``times`` (seconds in the file) as RGB planes, not copied (what a
        batch is written from)."""
        return [self.rgb(s) for s in self._samples_at(times)]

    def _samples_at(self, times: Sequence[float]) -> list[int]:
        if len(times) == 1:
            one = self._nearest_one(float(times[0]))
            if one is not None:
                return [one]
        asked = np.asarray(times, dtype=np.float64).reshape(-1)
        if not len(asked):
            raise ValueError(f"{self.rel}: frames_at needs at least one time")
        return self._lookup(asked).tolist()

    def _nearest_one(self, t: float) -> int | None:
        """``_lookup`` of one time, None past the tolerance (the array path then names it)."""
        pts = self._sorted_pts_list
        if not pts:
            return None
        right = min(bisect.bisect_left(pts, t), len(pts) - 1)
        left = max(right - 1, 0)
        pick = left if abs(pts[left] - t) <= abs(pts[right] - t) else right
        return self._sorted_ids_list[pick] if abs(pts[pick] - t) < self.tolerance_s else None

    def _lookup(self, times: np.ndarray) -> np.ndarray:
        """Nearest span sample per time; past the tolerance, the full search names the problem."""
        pts = self._sorted_pts
        right = np.clip(np.searchsorted(pts, times), 0, len(pts) - 1)
        left = np.maximum(right - 1, 0)
        pick = np.where(np.abs(pts[left] - times) <= np.abs(pts[right] - times), left, right)
        if np.all(np.abs(pts[pick] - times) < self.tolerance_s):
            return self._sorted_ids[pick]
        return _nearest_samples(self.rel, self._pts, self._ids, times, self.tolerance_s, "span")

    def frame(self, sample: int) -> np.ndarray:
        """The (H, W, 3) uint8 RGB frame of decode-order ``sample`` (a new array)."""
        return np.stack(self.rgb(sample), axis=-1)

    def planes(self, sample: int) -> np.ndarray:
        """The (3, H, W) uint8 RGB frame of decode-order ``sample`` (a new array)."""
        return np.stack(self.rgb(sample))

    def rgb(self, sample: int) -> RgbPlanes:
        """The RGB planes of decode-order ``sample`` (read-only, shared with later requests)."""
        sample = int(sample)
        if not self._first <= sample < self.span.end_sample:
            raise VideoFrameError(f"{self.rel}: sample {sample} is outside the fetched span "
                                  f"[{self._first}, {self.span.end_sample}); plan the span from the "
                                  "frames the episode needs (plan_video_span)", rel=self.rel)
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.rel}: this EpisodeVideo is closed (evicted from the decoder cache?)")
            rgb = self._kept.get(sample)
            if rgb is None:
                frame = self._pending.pop(sample, None)
                if frame is None:
                    frame = self._decode_to(sample)
                    self._release_if_clean()
                started = time.perf_counter()
                rgb = rgb_planes(frame)
                self.decode_seconds += time.perf_counter() - started
                if self.keep_frames:
                    self._kept[sample] = rgb
                    while len(self._kept) > self.keep_frames:
                        self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(sample)
            return rgb

    # -- decoding --------------------------------------------------------------------------------

    def _decode_to(self, sample: int) -> av.VideoFrame:
        start = self._restart_point(sample)
        if start is not None:
            self._restart(start)
        elif self._ctx is None:      # parked: carry on from _next with a fresh context
            self._ctx = SPARE_CONTEXTS.take(self._decoder, self._extradata)
            self._parked = False
        while True:
            if self._next < self.span.end_sample:
                frames = self._feed(self._next)
                self._next += 1
            elif not self._flushed:
                frames = self._run(None, self._next - 1)
                self._flushed = True
            else:
                raise VideoDecodeError(f"{self.rel}: the decoder produced no frame for sample {sample} "
                                       f"(span samples {self._first}..{self.span.end_sample - 1}); the "
                                       "video or its sidecar is damaged: rebuild the sidecar, check the file")
            wanted = None
            for s, f in frames:
                if s == sample:
                    wanted = f
                else:
                    self._pending[s] = f
            self._trim_pending()
            if wanted is not None:
                return wanted

    def _restart_point(self, sample: int) -> int | None:
        """The sync sample to open a new decoder at, or None to keep feeding the open one."""
        i = bisect.bisect_right(self._sync_list, sample) - 1
        target = self._pts[sample - self._first]
        while i > 0 and self._pts[self._sync[i] - self._first] > target:
            i -= 1   # open-GOP leading picture: it references the GOP before
        sync = self._sync_list[max(i, 0)]
        if self._parked:
            # Feeding on from _next needs no earlier packet; a sample whose references lie before
            # it (sync < _next) needs a real restart.
            return None if sample >= self._next and sync == self._next else sync
        if self._ctx is None:
            return sync
        if sample in self._outstanding or (sample >= self._next and not self._flushed):
            # Reachable by feeding on; a sync sample in between makes the packets before it useless.
            return sync if sync > self._next else None
        return sync

    def _restart(self, sync: int) -> None:
        self._drop_context()
        self._ctx = SPARE_CONTEXTS.take(self._decoder, self._extradata)
        self._next, self._flushed, self._parked = sync, False, False
        self._outstanding.clear()
        self.restarts += 1

    def _release_if_clean(self) -> None:
        """Let the codec context go when keeping it buys nothing: every packet fed has come out
        (nothing ``outstanding``) and the next packet starts a closed GOP, so a fresh context fed
        from there decodes the same frames; or the whole span is fed and out, so any later
        request restarts anyway. An idle context holds its reference pictures and frame pool
        (libdav1d at 640x480: about 1.5 MB), and a worker keeps up to pool x cameras decoders
        open between their episodes' turns."""
        if self._ctx is None or self._outstanding:
            return
        if self._next >= self.span.end_sample:
            parked = False      # nothing left to feed: a later request restarts
        elif not self._flushed and self._clean[self._next - self._first]:
            parked = True
        else:
            return
        self._drop_context()
        self._parked = parked
        self.releases += 1

    def _drop_context(self) -> None:
        """The context (if any) to the process's spares (``codec.SpareContexts``), flushed."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            SPARE_CONTEXTS.give(self._decoder, self._extradata, ctx)

    def _feed(self, sample: int) -> list[tuple[int, av.VideoFrame]]:
        i = sample - self._first
        off, size = int(self._offsets[i]), int(self._sizes[i])
        packet = av.Packet(self._payload[off:off + size])
        packet.dts = int(self._dts[i])
        packet.pts = int(self._pts_ticks[i])
        packet.time_base = self._time_base
        packet.is_keyframe = bool(self._is_sync[i])
        self._outstanding.add(sample)
        return self._run(packet, sample)

    def _run(self, packet: av.Packet | None, sample: int) -> list[tuple[int, av.VideoFrame]]:
        assert self._ctx is not None
        started = time.perf_counter()
        try:
            frames = self._ctx.decode(packet)
        except av.error.FFmpegError as e:
            raise VideoDecodeError(f"{self.rel}: decoding sample {sample} failed ({e}); the fetched bytes "
                                   "do not match the sidecar (file changed? rebuild the sidecar)") from e
        finally:
            self.decode_seconds += time.perf_counter() - started
        out = []
        for f in frames:
            s = self._sample_of_pts.get(f.pts) if f.pts is not None else None
            if s is None:
                raise VideoDecodeError(f"{self.rel}: the decoder returned a frame with pts {f.pts}, which "
                                       "is no sample of the span; the sidecar does not match the file")
            self._outstanding.discard(s)
            self.frames_decoded += 1
            out.append((s, f))
        return out

    def _trim_pending(self) -> None:
        if len(self._pending) <= self.pending_frames:
            return
        # Drop the frames earliest in presentation: the reader has moved past them.
        by_time = sorted(self._pending, key=lambda s: self._pts[s - self._first])
        for s in by_time[:len(self._pending) - self.pending_frames]:
            del self._pending[s]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """The span bytes this object holds until ``close()``."""
        return self.span.nbytes

    def __enter__(self) -> EpisodeVideo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the decoder, the frames and the span bytes (waits for a running ``frame``)."""
        with self._lock:
            self._closed = True
            self._drop_context()
            self._pending.clear()
            self._kept.clear()
            self._payload = memoryview(b"")
