"""Real MP4 encoding for the LeRobot tests: re-exported from ``pid_platform.demo.sample_video``, which
``pid-demo`` uses too (AV1 via libsvtav1, H.264 via libx264; frames that carry their number), plus
the whole-file decode the streaming reader is compared with and an encoder for other codecs."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from pid_platform.demo.sample_video import (
    CODE_BITS,
    CODECS,
    EncodedInfo,
    draw_frame_number,
    encode_mp4,
    photo_frames,
    read_frame_number,
    scheduling_kept,
)

__all__ = ["CODECS", "CODE_BITS", "EncodedInfo", "decode_all_frames", "draw_frame_number",
           "encode_mp4", "encode_plain_mp4", "photo_frames", "read_frame_number"]


def decode_all_frames(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of the MP4's video track, decoded by PyAV from the whole file (the oracle the
    streaming reader is compared with): (presentation times in seconds, (N, H, W, 3) uint8 RGB),
    in presentation order."""
    times, frames = [], []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            times.append(float(frame.time))
            frames.append(frame.to_ndarray(format="rgb24"))
    order = np.argsort(times, kind="stable")
    return np.asarray(times)[order], np.stack(frames)[order]


def encode_plain_mp4(path: str | Path, frames: list[np.ndarray], *, codec: str, fps: int = 10) -> Path:
    """Encode ``frames`` with any FFmpeg encoder PyAV has (e.g. ``mpeg4``, ``libx265``), for tests
    of codecs the LeRobot writer does not produce."""
    path = Path(path)
    height, width = frames[0].shape[:2]
    with scheduling_kept(), av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
