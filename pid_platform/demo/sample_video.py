"""Encode real MP4 files with PyAV: the video of ``pid-demo``'s sample LeRobot dataset and of the
LeRobot tests (AV1 via libsvtav1, H.264 via libx264).

``encode_mp4`` writes one video track: frames at ``1/fps``, a keyframe forced at every episode
start (and at ``keyframe_at``), ``faststart`` choosing moov-before-mdat, ``bframes`` giving
H.264 real B-frames (so the file has a ``ctts`` box and an ``elst`` edit whose media_time is
the encoder delay). ``photo_frames`` makes real-looking frames (a pan across a scikit-image
photograph) with the frame number drawn in as a block code that survives lossy coding;
``read_frame_number`` reads it back from a decoded frame.
"""

from __future__ import annotations

import contextlib
import fractions
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from av.video.frame import PictureType
from PIL import Image

from pid_platform.demo.sample_data import load_photo

CODECS = ("libsvtav1", "libx264")
CODE_BITS = 16  # frame numbers up to 65535: two rows of eight blocks


@dataclass(frozen=True)
class EncodedInfo:
    path: Path
    codec: str
    fps: int
    pts: np.ndarray                        # float64 seconds per frame, in presentation order
    episodes: list[tuple[float, float]]    # (from_timestamp, to_timestamp) per episode
    episode_frames: list[tuple[int, int]]  # (first frame, length) per episode
    keyframes: frozenset[int]              # frames where a keyframe was forced

    @property
    def num_frames(self) -> int:
        return len(self.pts)


def encode_mp4(path: Path, frames: Sequence[np.ndarray] | Sequence[Sequence[np.ndarray]], *,
               fps: int, codec: str = "libsvtav1", gop: int = 2, bframes: int = 0,
               faststart: bool = True, keyframe_at: set[int] | frozenset[int] = frozenset(),
               crf: int | None = None, negative_cts_offsets: bool = False) -> EncodedInfo:
    """Encode ``frames`` (HxWx3 uint8 arrays, or a list of episodes each a list of them) to ``path``.

    Episodes are appended back to back in one track; episode ``e`` spans
    ``[from_timestamp, to_timestamp)`` = ``[first / fps, (first + length) / fps)``.
    ``negative_cts_offsets`` (with B-frames) makes the muxer write a version-1 ``ctts`` with
    negative offsets and an edit starting at 0, instead of positive offsets and an encoder-delay edit.
    """
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    episodes = _as_episodes(frames)
    flat = [f for ep in episodes for f in ep]
    if not flat:
        raise ValueError("no frames to encode")
    height, width = flat[0].shape[:2]
    starts, spans, first = set(), [], 0
    for ep in episodes:
        starts.add(first)
        spans.append((first, len(ep)))
        first += len(ep)
    forced = frozenset(starts | set(keyframe_at))

    # SVT-AV1 prints a banner per encoder to stderr; keep logs readable (errors only).
    os.environ.setdefault("SVT_LOG", "1")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    movflags = ("+faststart" if faststart else "") + ("+negative_cts_offsets" if negative_cts_offsets else "")
    muxer_options = {"movflags": movflags} if movflags else {}
    with scheduling_kept(), av.open(str(path), "w", format="mp4", options=muxer_options) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, fps)
        stream.codec_context.gop_size = gop
        stream.options = _codec_options(codec, gop, bframes, crf)
        for i, rgb in enumerate(flat):
            if rgb.shape[:2] != (height, width):
                raise ValueError(f"frame {i} is {rgb.shape[:2]}, expected {(height, width)}")
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = i
            if i in forced:
                frame.pict_type = PictureType.I  # honoured as IDR (x264 forced-idr) / key frame (SVT)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)

    pts = np.arange(len(flat), dtype=np.float64) / fps
    return EncodedInfo(path=path, codec=codec, fps=fps, pts=pts,
                       episodes=[(s / fps, (s + n) / fps) for s, n in spans],
                       episode_frames=spans, keyframes=forced)


@contextlib.contextmanager
def scheduling_kept() -> Iterator[None]:
    """Run an encoder, then give the calling thread back the CPU scheduling it had.

    SVT-AV1 (libsvtav1), run as root, moves the thread that opens an encoder to ``SCHED_FIFO``
    priority 99 and leaves it there. Every process started from that thread afterwards inherits
    it: ``dagster dev``, a browser, a DataLoader worker. Under FIFO a process that never blocks is
    never preempted by its equals. In CI, after the tests had encoded their AV1 videos, two
    headless-chromium renderers spinning under it held both cores for 40 minutes while ``dagster
    dev``, FIFO 99 as well, waited behind them."""
    if not hasattr(os, "sched_getscheduler"):
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def _as_episodes(frames) -> list[list[np.ndarray]]:
    if len(frames) and isinstance(frames[0], np.ndarray) and frames[0].ndim == 3:
        return [list(frames)]
    return [list(ep) for ep in frames]


def _codec_options(codec: str, gop: int, bframes: int, crf: int | None) -> dict[str, str]:
    if codec == "libx264":
        # b-adapt=0 keeps exactly `bframes` B-frames between references (x264 would otherwise
        # drop them on small or fast-changing pictures); scenecut=0 keeps keyframes where asked.
        opts = {"g": str(gop), "bf": str(bframes), "forced-idr": "1", "preset": "veryfast",
                "x264-params": f"scenecut=0:b-adapt=0:bframes={bframes}"}
        if crf is not None:
            opts["crf"] = str(crf)
        return opts
    if bframes:
        raise ValueError("bframes applies to libx264 only")
    opts = {"g": str(gop), "preset": "11"}
    if crf is not None:
        opts["crf"] = str(crf)
    return opts


# ---------------------------------------------------------------------------------------------
# Real-looking, identifiable frames


def photo_frames(n: int, size: tuple[int, int] = (64, 48), *, photo: str = "astronaut",
                 start: int = 0, step: int = 2) -> list[np.ndarray]:
    """``n`` frames of ``size`` (width, height) panning across ``photo``; frame ``k`` carries
    the number ``start + k`` as a block code (see ``read_frame_number``)."""
    width, height = size
    base = _pan_base(photo, width, height)
    span_x, span_y = base.shape[1] - width, base.shape[0] - height
    frames = []
    for k in range(n):
        number = start + k
        x = (number * step) % (2 * span_x) if span_x else 0
        x = x if x <= span_x else 2 * span_x - x  # bounce back and forth
        y = (number * step // 3) % (span_y + 1) if span_y else 0
        frame = base[y:y + height, x:x + width].copy()
        draw_frame_number(frame, number)
        frames.append(frame)
    return frames


@functools.lru_cache(maxsize=16)
def _pan_base(photo: str, width: int, height: int) -> np.ndarray:
    im = load_photo(photo)
    # Scale so the pan has room to move: the crop window is a third of the picture's width.
    scale = 3 * width / im.width
    im = im.resize((max(3 * width, round(im.width * scale)), max(height + 1, round(im.height * scale))),
                   Image.BILINEAR)
    base = np.asarray(im)
    base.flags.writeable = False  # shared between calls; frames are copies
    return base


def _blocks(frame: np.ndarray) -> tuple[int, int]:
    height, width = frame.shape[:2]
    bw = width // (CODE_BITS // 2)
    bh = max(4, min(bw, height // 6))
    return bw, bh


def draw_frame_number(frame: np.ndarray, number: int) -> None:
    """Draw ``number`` into the top rows of ``frame`` in place: one black/white block per bit."""
    if not 0 <= number < 2 ** CODE_BITS:
        raise ValueError(f"frame number {number} does not fit in {CODE_BITS} bits")
    bw, bh = _blocks(frame)
    for bit in range(CODE_BITS):
        row, col = divmod(bit, CODE_BITS // 2)
        frame[row * bh:(row + 1) * bh, col * bw:(col + 1) * bw] = 255 if number >> bit & 1 else 0


def read_frame_number(frame: np.ndarray) -> int:
    """The number ``draw_frame_number`` put into a (decoded, lossy) RGB frame."""
    bw, bh = _blocks(frame)
    number = 0
    for bit in range(CODE_BITS):
        row, col = divmod(bit, CODE_BITS // 2)
        # The block's centre: edges bleed into neighbours after chroma subsampling and the DCT.
        cy, cx = row * bh + bh // 2, col * bw + bw // 2
        patch = frame[cy - 1:cy + 1, cx - 1:cx + 1].astype(np.float64)
        if patch.mean() > 127:
            number |= 1 << bit
    return number
