"""Streaming a LeRobot v3 dataset (``StreamingLeRobotDataset``) vs LeRobot's map-style reading.

    python bench/bench_lerobot_stream.py [--episodes 40] [--lengths 40-80] [--size 256x192]
                                         [--episodes-per-file 8] [--fps 30] [--workers 2]
                                         [--batch-size 8] [--repeat 3] [--work-dir DIR]
                                         [--no-http] [--profile {ours,peer}]

Data: a LeRobot v3 dataset written by ``pid_platform.sample_lerobot.write_v3_dataset``: two
cameras, ``--episodes`` episodes of ``--lengths`` frames (drawn from a fixed seed), ``--size``
pixels, ``--episodes-per-file`` episodes appended into each MP4 and each data parquet file, real
AV1 (libsvtav1, g=2: LeRobot's default encoding). Generated once (~30 s) and cached in the work
folder with the MP4 sidecar and compact index (what a job finds on its second start). Every file
is read once before timing (warm page cache for everyone).

Contenders, one epoch each over every frame, ``--workers`` DataLoader workers and
``--batch-size`` for all (so they use the same cores), round-robin for ``--repeat`` rounds (best,
median beside it):

* ``ours``: ``StreamingLeRobotDataset(repo, root=<folder>)`` + ``make_loader(ds, batch_size=B,
  num_workers=2)``, no windows: each worker fetches its episodes' parquet row groups and the GOP
  span of each camera, and decodes the span's packets once, in order.
* ``ours + window (info)``: the same with ``delta_timestamps`` of three frames on the front camera.
* ``peer``: LeRobot's map-style reading: a ``torch.utils.data.Dataset`` over frames with the whole
  data table loaded up front, each item the parquet row plus, per camera, LeRobot's pyav
  ``decode_video_frames`` on the FULL MP4 (open the file, seek to the keyframe before the
  timestamp with LeRobot's one-tick margin, decode up to it, nearest frame within tolerance_s,
  uint8 CHW to float32 / 255); ``DataLoader(shuffle=True)`` with a seeded generator.
* ``peer, open containers (info)``: the same with each worker keeping its containers open
  (LeRobot's newer ``PyavCache``): no re-open and no ``moov`` re-parse per frame.
* ``peer, tuned (info)``: beyond LeRobot, open containers plus what ours does per frame: a
  single-threaded decoder and one reused RGB converter (``frame.to_ndarray`` builds a threaded
  swscale context per frame). What is left between it and ours is the reading pattern itself:
  seeking back to a keyframe and decoding up to the frame for every item, vs each frame once.

Reported per contender: epoch seconds and camera frames/s (the selected frames x cameras over the
epoch's wall time: every contender yields each frame once; ours' padding samples are extra work
counted against it), time to first batch (from constructing the dataset: ours with the warm
sidecar cache; ``ours, cold`` also builds the sidecar and compact index in a fresh cache folder),
peak memory (the sum of PSS over the main process and its DataLoader workers, sampled every
100 ms from ``/proc/<pid>/smaps_rollup``; and the workers' largest VmHWM), and what the worker
processes read (``rchar`` of ``/proc/<pid>/io``: every byte read from files, for both).

Bytes: ``loader.stats()["bytes_fetched"]`` (MP4 spans and parquet, all ranges, footers included)
against the minimum computed here independently of our span code: per episode and camera, the
bytes of the samples from the sync sample at or before its first frame through its last frame
(``loader.lerobot.mp4.index_mp4`` box index, frames matched by nearest presentation time), plus
the data parquet files (every row of every column is needed once per epoch).

Checked in the first round: ours and the peer deliver every frame once, and items of a sample of
frames are equal (``tests.support.lerobot_oracle.assert_item_equal``: uint8 frames exactly).
An ``http://`` row (information) streams the same data from a local range server (127.0.0.1).

Targets: ours >= 2x the peer's camera frames/s; bytes fetched <= 1.1x the GOP-aligned minimum.
A miss prints MISS; the exit status does not depend on it. ``--profile ours|peer`` instead runs
one epoch with cProfile on every thread of both workers and prints each worker's top functions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing.util
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _data  # noqa: E402
import av  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from av.video.reformatter import VideoReformatter  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from loader.lerobot.mp4 import index_mp4  # noqa: E402
from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader  # noqa: E402

DATA_VERSION = 1
REPO = "bench/arm"
SPEED_TARGET = 2.0
BYTES_TARGET = 1.1
TOLERANCE_S = 1e-4
SEED = 1000
CHECK_EVERY = 37   # items compared between ours and the peer: every frame whose index % this == 0


# -- data -------------------------------------------------------------------------------------------

def make_dataset(work: Path, *, episodes: int, lengths: tuple[int, int], size: tuple[int, int],
                 per_file: int, fps: int, log=print) -> Path:
    from pid_platform.sample_lerobot import write_v3_dataset

    stamp = {"v": DATA_VERSION, "episodes": episodes, "lengths": list(lengths), "size": list(size),
             "per_file": per_file, "fps": fps}
    folder = work / f"lerobot-{episodes}e-{lengths[0]}-{lengths[1]}f-{size[0]}x{size[1]}-p{per_file}-{fps}fps"
    done = folder / ".bench-done.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return folder / "data"
    if folder.exists():
        shutil.rmtree(folder)
    rng = random.Random(0)
    lens = [rng.randint(*lengths) for _ in range(episodes)]
    log(f"[data] writing a v3 dataset: 2 cameras, {episodes} episodes of {lengths[0]}-{lengths[1]} frames "
        f"({sum(lens)} frames), {size[0]}x{size[1]}, AV1 g=2, {per_file} episodes per file (once; cached in {folder})")
    t0 = time.perf_counter()
    write_v3_dataset(folder / "data", episodes_per_file=per_file, episode_lengths=lens, fps=fps, size=size,
                     codec="libsvtav1", gop=2)
    done.write_text(json.dumps(stamp))
    log(f"[data] done in {time.perf_counter() - t0:.1f} s")
    return folder / "data"


class DatasetFacts:
    """What the dataset holds, read with plain json/pyarrow (no ``loader`` code)."""

    def __init__(self, root: Path):
        self.root = root
        info = json.loads((root / "meta" / "info.json").read_text())
        self.fps = int(info["fps"])
        self.video_path = info["video_path"]
        self.cameras = [k for k, f in info["features"].items() if f["dtype"] == "video"]
        tables = [pq.read_table(p) for p in sorted((root / "meta" / "episodes").glob("*/*.parquet"))]
        eps = pa.concat_tables(tables)
        self.episodes = eps.select([c for c in eps.column_names if not c.startswith("stats/")]).to_pylist()
        self.num_frames = sum(int(e["length"]) for e in self.episodes)
        self.data_files = sorted((root / "data").glob("*/*.parquet"))
        self.video_files = sorted((root / "videos").glob("*/*/*.mp4"))

    def video_of(self, episode: dict, cam: str) -> Path:
        return self.root / self.video_path.format(video_key=cam, chunk_index=episode[f"videos/{cam}/chunk_index"],
                                                  file_index=episode[f"videos/{cam}/file_index"])

    def gop_aligned_minimum(self) -> dict[tuple[int, str], int]:
        """Per (episode, camera): the bytes of the samples from the sync sample at or before the
        episode's first frame through its last frame, from the MP4's box index."""
        indexes: dict[Path, Any] = {}
        out = {}
        for ep in self.episodes:
            for cam in self.cameras:
                path = self.video_of(ep, cam)
                ix = indexes.get(path) or indexes.setdefault(path, index_mp4(path))
                times = ep[f"videos/{cam}/from_timestamp"] + np.arange(int(ep["length"])) / self.fps
                order = np.argsort(ix.sample_pts, kind="stable")
                pts = ix.sample_pts[order]
                right = np.clip(np.searchsorted(pts, times), 0, len(pts) - 1)
                left = np.maximum(right - 1, 0)
                nearest = np.where(np.abs(pts[left] - times) <= np.abs(pts[right] - times), left, right)
                assert np.abs(pts[nearest] - times).max() < TOLERANCE_S, f"{path}: frames off the 1/fps grid"
                samples = order[nearest]
                first, last = int(samples.min()), int(samples.max())
                sync = int(ix.sync_samples[ix.sync_samples <= first].max())
                out[(int(ep["episode_index"]), cam)] = int(ix.sample_sizes[sync:last + 1].sum())
        return out


# -- the peer: LeRobot's map-style reading ---------------------------------------------------------

def decode_frames_pyav(container: av.container.InputContainer, timestamps: list[float],
                       tolerance_s: float, to_rgb: Callable[[av.VideoFrame], np.ndarray] | None = None) -> torch.Tensor:
    """LeRobot's pyav ``decode_video_frames`` on an open container: seek to the keyframe at or
    before the first timestamp (one tick of margin, as LeRobot), decode forward until the last,
    take the nearest decoded frame of each timestamp, ``(T, C, H, W)`` float32 in [0, 1]."""
    stream = container.streams.video[0]
    first, last = min(timestamps), max(timestamps)
    to_rgb = to_rgb or (lambda frame: frame.to_ndarray(format="rgb24"))
    container.seek(round(first / stream.time_base) - 1, backward=True, any_frame=False, stream=stream)
    frames: list[torch.Tensor] = []
    times: list[float] = []
    for frame in container.decode(stream):
        if frame.pts is None:
            continue
        t = float(frame.pts * stream.time_base)
        frames.append(torch.from_numpy(to_rgb(frame)).permute(2, 0, 1).contiguous())
        times.append(t)
        if t >= last:
            break
    dist = (torch.tensor(timestamps, dtype=torch.float64)[:, None] - torch.tensor(times, dtype=torch.float64)[None]).abs()
    nearest, which = dist.min(1)
    if not bool((nearest <= tolerance_s).all()):
        raise ValueError(f"no frame within {tolerance_s}s of {timestamps} (nearest {nearest.tolist()})")
    return torch.stack([frames[i] for i in which.tolist()]).type(torch.float32) / 255


class MapStyleFrames(Dataset):
    """One item per frame, as LeRobot's ``LeRobotDataset.__getitem__`` (no windows): the row from
    the whole data table (loaded here, once), each camera decoded from its full MP4.
    ``keep_open``: each worker keeps its containers open (LeRobot's ``PyavCache``). ``tuned``:
    beyond LeRobot, open containers with single-threaded decoders and one reused RGB converter
    (what ours does), so the peer spawns no threads per frame."""

    def __init__(self, facts: DatasetFacts, *, keep_open: bool = False, tuned: bool = False):
        self.facts = facts
        self.keep_open = keep_open or tuned
        self.tuned = tuned
        self._to_rgb: Any = None
        info = json.loads((facts.root / "meta" / "info.json").read_text())
        table = pa.concat_tables([pq.read_table(p) for p in facts.data_files])
        self.columns = {k: table.column(k).to_pylist() for k in info["features"] if k in table.column_names}
        tasks = pq.read_table(facts.root / "meta" / "tasks.parquet")
        index_col = json.loads(tasks.schema.metadata[b"pandas"])["index_columns"][0]
        self.tasks = tasks.column(index_col).to_pylist()
        self._containers: dict[str, av.container.InputContainer] = {}

    def __len__(self) -> int:
        return len(self.columns["index"])

    def _frames(self, path: Path, timestamps: list[float]) -> torch.Tensor:
        if not self.keep_open:
            with av.open(str(path)) as container:
                return decode_frames_pyav(container, timestamps, TOLERANCE_S)
        container = self._containers.get(str(path))
        if container is None:
            container = self._containers[str(path)] = av.open(str(path))
            if self.tuned:
                container.streams.video[0].codec_context.thread_count = 1
        if self.tuned and self._to_rgb is None:
            reformatter = VideoReformatter()
            self._to_rgb = lambda frame: reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()
        return decode_frames_pyav(container, timestamps, TOLERANCE_S, self._to_rgb)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item: dict[str, Any] = {k: torch.tensor(col[i]) for k, col in self.columns.items()}
        ep = self.facts.episodes[int(item["episode_index"])]
        ts = float(item["timestamp"])
        frames = {cam: self._frames(self.facts.video_of(ep, cam), [ep[f"videos/{cam}/from_timestamp"] + ts]).squeeze(0)
                  for cam in self.facts.cameras}
        item = {**frames, **item}
        item["task"] = self.tasks[int(item["task_index"])]
        return item


def peer_loader(facts: DatasetFacts, *, keep_open: bool, tuned: bool, batch_size: int, workers: int,
                seed: int) -> DataLoader:
    ds = MapStyleFrames(facts, keep_open=keep_open, tuned=tuned)
    return DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(seed))


# -- measuring --------------------------------------------------------------------------------------

def _read_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(path) as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in names:
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids.extend(int(x) for x in fh.read().split())
    except OSError:
        pass
    return kids


class MemorySampler:
    """Samples this process and its children (the DataLoader workers) every ``interval`` s:
    the peak of the summed PSS (shared pages counted once), each worker's last VmHWM (kB) and
    each worker's last ``rchar`` (bytes read)."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.peak_pss_kb = 0
        self.peak_workers_pss_kb = 0
        self.hwm_kb: dict[int, int] = {}
        self.rchar: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        me = os.getpid()
        total = _read_fields(f"/proc/{me}/smaps_rollup", ("Pss",)).get("Pss", 0)
        workers = 0
        for pid in _children(me):
            workers += _read_fields(f"/proc/{pid}/smaps_rollup", ("Pss",)).get("Pss", 0)
            hwm = _read_fields(f"/proc/{pid}/status", ("VmHWM",)).get("VmHWM")
            if hwm:
                self.hwm_kb[pid] = hwm
            rchar = _read_fields(f"/proc/{pid}/io", ("rchar",)).get("rchar")
            if rchar is not None:
                self.rchar[pid] = rchar
        self.peak_pss_kb = max(self.peak_pss_kb, total + workers)
        self.peak_workers_pss_kb = max(self.peak_workers_pss_kb, workers)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


class Run:
    """One contender's epoch: seconds, time to first batch, memory, what it read."""

    def __init__(self, name: str):
        self.name = name
        self.epoch_s = 0.0
        self.ttfb_s = 0.0
        self.samples = 0
        self.camera_frames = 0
        self.indices: list[int] = []
        self.kept: dict[int, dict[str, Any]] = {}
        self.stats: dict[str, int] = {}
        self.peak_pss_kb = 0
        self.peak_workers_pss_kb = 0
        self.worker_hwm_kb = 0
        self.worker_rchar = 0


def run_epoch(name: str, make: Callable[[], Iterable], cameras: list[str], *, keep: bool = False,
              stats: Callable[[Any], dict[str, int]] | None = None) -> Run:
    """Construct (``make``), iterate one epoch; the clock starts before construction."""
    run = Run(name)
    gc.collect()
    with MemorySampler() as mem:
        t0 = time.perf_counter()
        loader = make()
        t_iter = time.perf_counter()
        first = None
        for batch in loader:
            if first is None:
                first = time.perf_counter()
            idx = [int(x) for x in batch["index"]]
            run.indices.extend(idx)
            run.samples += len(idx)
            run.camera_frames += sum(int(np.prod(batch[c].shape[:-3])) for c in cameras)
            if keep:
                for j, i in enumerate(idx):
                    if i % CHECK_EVERY == 0:
                        run.kept[i] = {k: (v[j] if isinstance(v, torch.Tensor | list) else v) for k, v in batch.items()}
        end = time.perf_counter()
        mem.sample()
    run.epoch_s = end - t_iter
    run.ttfb_s = (first or end) - t0
    run.peak_pss_kb, run.peak_workers_pss_kb = mem.peak_pss_kb, mem.peak_workers_pss_kb
    run.worker_hwm_kb = max(mem.hwm_kb.values(), default=0)
    run.worker_rchar = sum(mem.rchar.values())
    if stats is not None:
        run.stats = stats(loader)
    del loader
    gc.collect()
    return run


# -- contenders -------------------------------------------------------------------------------------

class Contenders:
    def __init__(self, facts: DatasetFacts, args, caches: Path):
        self.facts = facts
        self.args = args
        self.caches = caches
        fps = facts.fps
        self.window = {facts.cameras[0]: [-2 / fps, -1 / fps, 0.0]}

    def ours(self, *, window: bool = False, root: str | None = None, cache: Path | None = None,
             keep: bool = False, name: str = "ours") -> Run:
        cache = cache or self.caches
        a = self.args

        def make():
            ds = StreamingLeRobotDataset(REPO, root=root or str(self.facts.root), seed=SEED,
                                         delta_timestamps=self.window if window else None,
                                         sidecar_cache_root=cache / "sidecars",
                                         index_cache_root=cache / "indexes")
            return make_loader(ds, batch_size=a.batch_size, num_workers=a.workers)

        def stats(loader) -> dict[str, int]:
            return {**loader.stats(), "span_bytes": sum(loader.dataset.episode_bytes().values())}

        return run_epoch(name, make, self.facts.cameras, keep=keep, stats=stats)

    def peer(self, *, keep_open: bool = False, tuned: bool = False, keep: bool = False, name: str = "peer") -> Run:
        a = self.args
        return run_epoch(name, lambda: peer_loader(self.facts, keep_open=keep_open, tuned=tuned, batch_size=a.batch_size,
                                                   workers=a.workers, seed=SEED),
                         self.facts.cameras, keep=keep)


def check_first_round(facts: DatasetFacts, runs: dict[str, Run]) -> None:
    from tests.support.lerobot_oracle import assert_item_equal

    everything = sorted(int(e) for e in range(facts.num_frames))
    for name, run in runs.items():
        if "window" in name:
            assert sorted(set(run.indices)) == everything, f"{name}: frames missing"
            continue
        got = sorted(run.indices)
        if name.startswith("ours"):
            assert sorted(set(got)) == everything, f"{name}: not every frame"
            assert len(got) - len(everything) == run.stats.get("padding_samples", 0), f"{name}: repeats beyond padding"
        else:
            assert got == everything, f"{name}: not every frame exactly once"
    ours, peer = runs["ours"].kept, runs["peer"].kept
    assert ours.keys() == peer.keys() and ours, "kept items differ"
    for i in ours:
        assert_item_equal(ours[i], peer[i], where=f"index {i}", video_keys=facts.cameras)
    print(f"[check] every frame delivered; {len(ours)} items (every index % {CHECK_EVERY} == 0) equal between "
          f"ours and the peer (uint8 frames exact)")


# -- report -----------------------------------------------------------------------------------------

def _best(runs: list[Run], attr: str) -> tuple[float, float]:
    values = [getattr(r, attr) for r in runs]
    return min(values), statistics.median(values)


def report(facts: DatasetFacts, rounds: dict[str, list[Run]], cold: list[Run], minimum: dict, http: Run | None,
           args) -> None:
    n_frames = facts.num_frames
    cams = len(facts.cameras)
    unique = n_frames * cams
    print(f"\n{n_frames} frames x {cams} cameras = {unique} camera frames per epoch; {args.workers} DataLoader "
          f"workers, batch {args.batch_size}, {args.repeat} rounds (best, median in brackets); {os.cpu_count()} CPUs")
    header = (f"{'contender':30s} {'epoch s':>15s} {'cam frames/s':>15s} {'vs peer':>7s} {'first batch s':>15s}"
              f" {'PSS MB':>7s} {'workers':>8s} {'HWM MB':>7s} {'read MB':>8s}")
    print(header)
    print("-" * len(header))
    peer_best = min(r.epoch_s for r in rounds["peer"])
    rate = {}
    for name, runs in [*rounds.items(), ("ours, cold sidecar (info)", cold), *([("ours over http:// (info)", [http])] if http else [])]:
        best, med = _best(runs, "epoch_s")
        frames = runs[0].camera_frames if "window" in name else unique
        rate[name] = frames / best
        ttfb, ttfb_med = _best(runs, "ttfb_s")
        pss = max(r.peak_pss_kb for r in runs) / 1024
        workers_pss = max(r.peak_workers_pss_kb for r in runs) / 1024
        hwm = max(r.worker_hwm_kb for r in runs) / 1024
        # rchar counts read(2) and friends: files, not the sockets an http:// reader receives on.
        read = "-" if "http" in name else f"{statistics.median(r.worker_rchar for r in runs) / 1e6:.2f}"
        vs = f"{peer_best / best:.2f}x" if "window" not in name else "-"
        print(f"{name:30s} {best:6.2f} ({med:6.2f}) {frames / best:6.0f} ({frames / med:6.0f}) {vs:>7s} "
              f"{ttfb:6.3f} ({ttfb_med:6.3f}) {pss:7.0f} {workers_pss:8.0f} {hwm:7.0f} {read:>8s}")

    ours = rounds["ours"][0].stats
    video_min = sum(minimum.values())
    parquet = sum(p.stat().st_size for p in facts.data_files)
    fetched = ours["bytes_fetched"]
    mp4_total = sum(p.stat().st_size for p in facts.video_files)
    print(f"\nbytes (ours, one epoch): fetched {fetched:,d} B in {ours['requests']} requests ({ours['retries']} retries, "
          f"{ours['episodes_fetched']} episode fetches, {ours['padding_samples']} padding samples)")
    print(f"  minimum: GOP-aligned MP4 samples {video_min:,d} B (index_mp4) + data parquet files {parquet:,d} B "
          f"= {video_min + parquet:,d} B; the MP4 files hold {mp4_total:,d} B")
    ratio_b = fetched / (video_min + parquet)
    spans = ours["span_bytes"]
    print(f"  fetched / minimum: {ratio_b:.4f}x; of it MP4 spans {spans:,d} B ({spans / video_min:.4f}x the GOP-aligned "
          f"samples) and parquet {fetched - spans:,d} B ({(fetched - spans) / parquet:.2f}x the data files)")
    print(f"  decode time in workers {ours['decode_ns'] / 1e9:.2f} s for {ours['frames_decoded']} frames; "
          f"peak reserved {ours['peak_reserved_bytes']:,d} B")
    speed = rate["ours"] / rate["peer"]
    print()
    print(f"{'PASS' if speed >= SPEED_TARGET else 'MISS'}: ours >= {SPEED_TARGET:g}x the map-style peer's camera "
          f"frames/s with {args.workers} workers ({speed:.2f}x: {rate['ours']:.0f} vs {rate['peer']:.0f})")
    print(f"{'PASS' if ratio_b <= BYTES_TARGET else 'MISS'}: bytes fetched <= {BYTES_TARGET:g}x the GOP-aligned "
          f"minimum ({ratio_b:.4f}x)")


# -- profile ----------------------------------------------------------------------------------------

def profile(contenders: Contenders, which: str, workers: int) -> None:
    """One epoch with cProfile on every thread of each DataLoader worker; prints each worker's top."""
    import cProfile
    import pstats

    out = Path(tempfile.mkdtemp(prefix="bench-lerobot-profile-"))

    def init(worker_id: int) -> None:
        prof = cProfile.Profile()
        profiles = [prof]

        def per_thread(frame, event, arg):  # a profiler of its own for each new thread
            p = cProfile.Profile()
            profiles.append(p)
            sys.setprofile(None)
            p.enable()

        threading.setprofile(per_thread)
        prof.enable()

        def dump() -> None:
            prof.disable()
            stats = None
            for p in profiles:
                p.disable()
                with contextlib.suppress(TypeError):  # a profile with no data
                    stats = pstats.Stats(p) if stats is None else stats.add(p)
            if stats is not None:
                stats.dump_stats(out / f"worker-{worker_id}.prof")

        # A DataLoader worker leaves through multiprocessing's os._exit: atexit never runs there,
        # its finalizers do.
        multiprocessing.util.Finalize(None, dump, exitpriority=100)

    a = contenders.args
    t0 = time.perf_counter()
    if which == "ours":
        ds = StreamingLeRobotDataset(REPO, root=str(contenders.facts.root), seed=SEED,
                                     sidecar_cache_root=contenders.caches / "sidecars",
                                     index_cache_root=contenders.caches / "indexes")
        loader = make_loader(ds, batch_size=a.batch_size, num_workers=workers, worker_init_fn=init)
    else:
        ds = MapStyleFrames(contenders.facts)
        loader = DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=workers, worker_init_fn=init,
                            generator=torch.Generator().manual_seed(SEED))
    n = sum(len(b["index"]) for b in loader)
    print(f"{which}: {n} samples in {time.perf_counter() - t0:.2f} s; profiles in {out}")
    del loader
    gc.collect()
    time.sleep(1)
    for f in sorted(out.glob("*.prof")):
        print(f"\n== {f.name} (all threads, cumulative over threads) ==")
        pstats.Stats(str(f)).sort_stats("tottime").print_stats(18)


# -- main -------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--lengths", default="40-80", help="episode lengths, min-max frames (default 40-80)")
    ap.add_argument("--size", default="256x192", help="frame size WxH (default 256x192)")
    ap.add_argument("--episodes-per-file", type=int, default=8)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pid-bench-lerobot")
    ap.add_argument("--no-http", action="store_true", help="skip the http:// row")
    ap.add_argument("--profile", choices=("ours", "peer"))
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.lower().split("x"))
    lengths = tuple(int(x) for x in args.lengths.split("-"))

    root = make_dataset(args.work_dir, episodes=args.episodes, lengths=lengths, size=size,
                        per_file=args.episodes_per_file, fps=args.fps)
    facts = DatasetFacts(root)
    caches = root.parent / "cache"
    _data.warm([*facts.data_files, *facts.video_files, *(root / "meta").glob("**/*.*")])
    contenders = Contenders(facts, args, caches)
    # The sidecar and compact index, built once (untimed): the warm case a job's second start sees.
    StreamingLeRobotDataset(REPO, root=str(root), sidecar_cache_root=caches / "sidecars",
                            index_cache_root=caches / "indexes")
    if args.profile:
        profile(contenders, args.profile, args.workers)
        return

    minimum = facts.gop_aligned_minimum()
    names = ["ours", "ours + window (info)", "peer", "peer, open containers (info)", "peer, tuned (info)"]
    rounds: dict[str, list[Run]] = {n: [] for n in names}
    cold: list[Run] = []
    for r in range(args.repeat):
        this = {
            "ours": contenders.ours(keep=r == 0),
            "ours + window (info)": contenders.ours(window=True, name="ours + window (info)"),
            "peer": contenders.peer(keep=r == 0),
            "peer, open containers (info)": contenders.peer(keep_open=True, name="peer, open containers (info)"),
            "peer, tuned (info)": contenders.peer(tuned=True, name="peer, tuned (info)"),
        }
        fresh = Path(tempfile.mkdtemp(prefix="bench-lerobot-cold-"))
        try:
            cold.append(contenders.ours(cache=fresh, name="ours, cold sidecar (info)"))
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
        if r == 0:
            check_first_round(facts, this)
        for n, run in this.items():
            run.kept.clear()
            rounds[n].append(run)
        print(f"[round {r + 1}/{args.repeat}] " + ", ".join(f"{n} {run.epoch_s:.2f} s" for n, run in this.items()))
    http = None if args.no_http else http_run(contenders)
    report(facts, rounds, cold, minimum, http, args)


def http_run(contenders: Contenders) -> Run:
    from tests.support.http_server import RangeHTTPServer

    server = RangeHTTPServer(contenders.facts.root).start()
    try:
        contenders.ours(root=server.url)  # untimed: builds the sidecar of this root in the cache
        return contenders.ours(root=server.url, name="ours over http:// (info)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
