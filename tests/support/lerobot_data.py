"""Small LeRobot v3 datasets with real encoded video for the tests: the writer is
``pid_platform.demo.sample_lerobot.write_v3_dataset`` (re-exported here, with its layout constants),
which ``pid-demo`` uses too; this module adds the session fixtures.

Fixtures (bind them in a test module, or list this module in ``pytest_plugins``):
  ``lerobot_v3_root``       AV1 (libsvtav1, g=2), faststart, 2 cameras, 5 episodes, 3 episodes per
                            MP4 (2 files per camera), data and episode metadata spread over two chunks
  ``lerobot_v3_h264_root``  H.264 with B-frames (g=12, bf=2; ctts + encoder-delay edit list),
                            one episode per MP4 with ``moov`` after ``mdat``, 3 episodes
  ``lerobot_stream_h264_root`` H.264 with B-frames (g=12, bf=2), ``moov`` after ``mdat``, 2 cameras,
                            5 episodes, 2 episodes per MP4 and per data file (3 of each), 48x32
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pid_platform.demo.sample_lerobot import (
    CAMERAS,
    CODEBASE_VERSION,
    DATA_PATH,
    DEFAULT_TASKS,
    EPISODES_PATH,
    PHOTOS,
    STATE_NAMES,
    VIDEO_PATH,
    write_v3_dataset,
)

__all__ = ["CAMERAS", "CODEBASE_VERSION", "DATA_PATH", "DEFAULT_TASKS", "EPISODES_PATH",
           "LEROBOT_STREAM_H264_EPISODES", "LEROBOT_V3_EPISODES", "LEROBOT_V3_H264_EPISODES", "PHOTOS", "STATE_NAMES", "VIDEO_PATH",
           "lerobot_stream_h264_root", "lerobot_v3_h264_root", "lerobot_v3_root",
           "write_v3_dataset"]

# -- fixtures -------------------------------------------------------------------------------------

LEROBOT_V3_EPISODES = (6, 9, 12, 7, 10)
LEROBOT_V3_H264_EPISODES = (14, 8, 11)
LEROBOT_STREAM_H264_EPISODES = (12, 9, 16, 10, 13)


@pytest.fixture(scope="session")
def lerobot_v3_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """AV1 (g=2) faststart dataset: 2 cameras x 2 MP4 files (3 + 2 episodes), 5 episodes of
    6-12 frames, data files of 2 episodes and episode-metadata files of 2 episodes with two
    files per chunk (so chunk-000 and chunk-001). Read-only: copy it before changing it."""
    return write_v3_dataset(tmp_path_factory.mktemp("lerobot-v3-av1"), episodes_per_file=3,
                            episode_lengths=LEROBOT_V3_EPISODES, files_per_chunk=2,
                            data_episodes_per_file=2, meta_episodes_per_file=2)


@pytest.fixture(scope="session")
def lerobot_v3_h264_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """H.264 with B-frames (g=12, bf=2), one episode per MP4 with moov after mdat, 3 episodes,
    2 cameras, legacy ``__index_level_0__`` tasks. Read-only: copy it before changing it."""
    return write_v3_dataset(tmp_path_factory.mktemp("lerobot-v3-h264"), episodes_per_file=1,
                            episode_lengths=LEROBOT_V3_H264_EPISODES, codec="libx264", gop=12,
                            bframes=2, faststart=False, legacy_task_index=True)


@pytest.fixture(scope="session")
def lerobot_stream_h264_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """H.264 with B-frames (g=12, bf=2, moov after mdat), 2 cameras, 5 episodes of 9-16 frames:
    2 episodes per MP4 and per data file (3 files of each, the last with one episode), 48x32
    frames. Episodes longer than a GOP and episodes that start mid-file. Read-only."""
    return write_v3_dataset(tmp_path_factory.mktemp("lerobot-stream-h264"), episodes_per_file=2,
                            episode_lengths=LEROBOT_STREAM_H264_EPISODES, codec="libx264", gop=12,
                            bframes=2, faststart=False, data_episodes_per_file=2, size=(48, 32))
