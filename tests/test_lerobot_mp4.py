"""``index_mp4`` against real encoded video: the box index must equal what FFmpeg's demuxer (PyAV)
reports for every packet, and its presentation times the decoded frames' times.

Fixtures are encoded once per module (64x48, a few dozen frames): AV1 (libsvtav1, g=2) and H.264
(libx264, g=12, two B-frames: ``ctts`` plus an encoder-delay edit), several episodes appended
with faststart, single episodes with ``moov`` at the end, a muxer-written ``ctts`` v1 with negative
offsets; and byte-level rewrites of those real files (``co64``, 64-bit box sizes, size-0 boxes,
``elst`` v1, an empty edit) made with ``tests.support.mp4_rewrite``, which keeps them valid.
"""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from loader.io import StreamConfig
from loader.lerobot.mp4 import EditListError, Mp4FormatError, Mp4Index, index_mp4
from tests.support.mp4_rewrite import Edit, Mp4Boxes
from tests.support.video import EncodedInfo, encode_mp4, photo_frames, read_frame_number

FPS = 10
EPISODES = [(7, "astronaut"), (12, "chelsea"), (9, "coffee")]


def _episodes() -> list[list[np.ndarray]]:
    out, start = [], 0
    for length, photo in EPISODES:
        out.append(photo_frames(length, photo=photo, start=start))
        start += length
    return out


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, EncodedInfo]]:
    """name -> (path, what was encoded). Rewritten files share their source's EncodedInfo."""
    root = tmp_path_factory.mktemp("mp4")
    episodes = _episodes()
    single = photo_frames(20, photo="rocket")
    made: dict[str, tuple[Path, EncodedInfo]] = {}

    def encode(name: str, frames, **kw) -> None:
        made[name] = (root / f"{name}.mp4", encode_mp4(root / f"{name}.mp4", frames, fps=FPS, **kw))

    encode("av1_g2_episodes", episodes, codec="libsvtav1", gop=2, faststart=True)
    encode("h264_bf2_episodes", episodes, codec="libx264", gop=12, bframes=2, faststart=True)
    encode("av1_moov_end", single, codec="libsvtav1", gop=2, faststart=False)
    encode("h264_bf2_moov_end", single, codec="libx264", gop=12, bframes=2, faststart=False)
    encode("h264_negative_cts", episodes, codec="libx264", gop=12, bframes=2, faststart=True,
           negative_cts_offsets=True)

    def rewrite(name: str, source: str, change) -> None:
        path, info = made[source]
        mp4 = Mp4Boxes(path.read_bytes())
        change(mp4)
        (root / f"{name}.mp4").write_bytes(mp4.to_bytes())
        made[name] = (root / f"{name}.mp4", info)

    def large(box_type: str):
        def change(mp4: Mp4Boxes) -> None:
            if box_type == "mdat" and any(n.type == "free" for n in mp4.top):
                mp4.drop_top("free")  # what FFmpeg's reserved 'free' box is for: room for a 64-bit size
            mp4.top_box(box_type).large = True
        return change

    def last_to_end(mp4: Mp4Boxes) -> None:
        mp4.top[-1].to_end = True

    def elst_v1(mp4: Mp4Boxes) -> None:
        mp4.set_edits(mp4.edits()[1], version=1)

    # co64 in a faststart file grows moov, so the muxed chunk offsets move too (the rewrite does it).
    rewrite("h264_co64_faststart", "h264_bf2_episodes", Mp4Boxes.stco_to_co64)
    rewrite("av1_co64_moov_end", "av1_moov_end", Mp4Boxes.stco_to_co64)
    rewrite("h264_large_mdat", "h264_bf2_episodes", large("mdat"))
    rewrite("av1_large_mdat_moov_end", "av1_moov_end", large("mdat"))
    rewrite("h264_large_moov_end", "h264_bf2_moov_end", large("moov"))
    rewrite("av1_mdat_to_end", "av1_g2_episodes", last_to_end)
    rewrite("h264_moov_to_end", "h264_bf2_moov_end", last_to_end)
    rewrite("h264_elst_v1", "h264_bf2_episodes", elst_v1)
    rewrite("h264_ctts_v1", "h264_bf2_moov_end", Mp4Boxes.ctts_to_v1)
    # Many chunks of varying sample counts: stsc runs (FFmpeg's small files have one chunk).
    rewrite("h264_rechunked", "h264_bf2_episodes", lambda mp4: mp4.rechunk([1, 2, 3, 3, 5, 1]))
    rewrite("av1_rechunked_co64_moov_end", "av1_moov_end",
            lambda mp4: (mp4.stco_to_co64(), mp4.rechunk([4, 4, 1, 2])))
    return made


ALL = ["av1_g2_episodes", "h264_bf2_episodes", "av1_moov_end", "h264_bf2_moov_end", "h264_negative_cts",
       "h264_co64_faststart", "av1_co64_moov_end", "h264_large_mdat", "av1_large_mdat_moov_end",
       "h264_large_moov_end", "av1_mdat_to_end", "h264_moov_to_end", "h264_elst_v1", "h264_ctts_v1",
       "h264_rechunked", "av1_rechunked_co64_moov_end"]


# -- helpers -------------------------------------------------------------------------------------

def demux(path: Path) -> tuple[Fraction, list[av.Packet]]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        packets = [p for p in container.demux(stream) if p.size]  # the final flush packet is empty
        return stream.time_base, packets


def decoded(path: Path) -> tuple[np.ndarray, list[int]]:
    """Decoded frames' times and the frame numbers drawn into them, in presentation order."""
    times, numbers = [], []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            times.append(frame.time)
            numbers.append(read_frame_number(frame.to_ndarray(format="rgb24")))
    return np.array(times), numbers


def assert_matches_demuxer(path: Path, ix: Mp4Index) -> None:
    time_base, packets = demux(path)
    assert time_base == Fraction(1, ix.timescale)
    assert ix.num_samples == len(packets)
    np.testing.assert_array_equal(ix.sample_offsets, [p.pos for p in packets])
    np.testing.assert_array_equal(ix.sample_sizes, [p.size for p in packets])
    np.testing.assert_array_equal(ix.sync_samples, [i for i, p in enumerate(packets) if p.is_keyframe])
    # FFmpeg moves every timestamp by the edit, and decode times by a constant more where
    # composition offsets are negative (so that dts <= pts); the differences are as stored.
    dts = np.array([p.dts for p in packets])
    pts = np.array([p.pts for p in packets])
    np.testing.assert_array_equal(dts - dts[0], ix.sample_dts)
    dts_shift = pts - dts - ix.sample_composition_offsets
    assert np.all(dts_shift == dts_shift[0]) and dts_shift[0] == max(0, -ix.sample_composition_offsets.min())
    np.testing.assert_array_equal(np.diff(dts), ix.sample_durations[:-1])
    # Presentation times: exactly the rational pts * time_base, rounded once.
    np.testing.assert_array_equal(ix.sample_pts, [float(p.pts * time_base) for p in packets])


# -- the index equals the demuxer and the decoder ------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_index_matches_pyav(videos, name: str) -> None:
    path, info = videos[name]
    ix = index_mp4(path)
    assert_matches_demuxer(path, ix)
    times, numbers = decoded(path)
    # Every decoded frame's time is a sample's presentation time, and the frames come out in
    # the order the encoder was given them: pts pick out the right pictures.
    np.testing.assert_array_equal(np.sort(ix.sample_pts), times)
    assert numbers == list(range(info.num_frames))
    np.testing.assert_array_equal(np.sort(ix.sample_pts), info.pts)
    assert ix.file_size == path.stat().st_size


@pytest.mark.parametrize("name", ["av1_g2_episodes", "h264_bf2_episodes", "h264_negative_cts"])
def test_episodes_start_on_sync_samples(videos, name: str) -> None:
    path, info = videos[name]
    ix = index_mp4(path)
    assert [round((b - a) * FPS) for a, b in info.episodes] == [n for n, _ in EPISODES]
    for start, _ in info.episodes:
        (first,) = np.flatnonzero(ix.sample_pts == start)
        assert first in ix.sync_samples, f"episode starting at {start}s does not start on a keyframe"
        # Decoding from that sample needs nothing earlier: it is also first in decode order
        # among the episode's samples.
        assert ix.sample_pts[first:].min() == start


def test_track_description(videos) -> None:
    ix = index_mp4(videos["av1_g2_episodes"][0])
    assert (ix.codec, ix.width, ix.height, ix.track_id) == ("av01", 64, 48, 1)
    assert ix.ftyp[4:8] == b"ftyp" and int.from_bytes(ix.ftyp[:4], "big") == len(ix.ftyp)
    assert ix.stsd[4:8] == b"stsd" and int.from_bytes(ix.stsd[:4], "big") == len(ix.stsd)
    assert ix.stsd[20:24] == b"av01"  # after the FullBox header, entry count and entry size
    assert ix.edit == {"empty_duration": 0, "media_time": 0}
    # A keyframe forced at every episode start, then every 2nd frame (the GOP restarts there).
    info = videos["av1_g2_episodes"][1]
    expected = {s + k for s, n in info.episode_frames for k in range(0, n, 2)}
    assert set(ix.sync_samples.tolist()) == expected
    assert all(a.dtype == np.int64 for a in (ix.sample_durations, ix.sample_composition_offsets,
                                            ix.sample_sizes, ix.sample_offsets, ix.sync_samples))
    assert ix.sample_pts.dtype == np.float64

    h = index_mp4(videos["h264_bf2_episodes"][0])
    assert (h.codec, h.width, h.height) == ("avc1", 64, 48)
    # Real B-frames: composition offsets, presentation order differs from decode order, and the
    # edit removes the encoder delay (two frames) so the first frame is presented at 0.
    assert h.sample_composition_offsets.any()
    assert np.any(np.diff(h.sample_pts) < 0)
    assert h.edit == {"empty_duration": 0, "media_time": 2 * h.sample_durations[0]}
    assert h.sample_pts.min() == 0.0

    neg = index_mp4(videos["h264_negative_cts"][0])
    assert neg.sample_composition_offsets.min() < 0 and neg.edit["media_time"] == 0
    assert Mp4Boxes(videos["h264_negative_cts"][0].read_bytes()).stbl().find("ctts").payload[0] == 1


def test_layouts(videos) -> None:
    fast = index_mp4(videos["h264_bf2_episodes"][0])
    assert fast.moov[0] < fast.mdat[0][0]
    end = index_mp4(videos["h264_bf2_moov_end"][0])
    assert end.moov[0] > end.mdat[0][0]
    assert end.moov[0] + end.moov[1] == end.file_size
    co64 = Mp4Boxes(videos["h264_co64_faststart"][0].read_bytes())
    assert co64.stbl().find("co64") is not None and co64.stbl().find("stco") is None
    stsc = Mp4Boxes(videos["h264_rechunked"][0].read_bytes()).stbl().find("stsc").payload
    assert int.from_bytes(stsc[4:8], "big") > 3  # several runs of chunks
    large = videos["h264_large_mdat"][0].read_bytes()
    mdat_at = index_mp4(videos["h264_large_mdat"][0]).mdat[0][0]
    assert large[mdat_at:mdat_at + 8] == b"\x00\x00\x00\x01mdat"


# -- what is read ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["av1_g2_episodes", "av1_moov_end", "h264_large_mdat", "av1_mdat_to_end"])
def test_reads_only_ftyp_moov_and_headers(videos, name: str) -> None:
    path, _ = videos[name]
    ix = index_mp4(path)
    tops = len(Mp4Boxes(path.read_bytes()).top)
    # ftyp and moov whole, plus at most 1 + 16 bytes around each other top-level box header.
    assert ix.bytes_read <= len(ix.ftyp) + ix.moov[1] + 17 * tops
    assert ix.bytes_read < sum(size for _, size in ix.mdat)


# -- edit lists -------------------------------------------------------------------------------------

def _with_edits(videos, tmp_path: Path, source: str, edits_for) -> Path:
    path, _ = videos[source]
    mp4 = Mp4Boxes(path.read_bytes())
    mp4.set_edits(edits_for(mp4.edits()[1][0]))
    out = tmp_path / f"edited-{source}.mp4"
    out.write_bytes(mp4.to_bytes())
    return out


REJECTED = {
    "two media edits": (lambda e: [Edit(1000, e.media_time), Edit(900, e.media_time + 1024)], "has 2 edits"),
    "rate 2": (lambda e: [Edit(e.segment_duration, e.media_time, 2)], "at rate 2"),
    "rate 0.5": (lambda e: [Edit(e.segment_duration, e.media_time, 0, 0x8000)], "at rate 0.5"),
    "two empty edits": (lambda e: [Edit(100, -1), Edit(100, -1), e], "has 3 edits"),
    "empty edit only": (lambda e: [Edit(100, -1)], "has 1 edit "),
    "empty edit last": (lambda e: [e, Edit(100, -1)], "has 2 edits"),
}


@pytest.mark.parametrize("case", list(REJECTED))
@pytest.mark.parametrize("source", ["h264_bf2_episodes", "av1_moov_end"])
def test_unsupported_edit_lists_are_rejected(videos, tmp_path: Path, source: str, case: str) -> None:
    edits_for, says = REJECTED[case]
    path = _with_edits(videos, tmp_path, source, edits_for)
    with pytest.raises(EditListError) as raised:
        index_mp4(path)
    message = str(raised.value)
    assert str(path) in message and says in message
    assert "only one rate-1 media edit, optionally after one empty edit, is supported" in message
    assert "re-mux the file without edit lists" in message
    assert isinstance(raised.value, Mp4FormatError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize("source", ["h264_bf2_episodes", "av1_moov_end"])
def test_empty_edit_then_media_edit_shifts_presentation(videos, tmp_path: Path, source: str) -> None:
    base = index_mp4(videos[source][0])
    # 500 movie ticks (ms) is a whole number of media ticks, so FFmpeg's shift is exact too.
    path = _with_edits(videos, tmp_path, source, lambda e: [Edit(500, -1), e])
    ix = index_mp4(path)
    assert ix.edit == {"empty_duration": 500, "media_time": base.edit["media_time"]}
    np.testing.assert_array_equal(ix.sample_pts, base.sample_pts + 0.5)
    assert_matches_demuxer(path, ix)
    np.testing.assert_array_equal(np.sort(ix.sample_pts), decoded(path)[0])


def test_empty_edit_off_the_media_tick_grid(videos, tmp_path: Path) -> None:
    # 333 ms is 3409.92 media ticks: the index keeps the exact sum, FFmpeg rounds the shift to a
    # whole tick, so decoded times differ by at most half a tick.
    path = _with_edits(videos, tmp_path, "h264_bf2_episodes", lambda e: [Edit(333, -1), e])
    ix = index_mp4(path)
    base = index_mp4(videos["h264_bf2_episodes"][0])
    np.testing.assert_array_equal(ix.sample_pts, base.sample_pts + 0.333)
    times = decoded(path)[0]
    assert np.abs(np.sort(ix.sample_pts) - times).max() <= 0.5 / ix.timescale


def test_no_edit_list(videos, tmp_path: Path) -> None:
    path, _ = videos["av1_moov_end"]
    mp4 = Mp4Boxes(path.read_bytes())
    trak = mp4.box("moov", "trak")
    trak.children = [c for c in trak.children if c.type != "edts"]
    out = tmp_path / "no-edts.mp4"
    out.write_bytes(mp4.to_bytes())
    ix = index_mp4(out)
    assert ix.edit is None
    assert_matches_demuxer(out, ix)


# -- broken input ------------------------------------------------------------------------------------

def test_broken_files_raise_format_errors(videos, tmp_path: Path) -> None:
    faststart = videos["h264_bf2_episodes"][0].read_bytes()
    moov_end = videos["h264_bf2_moov_end"][0].read_bytes()
    off, size = index_mp4(videos["h264_bf2_moov_end"][0]).mdat[0]
    cases = {
        "empty.mp4": (b"", "empty"),
        "photo.mp4": (b"\x89PNG\r\n\x1a\n" + bytes(64), "not an MP4"),
        "cut-in-mdat.mp4": (faststart[:-100], "file ends before"),
        "cut-in-moov.mp4": (moov_end[:-100], "file ends at"),
        "no-moov.mp4": (moov_end[:off + size], "no 'moov'"),
        "trailing.mp4": (faststart + b"abc", "stray bytes"),
    }
    for name, (data, says) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(Mp4FormatError, match=says) as raised:
            index_mp4(tmp_path / name)
        assert name in str(raised.value)
    with pytest.raises(FileNotFoundError):
        index_mp4(tmp_path / "missing.mp4")


def test_fragmented_mp4_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fragmented.mp4"
    with av.open(str(path), "w", format="mp4", options={"movflags": "frag_keyframe+empty_moov"}) as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i, rgb in enumerate(photo_frames(6)):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with pytest.raises(Mp4FormatError, match="fragmented"):
        index_mp4(path)


# -- remote -------------------------------------------------------------------------------------------

def assert_same_index(a: Mp4Index, b: Mp4Index) -> None:
    for name in ("sample_pts", "sample_durations", "sample_composition_offsets", "sample_sizes",
                 "sample_offsets", "sync_samples"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for name in ("timescale", "track_id", "ftyp", "stsd", "codec", "width", "height", "mdat", "edit",
                 "file_size", "movie_timescale", "moov", "bytes_read"):
        assert getattr(a, name) == getattr(b, name), name


REMOTE = ["av1_g2_episodes", "h264_bf2_moov_end", "h264_large_moov_end", "av1_mdat_to_end"]


@pytest.fixture(scope="module")
def remote_dir(videos, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served")
    for name in REMOTE:
        shutil.copy(videos[name][0], root / f"{name}.mp4")
    return root


def test_index_over_http(videos, remote_dir: Path, http_server) -> None:
    server = http_server(remote_dir)
    for name in REMOTE:
        local = index_mp4(videos[name][0])
        remote = index_mp4(server.url_for(f"{name}.mp4"))
        assert_same_index(local, remote)
        assert remote.source == server.url_for(f"{name}.mp4")
        # Every GET was a range read, and none reached into the media data beyond a box's last byte.
        data = videos[name][0].read_bytes()
        gets = server.gets(f"{name}.mp4")
        assert gets and all(r.range for r in gets)
        for r in gets:
            first, last = (int(x) for x in r.range.split("=")[1].split("-"))
            for off, size in local.mdat:
                header = 16 if data[off:off + 4] == b"\x00\x00\x00\x01" else 8
                payload = (off + header, off + size - 1)   # header and last byte excluded
                overlap = min(last, payload[1] - 1) - max(first, payload[0]) + 1
                assert overlap <= 0, f"{r.range} reads mdat payload {payload}"


def test_index_over_s3(videos, remote_dir: Path, s3_env) -> None:
    from tests.support.seaweedfs import upload_tree

    bucket = s3_env.make_bucket("lerobot-mp4")
    upload_tree(s3_env.client(), remote_dir, bucket, "videos")
    config = StreamConfig(s3_endpoint_url=s3_env.endpoint_url)
    for name in REMOTE:
        remote = index_mp4(f"s3://{bucket}/videos/{name}.mp4", stream_config=config)
        assert_same_index(index_mp4(videos[name][0]), remote)
    with pytest.raises(FileNotFoundError):
        index_mp4(f"s3://{bucket}/videos/missing.mp4", stream_config=config)
