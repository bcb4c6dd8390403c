"""The map-style oracle (tests/support/lerobot_oracle.py) is itself right, on real encoded data.

The fixture writer makes every frame identifiable: ``observation.state[0]`` is the row's global
``index``, and both cameras draw that same global index into each picture as a block code
(``photo_frames(length, start=dataset_from_index, step=2 + camera)``: frame ``k`` of episode
``e`` carries ``from_index + k``; the step only moves the pan, front across "astronaut", wrist
across "chelsea"). So each item can be checked against what the writer drew, without the oracle.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from pid_platform.demo.sample_video import photo_frames, read_frame_number
from tests.support.lerobot_data import (
    CAMERAS,
    DEFAULT_TASKS,
    LEROBOT_STREAM_H264_EPISODES,
    LEROBOT_V3_EPISODES,
    PHOTOS,
    STATE_NAMES,
)
from tests.support.lerobot_oracle import FrameTimestampError, MapStyleOracle, assert_item_equal

FPS = 10
FRONT, WRIST = CAMERAS
FIXTURES = {
    "h264": ("lerobot_stream_h264_root", LEROBOT_STREAM_H264_EPISODES, (48, 32)),
    "av1": ("lerobot_v3_root", LEROBOT_V3_EPISODES, (64, 48)),
}
SCALARS = {"timestamp": torch.float32, "frame_index": torch.int64, "episode_index": torch.int64,
           "index": torch.int64, "task_index": torch.int64}


class Layout:
    """Where each global frame index sits in a fixture written with these episode lengths."""

    def __init__(self, lengths: tuple[int, ...], size: tuple[int, int]) -> None:
        self.lengths, self.size = lengths, size
        self.starts = [sum(lengths[:e]) for e in range(len(lengths) + 1)]
        self.total = self.starts[-1]

    def episode_of(self, g: int) -> int:
        return next(e for e in range(len(self.lengths)) if g < self.starts[e + 1])

    def clamp(self, g: int, offset: int) -> tuple[int, bool]:
        """The frame LeRobot reads for ``g + offset`` and whether that is padding."""
        e = self.episode_of(g)
        lo, hi = self.starts[e], self.starts[e + 1] - 1
        return min(max(g + offset, lo), hi), not lo <= g + offset <= hi


@pytest.fixture(params=sorted(FIXTURES))
def dataset(request: pytest.FixtureRequest) -> tuple[Path, Layout]:
    fixture, lengths, size = FIXTURES[request.param]
    return request.getfixturevalue(fixture), Layout(lengths, size)


def frame_number(frame: torch.Tensor) -> int:
    """The number drawn into a (C, H, W) float frame."""
    return read_frame_number((frame * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


def camera_error(frame: torch.Tensor, g: int, cam: int, size: tuple[int, int]) -> float:
    """Mean absolute difference (0-255) from what camera ``cam`` drew for frame ``g``."""
    drawn = photo_frames(1, size, photo=PHOTOS[cam], start=g, step=2 + cam)[0].astype(np.float64)
    return float(np.abs(frame.permute(1, 2, 0).numpy() * 255 - drawn).mean())


# -- plain items ----------------------------------------------------------------------------------

def test_every_item_is_the_frame_the_writer_drew(dataset: tuple[Path, Layout]) -> None:
    root, layout = dataset
    oracle = MapStyleOracle(root)
    assert len(oracle) == layout.total and oracle.indices() == list(range(layout.total))
    width, height = layout.size
    for g in oracle.indices():
        item = oracle.item(g)
        e = layout.episode_of(g)
        assert set(item) == {*CAMERAS, "observation.state", "action", *SCALARS, "task"}
        for key, dtype in SCALARS.items():
            assert item[key].dtype == dtype and item[key].shape == (), key
        for key in ("observation.state", "action"):
            assert item[key].dtype == torch.float32 and item[key].shape == (len(STATE_NAMES),)
        assert item["observation.state"][0].item() == g
        assert torch.equal(item["action"], item["observation.state"] + 0.5)
        assert item["index"].item() == g and item["episode_index"].item() == e
        assert item["frame_index"].item() == g - layout.starts[e]
        assert item["timestamp"].item() == np.float32((g - layout.starts[e]) / FPS)
        assert item["task_index"].item() == e % 2 and item["task"] == DEFAULT_TASKS[e % 2]
        for cam_i, cam in enumerate(CAMERAS):
            frame = item[cam]
            assert frame.dtype == torch.float32 and frame.shape == (3, height, width)
            assert frame.min() >= 0 and frame.max() <= 1
            assert frame_number(frame) == g, (cam, g)
            # The camera's own picture, not the other camera's: the numbers are the same in both.
            own, other = camera_error(frame, g, cam_i, layout.size), camera_error(frame, g, 1 - cam_i, layout.size)
            assert own < 12 and other > 2 * own, (cam, g, own, other)


def test_stream_fixture_shares_files_and_has_b_frames(lerobot_stream_h264_root: Path) -> None:
    episodes = pq.read_table(lerobot_stream_h264_root / "meta/episodes/chunk-000/file-000.parquet")
    assert episodes.column("data/file_index").to_pylist() == [0, 0, 1, 1, 2]
    for cam in CAMERAS:
        assert episodes.column(f"videos/{cam}/file_index").to_pylist() == [0, 0, 1, 1, 2]
        # The second episode of a file starts mid-file.
        assert episodes.column(f"videos/{cam}/from_timestamp").to_pylist()[1] == 1.2
    path = lerobot_stream_h264_root / f"videos/{FRONT}/chunk-000/file-001.mp4"
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        pts = [p.pts for p in container.demux(stream) if p.pts is not None]
    assert pts != sorted(pts), "no B-frames: packets come in presentation order"
    assert top_level_boxes(path.read_bytes()).index("moov") > top_level_boxes(path.read_bytes()).index("mdat")


def top_level_boxes(data: bytes) -> list[str]:
    boxes, at = [], 0
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if size == 1:
            size = struct.unpack(">Q", data[at + 8:at + 16])[0]
        boxes.append(kind.decode("latin-1"))
        at += size if size else len(data)
    return boxes


# -- windows ---------------------------------------------------------------------------------------

DELTAS = {
    "observation.state": [-0.3, -0.1, 0.0, 0.2],
    "frame_index": [-0.1, 0.0],
    FRONT: [-0.2, 0.0, 0.3],
    WRIST: [-0.1],
}


def test_windows_clamp_to_the_episode_and_mark_padding(dataset: tuple[Path, Layout]) -> None:
    root, layout = dataset
    oracle = MapStyleOracle(root, delta_timestamps=DELTAS)
    width, height = layout.size
    padded_before = padded_after = 0
    for g in oracle.indices():
        item = oracle.item(g)
        assert set(item) == {*CAMERAS, "observation.state", "action", *SCALARS, "task",
                             *(f"{k}_is_pad" for k in DELTAS)}
        for key, deltas in DELTAS.items():
            reads = [layout.clamp(g, round(d * FPS)) for d in deltas]
            pad = item[f"{key}_is_pad"]
            assert pad.dtype == torch.bool and pad.tolist() == [p for _, p in reads], (key, g)
            if key == "observation.state":
                assert item[key].shape == (len(deltas), len(STATE_NAMES))
                assert item[key][:, 0].tolist() == [float(i) for i, _ in reads]
            elif key == "frame_index":
                e = layout.episode_of(g)
                assert item[key].dtype == torch.int64 and item[key].shape == (len(deltas),)
                assert item[key].tolist() == [i - layout.starts[e] for i, _ in reads]
            else:
                frames = item[key]
                if len(deltas) == 1:  # squeezed like LeRobot's _query_videos
                    assert frames.shape == (3, height, width)
                    frames = frames[None]
                assert frames.dtype == torch.float32
                assert frames.shape == (len(deltas), 3, height, width)
                assert [frame_number(f) for f in frames] == [i for i, _ in reads], (key, g)
        padded_before += item["observation.state_is_pad"][0].item()
        padded_after += item["observation.state_is_pad"][-1].item()
        # Keys without deltas keep their plain shapes.
        assert item["action"].shape == (len(STATE_NAMES),) and item["index"].shape == ()
    assert padded_before == 3 * len(layout.lengths) and padded_after == 2 * len(layout.lengths)


def test_a_delta_off_the_frame_grid_is_refused(lerobot_stream_h264_root: Path) -> None:
    with pytest.raises(ValueError, match="outside the tolerance"):
        MapStyleOracle(lerobot_stream_h264_root, delta_timestamps={"action": [0.0, 0.05]})
    # Within tolerance of 0.1 it is one frame.
    oracle = MapStyleOracle(lerobot_stream_h264_root, delta_timestamps={"action": [0.1 + 5e-5]})
    assert oracle.item(0)["action"][0, 0].item() == 1.5


# -- episode subsets -------------------------------------------------------------------------------

def test_an_episode_subset_holds_exactly_its_frames(lerobot_stream_h264_root: Path) -> None:
    layout = Layout(LEROBOT_STREAM_H264_EPISODES, (48, 32))
    subset = MapStyleOracle(lerobot_stream_h264_root, episodes=[3, 1], delta_timestamps=DELTAS)
    full = MapStyleOracle(lerobot_stream_h264_root, delta_timestamps=DELTAS)
    wanted = [*range(layout.starts[1], layout.starts[2]), *range(layout.starts[3], layout.starts[4])]
    assert subset.indices() == wanted and len(subset) == len(wanted)
    for g in wanted:
        assert_item_equal(subset.item(g), full.item(g), where=f"frame {g}")
    with pytest.raises(KeyError, match="not among the selected frames"):
        subset.item(layout.starts[2])
    with pytest.warns(UserWarning, match=r"outside the dataset range \[0, 5\): \[7\]"):
        dropped = MapStyleOracle(lerobot_stream_h264_root, episodes=[1, 7])
    assert dropped.indices() == list(range(layout.starts[1], layout.starts[2]))


# -- the tolerance check ---------------------------------------------------------------------------

def shift_from_timestamp(root: Path, episode: int, seconds: float) -> None:
    """Move one episode's video start in meta/episodes, for every camera."""
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    hit = pc.equal(table.column("episode_index"), episode)
    for cam in CAMERAS:
        name = f"videos/{cam}/from_timestamp"
        column = pc.if_else(hit, pc.add(table.column(name), seconds), table.column(name))
        table = table.set_column(table.schema.get_field_index(name), name, column.cast(pa.float64()))
    pq.write_table(table, path)


def test_a_timestamp_without_a_frame_within_tolerance_is_an_error(
        lerobot_stream_h264_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "shifted"
    shutil.copytree(lerobot_stream_h264_root, root)
    shift_from_timestamp(root, episode=2, seconds=0.03)
    layout = Layout(LEROBOT_STREAM_H264_EPISODES, (48, 32))
    strict = MapStyleOracle(root)
    with pytest.raises(FrameTimestampError, match=r"file-001\.mp4: no frame within tolerance_s=0\.0001"):
        strict.item(layout.starts[2] + 4)
    assert frame_number(strict.item(layout.starts[1])[FRONT]) == layout.starts[1]
    # A looser tolerance takes the nearest frame, 30 ms away: the right one.
    loose = MapStyleOracle(root, tolerance_s=0.04)
    for g in range(layout.starts[2], layout.starts[3]):
        assert frame_number(loose.item(g)[WRIST]) == g


# -- transforms and the comparison -----------------------------------------------------------------

def test_image_transforms_apply_to_every_camera(lerobot_stream_h264_root: Path) -> None:
    plain = MapStyleOracle(lerobot_stream_h264_root, delta_timestamps=DELTAS)
    inverted = MapStyleOracle(lerobot_stream_h264_root, delta_timestamps=DELTAS,
                              image_transforms=lambda x: 1 - x)
    a, b = plain.item(20), inverted.item(20)
    for cam in CAMERAS:
        assert torch.equal(b[cam], 1 - a[cam])
    assert_item_equal({**b, **{cam: a[cam] for cam in CAMERAS}}, a)


def test_assert_item_equal_fails_on_each_kind_of_difference(lerobot_stream_h264_root: Path) -> None:
    want = MapStyleOracle(lerobot_stream_h264_root, delta_timestamps=DELTAS).item(13)
    assert_item_equal(dict(want), want)
    # Video frames compare as uint8: a shift well under half a level is the same frame.
    assert_item_equal({**want, FRONT: want[FRONT] + 0.4 / 255}, want)
    one_level = want[FRONT].clone()
    one_level[1, 2, 3, 4] += 1 / 255
    state = want["observation.state"].clone()
    state[2, 3] = torch.nextafter(state[2, 3], torch.tensor(np.inf))
    cases = {
        "missing": ({k: v for k, v in want.items() if k != "task"}, "keys differ"),
        "extra": ({**want, "extra": torch.tensor(1)}, "keys differ"),
        "dtype": ({**want, "index": want["index"].to(torch.int32)}, "'index': got torch.int32"),
        "shape": ({**want, WRIST: want[WRIST][None]}, "want torch.float32 \\(3, 32, 48\\)"),
        "tabular ulp": ({**want, "observation.state": state}, "'observation.state'"),
        "padding": ({**want, f"{FRONT}_is_pad": ~want[f"{FRONT}_is_pad"]}, "_is_pad': got"),
        "one level": ({**want, FRONT: one_level}, "1 of 13824 pixel values differ"),
        "out of range": ({**want, WRIST: want[WRIST] * 1.01}, "pixel values differ"),
        "task": ({**want, "task": "open the door"}, "'task'"),
    }
    for name, (got, message) in cases.items():
        with pytest.raises(AssertionError, match=message):
            assert_item_equal(got, want, where=name)
