"""Ours' items against the real lerobot package's own items, on the datasets lerobot itself
wrote for ``bench/bench_lerobot_stream.py`` (LeRobotDataset.create/add_frame/save_episode/
finalize) and the items its ``LeRobotDataset`` (torchcodec) returned for them. Skipped where that
bench has not run on this machine: the lerobot virtualenv is the bench's, not the test suite's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loader.lerobot.streaming import StreamingLeRobotDataset
from tests.support.lerobot_oracle import assert_item_equal

WORK = Path(os.environ.get("PID_BENCH_LEROBOT_DIR", "/tmp/pid-bench-lerobot"))
WINDOW = 10   # the bench's action window
CAMERAS = ["observation.images.front", "observation.images.wrist"]
WRITTEN = sorted(p for p in WORK.glob("lerobot-written-*") if p.is_dir() and (p.parent / f"{p.name}.done").is_file()
                 and (p.parent / f"{p.name}-lerobot-items.pt").is_file()) if WORK.is_dir() else []


@pytest.mark.skipif(not WRITTEN, reason=f"no dataset written by the real lerobot under {WORK} "
                                        "(run bench/bench_lerobot_stream.py)")
@pytest.mark.parametrize("root", WRITTEN, ids=[p.name for p in WRITTEN])
@pytest.mark.parametrize("frame_dtype", ["float32", "uint8"])
def test_items_equal_the_real_lerobots(root: Path, frame_dtype: str, tmp_path: Path) -> None:
    want = torch.load(root.parent / f"{root.name}-lerobot-items.pt", weights_only=False)
    ds = StreamingLeRobotDataset("bench/lerobot-arm", root=str(root), frame_dtype=frame_dtype,
                                 delta_timestamps={"action": [k / 30 for k in range(WINDOW)]},
                                 sidecar_cache_root=tmp_path / "sidecars", index_cache_root=tmp_path / "indexes")
    got = {int(item["index"]): item for item in ds if int(item["index"]) in want}
    assert got.keys() == want.keys()
    for i, item in got.items():
        if frame_dtype == "uint8":
            for key in CAMERAS:
                assert torch.equal(item[key].to(torch.float32), want[i][key] * 255)
                item[key] = item[key].float().div_(255)
        assert_item_equal(item, want[i], where=f"index {i}", video_keys=CAMERAS)
