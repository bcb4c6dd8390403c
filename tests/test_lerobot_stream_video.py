"""The streaming reader's video layer: byte spans planned from the sidecar, frames decoded from
only those bytes equal to a whole-file PyAV decode (AV1 and H.264 with B-frames), any access
order, windows, tolerance errors, codec errors and the decoder LRU."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.mp4 import index_mp4
from loader.lerobot.sidecar import CompactArrays, CompactIndex, SidecarFile, build_sidecar
from loader.lerobot.streaming import codec
from loader.lerobot.streaming import video as video_module
from loader.lerobot.streaming.codec import (
    SpareContexts,
    UnsupportedCodecError,
    decoder_config,
    open_decoder,
)
from loader.lerobot.streaming.video import (
    DecoderCache,
    EpisodeVideo,
    VideoFrameError,
    VideoSpan,
    frames_held,
    plan_video_span,
)
from tests.support.lerobot_data import write_v3_dataset
from tests.support.video import decode_all_frames, encode_plain_mp4, photo_frames

CAMERA = "observation.images.front"
TOL = 1e-4
SMALL = dict(cameras=(CAMERA,), size=(32, 24))
DATASETS = {
    "av1-faststart": dict(codec="libsvtav1", gop=2, faststart=True, episodes_per_file=3,
                          episode_lengths=(7, 5, 6, 4)),
    "av1-moov-last": dict(codec="libsvtav1", gop=2, faststart=False, episodes_per_file=2,
                          episode_lengths=(6, 5)),
    "h264-bframes": dict(codec="libx264", gop=12, bframes=2, faststart=False, episodes_per_file=1,
                         episode_lengths=(14, 9)),
    "h264-bframes-multi": dict(codec="libx264", gop=12, bframes=2, faststart=False, episodes_per_file=3,
                               episode_lengths=(15, 11, 13)),
}


@dataclass
class Built:
    root: Path
    meta: LeRobotMeta
    index: CompactIndex
    _oracle: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def arrays(self, rel: str) -> CompactArrays:
        return self.index.arrays(rel)

    def file(self, rel: str) -> SidecarFile:
        return self.index.file(rel)

    def episode(self, ep: int) -> tuple[str, float, int]:
        info = self.meta.episode(ep)
        span = info.videos[CAMERA]
        return self.meta.video_rel(CAMERA, span.chunk, span.file), span.from_timestamp, info.length

    def plan(self, ep: int) -> VideoSpan:
        rel, t0, length = self.episode(ep)
        return plan_video_span(rel, self.arrays(rel), from_timestamp=t0, length=length,
                               fps=self.meta.fps, tolerance_s=TOL)

    def open(self, span: VideoSpan, **kw) -> EpisodeVideo:
        """An EpisodeVideo fed ONLY the span's bytes of the file."""
        payload = (self.root / span.rel).read_bytes()[span.byte_start:span.byte_end]
        return EpisodeVideo(span, self.file(span.rel), self.arrays(span.rel), payload, tolerance_s=TOL, **kw)

    def oracle(self, rel: str, times: np.ndarray) -> np.ndarray:
        """Frames of a whole-file av.open decode nearest ``times``."""
        if rel not in self._oracle:
            self._oracle[rel] = decode_all_frames(self.root / rel)
        all_times, frames = self._oracle[rel]
        picks = [int(np.argmin(np.abs(all_times - t))) for t in times]
        assert all(abs(all_times[p] - t) < TOL for p, t in zip(picks, times, strict=True))
        return frames[picks]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Built] = {}
    base = tmp_path_factory.mktemp("stream-video")

    def get(name: str) -> Built:
        if name not in cache:
            root = write_v3_dataset(base / name, **SMALL, **DATASETS[name])
            meta = LeRobotMeta.load(str(root))
            npz = build_sidecar(meta, base / f"{name}.npz", repo_id="pid-test/video", revision="r1",
                                data_root=str(root)) and base / f"{name}.npz"
            cache[name] = Built(root, meta, CompactIndex.open(npz, cache_root=base / "indexes"))
        return cache[name]
    return get


def episode_times(b: Built, ep: int) -> np.ndarray:
    _, t0, length = b.episode(ep)
    return t0 + np.arange(length) / b.meta.fps


# -- every frame, from the span bytes only ----------------------------------------------------

@pytest.mark.parametrize("name", list(DATASETS))
def test_every_frame_decoded_from_span_bytes_equals_full_decode(name: str, built) -> None:
    b = built(name)
    reorders = "bframes" in DATASETS[name]
    for ep in range(len(DATASETS[name]["episode_lengths"])):
        rel, _, length = b.episode(ep)
        arrays = b.arrays(rel)
        span = b.plan(ep)
        sync = np.asarray(arrays["sync_samples"], dtype=np.int64)
        sizes = np.asarray(arrays["sample_sizes"], dtype=np.int64)
        n = arrays.sample_count
        times = episode_times(b, ep)

        assert span.rel == rel and span.frame_samples.dtype == np.int64 and len(span.frame_samples) == length
        np.testing.assert_allclose(np.asarray(arrays["sample_pts"])[span.frame_samples], times, atol=TOL)
        assert span.first_sample in sync and span.first_sample <= span.frame_samples.min()
        if reorders:   # through the end of the last needed GOP
            assert span.end_sample == n or span.end_sample in sync
            assert span.end_sample > span.frame_samples.max()
        else:
            assert span.end_sample == span.frame_samples.max() + 1
        # Single-track files: the span's samples are contiguous bytes.
        assert span.nbytes == int(sizes[span.first_sample:span.end_sample].sum())

        video = b.open(span)
        got = video.frames_at(times)
        assert got.dtype == np.uint8 and got.shape == (length, 24, 32, 3)
        assert np.array_equal(got, b.oracle(rel, times)), f"{name} episode {ep}"
        for k, s in enumerate(span.frame_samples):
            assert video.sample_for_time(times[k]) == s
        assert video.frames_decoded >= length and video.decode_seconds > 0
        video.close()


@pytest.mark.parametrize("name", ["av1-faststart", "h264-bframes-multi"])
def test_spans_starting_mid_gop_and_crossing_episodes(name: str, built) -> None:
    """Any run of 3 frames of a file, wherever it starts: the span reaches back to a sync sample."""
    b = built(name)
    rel, _, _ = b.episode(0)
    arrays = b.arrays(rel)
    fps = b.meta.fps
    for start in range(arrays.sample_count - 2):
        span = plan_video_span(rel, arrays, from_timestamp=start / fps, length=3, fps=fps, tolerance_s=TOL)
        times = (start + np.arange(3)) / fps
        video = b.open(span)
        assert np.array_equal(video.frames_at(times), b.oracle(rel, times)), f"frames {start}..{start + 2}"


# -- access orders and windows ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["av1-faststart", "h264-bframes-multi"])
def test_random_and_backward_access(name: str, built) -> None:
    b = built(name)
    ep = 0 if name.startswith("h264") else 1
    rel, _, length = b.episode(ep)
    times = episode_times(b, ep)
    want = b.oracle(rel, times)
    video = b.open(b.plan(ep), keep_frames=2)
    rng = np.random.default_rng(7)
    for k in list(rng.permutation(length)) + list(range(length - 1, -1, -1)) + list(rng.permutation(length)):
        sample = video.span.frame_samples[k]
        got = video.frame(sample)
        assert np.array_equal(got, want[k]), f"frame {k}"
        # The planes a batch is written from are shared with later requests: read-only; frame()
        # is a copy of them, the caller's to change.
        assert not any(p.flags.writeable for p in video.rgb(sample)) and got.flags.writeable
        got[:] = 0
        assert np.array_equal(video.frame(sample), want[k])
    assert video.restarts > 1   # backward requests beyond what is kept start over
    assert len(video._kept) <= 2 and len(video._pending) <= 2


@pytest.mark.parametrize("name", ["av1-moov-last", "h264-bframes"])
def test_windows_back_and_forward_decode_once_when_kept(name: str, built) -> None:
    b = built(name)
    rel, _, length = b.episode(0)
    times = episode_times(b, 0)
    want = b.oracle(rel, times)
    video = b.open(b.plan(0), keep_frames=8)
    fps = b.meta.fps
    for k in range(length):
        idx = np.clip(np.arange(k - 3, k + 2), 0, length - 1)   # clamped as LeRobot pads
        window = video.frames_at(times[0] + idx / fps)
        assert window.shape == (5, 24, 32, 3) and window.flags.writeable
        assert np.array_equal(window, want[idx]), f"window at frame {k}"
    # Sequential windows never go back further than the frames kept: one pass, one decoder.
    assert video.restarts == 1
    assert video.frames_decoded == video.span.end_sample - video.span.first_sample


def test_frame_is_thread_safe(built) -> None:
    b = built("h264-bframes-multi")
    rel, _, length = b.episode(1)
    times = episode_times(b, 1)
    want = b.oracle(rel, times)
    video = b.open(b.plan(1), keep_frames=3)
    errors: list[str] = []

    def worker(seed: int) -> None:
        order = np.random.default_rng(seed).permutation(length)
        for k in order:
            if not np.array_equal(video.frame(video.span.frame_samples[k]), want[k]):
                errors.append(f"seed {seed} frame {k}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_frames_held_keeps_rgb_frames_only_for_windows() -> None:
    assert frames_held(0, 2) == (0, 3)      # no camera window: nothing is asked twice
    assert frames_held(3, 2) == (9, 9)      # windows overlap, asked out of order by 2 threads


@pytest.mark.parametrize("name", ["av1-faststart", "h264-bframes-multi"])
def test_keeping_no_frames_still_decodes_every_order(name: str, built) -> None:
    b = built(name)
    ep = 0 if name.startswith("h264") else 1
    rel, _, length = b.episode(ep)
    want = b.oracle(rel, episode_times(b, ep))
    video = b.open(b.plan(ep), keep_frames=0, pending_frames=3)
    forward = list(range(length))
    for k in forward + [length - 1] + forward[::-1]:   # a repeat (padding), then backwards
        assert np.array_equal(video.frame(video.span.frame_samples[k]), want[k]), f"frame {k}"
        assert len(video._kept) == 0 and len(video._pending) <= 3
    assert video.restarts > 1     # nothing kept: a repeat decodes again
    with pytest.raises(ValueError, match="keep_frames must be >= 0 and pending_frames >= 1"):
        b.open(b.plan(ep), keep_frames=-1)
    with pytest.raises(ValueError, match="pending_frames >= 1"):
        b.open(b.plan(ep), keep_frames=0, pending_frames=0)


@pytest.mark.parametrize("name", list(DATASETS))
def test_released_context_resumes_to_the_same_frames(name: str, built) -> None:
    """A decoder that lets its codec context go at a closed-GOP start (or at the span's end)
    and carries on with a fresh one hands out the frames of one that kept its context, in
    order, out of order and backwards, without counting the resumes as restarts."""
    b = built(name)
    ep = 0 if name.startswith("h264") else 1
    rel, _, length = b.episode(ep)
    want = b.oracle(rel, episode_times(b, ep))
    releasing = b.open(b.plan(ep), keep_frames=0, pending_frames=3)
    keeping = b.open(b.plan(ep), keep_frames=0, pending_frames=3)
    keeping._release_if_clean = lambda: None
    forward = list(range(length))
    for k in forward:
        got = releasing.frame(releasing.span.frame_samples[k])
        assert np.array_equal(got, keeping.frame(keeping.span.frame_samples[k])), f"frame {k}"
        assert np.array_equal(got, want[k]), f"frame {k}"
    assert releasing.releases > 0 and keeping.releases == 0
    assert releasing.restarts == keeping.restarts == 1   # a resume is no restart
    if not name.startswith("h264"):
        # gop 2, no reordering: every other sample starts a closed GOP, where the context goes.
        assert releasing.releases >= length // 2 - 1
    rng = np.random.default_rng(3)
    for k in [length - 1, *rng.permutation(length), *forward[::-1]]:
        got = releasing.frame(releasing.span.frame_samples[k])
        assert np.array_equal(got, want[k]), f"frame {k}"
        assert np.array_equal(got, keeping.frame(keeping.span.frame_samples[k])), f"frame {k}"
    releasing.close()
    keeping.close()


def test_clean_starts_are_sync_samples_without_leading_pictures() -> None:
    from loader.lerobot.streaming.video import _clean_starts

    # decode order; GOPs at 0, 4, 6: the one at 6 has a leading picture (pts 6 < 7): open
    pts = np.array([0.0, 3, 1, 2, 4, 5, 7, 6, 8])
    assert _clean_starts(np.array([0, 4, 6]), pts).tolist() == [
        True, False, False, False, True, False, False, False, False]
    assert not _clean_starts(np.array([], dtype=np.int64), pts).any()


def test_drained_decoder_holds_no_context(built) -> None:
    b = built("av1-faststart")
    span = b.plan(1)
    video = b.open(span, keep_frames=0)
    samples = span.frame_samples.tolist()
    for s in samples:
        video.frame(s)
        nxt = s + 1
        at_clean_start = nxt < span.end_sample and bool(video._clean[nxt - span.first_sample])
        assert (video._ctx is None) == (at_clean_start or nxt >= span.end_sample), f"sample {s}"
    assert video._ctx is None   # the span is fed and out: nothing kept for a restart to reuse


def test_spare_contexts_are_bounded_and_matched() -> None:
    spares = SpareContexts(2)
    made = [open_decoder("libdav1d", b"a") for _ in range(5)]
    for ctx in made:
        spares.give("libdav1d", b"a", ctx)
    assert len(spares) == 2                               # the oldest dropped
    assert spares.take("libdav1d", b"b") not in made      # other extradata: a new context
    assert spares.opened == 1 and spares.reused == 0
    got = spares.take("libdav1d", b"a")
    assert got is made[-1] and spares.reused == 1         # newest first
    assert spares.take("libdav1d", b"a") is made[-2] and len(spares) == 0
    assert spares.take("libdav1d", b"a") not in made and spares.opened == 2
    spares.give("h264", b"a", open_decoder("h264", b""))
    assert len(spares) == 0                               # only libdav1d's flush is a fresh start
    none = SpareContexts(0)
    none.give("libdav1d", b"a", made[0])
    assert len(none) == 0
    with pytest.raises(ValueError, match="capacity"):
        SpareContexts(-1)


def _spares_in_child(queue) -> None:
    queue.put(len(codec.SPARE_CONTEXTS))


def test_forked_child_starts_without_spare_contexts() -> None:
    codec.SPARE_CONTEXTS.give("libdav1d", b"x", open_decoder("libdav1d", b"x"))
    try:
        assert len(codec.SPARE_CONTEXTS) >= 1
        mp = multiprocessing.get_context("fork")
        queue = mp.Queue()
        child = mp.Process(target=_spares_in_child, args=(queue,))
        child.start()
        assert queue.get(timeout=60) == 0
        child.join(60)
    finally:
        codec.SPARE_CONTEXTS.clear()


def test_contexts_reused_across_files_decode_as_fresh_ones(built, monkeypatch) -> None:
    """Decoders of two different AV1 files, taking turns, through ONE spare context: each one
    resumes or restarts on the context the other just flushed, and every frame is exact."""
    spares = SpareContexts(1)
    monkeypatch.setattr(video_module, "SPARE_CONTEXTS", spares)
    videos, wants = [], []
    for name, ep in (("av1-faststart", 1), ("av1-moov-last", 0), ("av1-faststart", 2)):
        b = built(name)
        rel, _, length = b.episode(ep)
        videos.append(b.open(b.plan(ep), keep_frames=0))
        wants.append(b.oracle(rel, episode_times(b, ep)))
    for k in range(max(len(w) for w in wants)):
        for v, want in zip(videos, wants, strict=True):
            if k < len(want):
                assert np.array_equal(v.frame(v.span.frame_samples[k]), want[k]), f"{v.rel} frame {k}"
    for v, want in zip(videos, wants, strict=True):   # restarts, backwards, on reused contexts
        for k in range(len(want) - 1, -1, -1):
            assert np.array_equal(v.frame(v.span.frame_samples[k]), want[k]), f"{v.rel} frame {k}"
        v.close()
    assert spares.reused > spares.opened and len(spares) == 1


# -- errors ---------------------------------------------------------------------------------

def test_time_outside_tolerance_names_the_file(built) -> None:
    b = built("av1-faststart")
    rel, t0, length = b.episode(1)
    arrays = b.arrays(rel)
    with pytest.raises(VideoFrameError, match=rf"{rel}.*tolerance_s=0\.0001.*nearest sample") as e:
        plan_video_span(rel, arrays, from_timestamp=t0 + 0.03, length=length, fps=b.meta.fps, tolerance_s=TOL)
    assert e.value.rel == rel and e.value.time == pytest.approx(t0 + 0.03)
    assert e.value.nearest == pytest.approx(t0) and e.value.tolerance_s == TOL
    with pytest.raises(VideoFrameError, match="no video frame in the file"):   # past the file's end
        plan_video_span(rel, arrays, from_timestamp=t0, length=100, fps=b.meta.fps, tolerance_s=TOL)
    with pytest.raises(ValueError, match="length"):
        plan_video_span(rel, arrays, from_timestamp=t0, length=0, fps=b.meta.fps, tolerance_s=TOL)

    video = b.open(b.plan(1))
    with pytest.raises(VideoFrameError, match=f"{rel}.*fetched span"):
        video.sample_for_time(t0 - 1.0 / b.meta.fps)   # a frame of the previous episode
    with pytest.raises(VideoFrameError, match="outside the fetched span"):
        video.frame(video.span.end_sample)
    with pytest.raises(ValueError, match="payload bytes"):
        EpisodeVideo(video.span, b.file(rel), arrays, b"\0" * (video.span.nbytes - 1), tolerance_s=TOL)


def test_unsupported_codec_is_a_clear_error(tmp_path: Path, built) -> None:
    path = encode_plain_mp4(tmp_path / "mpeg4.mp4", photo_frames(3, (32, 24)), codec="mpeg4")
    idx = index_mp4(path)
    assert idx.codec == "mp4v"
    with pytest.raises(UnsupportedCodecError, match=r"videos/x\.mp4: video codec 'mp4v' is not supported.*re-encode"):
        decoder_config("videos/x.mp4", idx.stsd)

    b = built("av1-faststart")
    span = b.plan(0)
    payload = (b.root / span.rel).read_bytes()[span.byte_start:span.byte_end]
    wrong = dataclasses.replace(b.file(span.rel), stsd=idx.stsd, codec="mp4v")
    with pytest.raises(UnsupportedCodecError, match=span.rel):
        EpisodeVideo(span, wrong, b.arrays(span.rel), payload, tolerance_s=TOL)


def test_hevc_decodes_from_a_mid_file_span(tmp_path: Path) -> None:
    """hvcC extradata: the third codec family, on a file written by libx265."""
    path = encode_plain_mp4(tmp_path / "hevc.mp4", photo_frames(12, (64, 48)), codec="libx265")
    idx = index_mp4(path)
    assert idx.codec in ("hev1", "hvc1")
    arrays = {name: getattr(idx, name) for name in ("sample_pts", "sample_durations", "sample_composition_offsets",
                                                    "sample_sizes", "sample_offsets", "sync_samples")}
    times, frames = decode_all_frames(path)
    span = plan_video_span("hevc.mp4", arrays, from_timestamp=times[5], length=4, fps=10, tolerance_s=TOL)
    entry = SidecarFile(id="0", path="hevc.mp4", size=idx.file_size, fingerprint=None, stable=False,
                        ftyp=idx.ftyp, stsd=idx.stsd, timescale=idx.timescale, track_id=idx.track_id,
                        codec=idx.codec, width=idx.width, height=idx.height, mdat=tuple(idx.mdat),
                        edit=idx.edit, sample_count=idx.num_samples)
    video = EpisodeVideo(span, entry, arrays, path.read_bytes()[span.byte_start:span.byte_end], tolerance_s=TOL)
    assert np.array_equal(video.frames_at(times[5:9]), frames[5:9])


# -- RGB planes ---------------------------------------------------------------------------------

def _yuv_frame(width: int, height: int, seed: int = 0):
    import av

    frame = av.VideoFrame(width, height, "yuv420p")
    rng = np.random.default_rng(seed)
    for plane in frame.planes:
        np.frombuffer(plane, np.uint8)[:] = rng.integers(0, 256, plane.buffer_size, dtype=np.uint8)
    return frame


@pytest.mark.parametrize("planar", [True, False], ids=["gbrp", "rgb24"])
def test_rgb_planes_are_swscales_rgb24_values(planar: bool, monkeypatch) -> None:
    # Either path gives exactly the packed rgb24 conversion (LeRobot's values), as (3, H, W).
    monkeypatch.setattr(video_module, "_planar_is_exact", lambda frame: planar)
    for size in ((64, 48), (320, 240)):
        frame = _yuv_frame(*size)
        planes = video_module.rgb_planes(frame)
        assert len(planes) == 3 and all(p.shape == (size[1], size[0]) and not p.flags.writeable for p in planes)
        assert np.array_equal(np.stack(planes, axis=-1), frame.to_ndarray(format="rgb24"))


def test_planar_rgb_is_used_only_where_swscale_makes_it_exact(monkeypatch) -> None:
    monkeypatch.setattr(video_module, "_PLANAR_EXACT", {})
    # At 102x70 swscale's gbrp differs from its rgb24 (PyAV 18's FFmpeg); the check finds it and
    # rgb24 is used.
    odd = _yuv_frame(102, 70)
    gbrp = odd.reformat(format="gbrp").planes
    differs = not all(np.array_equal(video_module._plane_array(gbrp[p]), odd.to_ndarray(format="rgb24")[..., c])
                      for c, p in enumerate(video_module._GBRP_RGB))
    assert video_module._check_planar(odd) is not differs
    assert np.array_equal(np.stack(video_module.rgb_planes(odd), axis=-1), odd.to_ndarray(format="rgb24"))
    assert video_module._PLANAR_EXACT[("yuv420p", 102, 70, odd.colorspace, odd.color_range)] is not differs
    # Where the check passes, gbrp on other frames of that kind still equals rgb24.
    for size in ((64, 48), (320, 240)):
        if video_module._check_planar(_yuv_frame(*size)):
            for seed in range(1, 4):
                frame = _yuv_frame(*size, seed=seed)
                assert np.array_equal(np.stack(video_module.rgb_planes(frame), axis=-1),
                                      frame.to_ndarray(format="rgb24"))


def test_planes_at_gives_the_frames_as_planes(built) -> None:
    b = built("av1-faststart")
    video = b.open(b.plan(1), keep_frames=4)
    times = episode_times(b, 1)
    one = video.planes_at(times[2:3])
    assert one.shape[0] == 1 and one.flags.c_contiguous
    assert np.array_equal(one[0].transpose(1, 2, 0), video.frames_at(times[2:3])[0])
    window = video.planes_at(times[0:3])
    assert np.array_equal(window.transpose(0, 2, 3, 1), video.frames_at(times[0:3]))
    # What batches are written from: the same values, as the decoder's planes.
    rgb = video.rgb_at(times[0:3])
    assert np.array_equal(np.stack([np.stack(f) for f in rgb]), window)


# -- the decoder cache --------------------------------------------------------------------------

def test_decoder_cache_evicts_and_closes(built) -> None:
    b = built("av1-faststart")
    videos = [b.open(b.plan(ep)) for ep in range(3)]
    cache = DecoderCache(2)
    for ep, v in enumerate(videos):
        cache.put((ep, CAMERA), v)
    assert len(cache) == 2 and (0, CAMERA) not in cache and cache.get((0, CAMERA)) is None
    with pytest.raises(ValueError, match="closed"):
        videos[0].frame(videos[0].span.frame_samples[0])
    assert cache.get((1, CAMERA)) is videos[1]          # now the most recent
    cache.put((3, CAMERA), b.open(b.plan(3)))
    assert cache.keys() == [(1, CAMERA), (3, CAMERA)]   # episode 2 was least recently used
    with pytest.raises(ValueError, match="closed"):
        videos[2].frame(videos[2].span.frame_samples[0])
    videos[1].frame(videos[1].span.frame_samples[0])    # still open
    cache.discard((1, CAMERA))
    with pytest.raises(ValueError, match="closed"):
        videos[1].frame(videos[1].span.frame_samples[0])
    last = cache.get((3, CAMERA))
    last.frame(last.span.frame_samples[0])
    assert last._ctx is not None or len(codec.SPARE_CONTEXTS) >= 1   # a context to let go of
    cache.clear()
    assert len(cache) == 0 and len(codec.SPARE_CONTEXTS) == 0   # the pass is over: no spares kept
    with pytest.raises(ValueError, match="closed"):
        last.frame(last.span.frame_samples[0])
    with pytest.raises(ValueError, match="video_decoder_cache_size"):
        DecoderCache(0)
