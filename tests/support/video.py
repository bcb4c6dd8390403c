"""Real MP4 encoding for the LeRobot tests: re-exported from ``pid_platform.sample_video``, which
``pid-demo`` uses too (AV1 via libsvtav1, H.264 via libx264; frames that carry their number)."""

from __future__ import annotations

from pid_platform.sample_video import (
    CODE_BITS,
    CODECS,
    EncodedInfo,
    draw_frame_number,
    encode_mp4,
    photo_frames,
    read_frame_number,
)

__all__ = ["CODECS", "CODE_BITS", "EncodedInfo", "draw_frame_number", "encode_mp4", "photo_frames",
           "read_frame_number"]
