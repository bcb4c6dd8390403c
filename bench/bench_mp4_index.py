"""MP4 indexing from boxes (``loader.lerobot.mp4.index_mp4``) against a full PyAV demux.

    python bench/bench_mp4_index.py [--frames 3000] [--episodes 10] [--size 320x240]
                                    [--codec {libsvtav1,libx264}] [--repeat 5] [--work-dir DIR]

Data: one MP4 in the LeRobot v3 shape: ``--episodes`` episodes of ``--frames / --episodes`` frames
each appended into one file (a keyframe forced at each episode start, faststart), real-looking
frames (a pan across scikit-image photographs, ``tests.support.video.photo_frames``), encoded with
``--codec`` (libsvtav1 g=2, LeRobot's default; or libx264 g=12 with 2 B-frames); plus the same
frames as one episode with ``moov`` at the end. Encoded once and cached in the work folder; read
once before timing (warm page cache).

Contenders, per file, round-robin for ``--repeat`` rounds (best run, median beside it):

* ``index_mp4``  - box headers, ``ftyp`` and ``moov`` by range reads; per-sample arrays
* ``PyAV demux`` - ``av.open(path)`` then ``container.demux(video)`` reading every packet (what an
  index built by demuxing costs: it reads the whole file)

Bytes read: ``Mp4Index.bytes_read`` for ours; for PyAV, one extra (untimed) demux through a file
object that counts what FFmpeg reads. Checked once: both agree on every packet's offset and size.
One more row (information only): ``index_mp4`` over HTTP from a local range server (127.0.0.1),
with its request count.

Targets: index bytes / file size < 1%; ``index_mp4`` faster than the demux (ratio = demux seconds /
index seconds). A miss prints MISS; the exit status does not depend on it.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import av  # noqa: E402
import numpy as np  # noqa: E402

from loader.lerobot.mp4 import index_mp4  # noqa: E402

DATA_VERSION = 1
BYTES_TARGET = 0.01
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")


class CountingFile(io.RawIOBase):
    """A read-only file that counts the bytes handed to FFmpeg."""

    def __init__(self, path: Path):
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._f.readinto(buffer)
        self.bytes_read += n or 0
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()
        super().close()


def make_videos(work: Path, frames: int, episodes: int, size: tuple[int, int], codec: str, log=print) -> list[Path]:
    from pid_platform.demo.sample_video import encode_mp4, photo_frames

    stamp = {"v": DATA_VERSION, "frames": frames, "episodes": episodes, "size": list(size), "codec": codec}
    folder = work / f"{codec}-{frames}f-{episodes}e-{size[0]}x{size[1]}"
    files = [folder / "episodes-faststart.mp4", folder / "single-moov-at-end.mp4"]
    done = folder / ".bench-done.json"
    if done.is_file() and json.loads(done.read_text()) == stamp and all(f.is_file() for f in files):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    per = frames // episodes
    log(f"encoding {frames} frames at {size[0]}x{size[1]} with {codec} (once; cached in {folder}) ...")
    t0 = time.perf_counter()
    eps = [photo_frames(per, size, photo=PHOTOS[e % len(PHOTOS)], start=e * per) for e in range(episodes)]
    kw = {"codec": codec, "gop": 2} if codec == "libsvtav1" else {"codec": codec, "gop": 12, "bframes": 2}
    encode_mp4(files[0], eps, fps=30, faststart=True, **kw)
    encode_mp4(files[1], [f for ep in eps for f in ep], fps=30, faststart=False, **kw)
    done.write_text(json.dumps(stamp))
    log(f"  done in {time.perf_counter() - t0:.1f} s")
    return files


def run_index(path: Path) -> int:
    return index_mp4(path).num_samples


def run_demux(path: Path) -> int:
    n = 0
    with av.open(str(path)) as container:
        for packet in container.demux(container.streams.video[0]):
            n += packet.size > 0
    return n


def demux_bytes(path: Path) -> tuple[int, list[tuple[int, int]]]:
    f = CountingFile(path)
    try:
        with av.open(f, "r") as container:
            packets = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
        return f.bytes_read, packets
    finally:
        f.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=3000, help="frames in the file (default 3000)")
    ap.add_argument("--episodes", type=int, default=10, help="episodes appended into it (default 10)")
    ap.add_argument("--size", default="320x240", help="frame size WxH (default 320x240)")
    ap.add_argument("--codec", choices=("libsvtav1", "libx264"), default="libsvtav1")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per contender (default 5)")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pid-bench-mp4")
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.lower().split("x"))

    files = make_videos(args.work_dir, args.frames, args.episodes, size, args.codec)
    worst_bytes, worst_time = 0.0, float("inf")
    for path in files:
        file_size = path.stat().st_size
        path.read_bytes()  # warm the page cache for both
        ix = index_mp4(path)
        pyav_bytes, packets = demux_bytes(path)
        assert np.array_equal(ix.sample_offsets, [p for p, _ in packets]), "offsets disagree"
        assert np.array_equal(ix.sample_sizes, [s for _, s in packets]), "sizes disagree"

        times: dict[str, list[float]] = {"index_mp4": [], "PyAV demux": []}
        for _ in range(args.repeat):
            for name, fn in (("index_mp4", run_index), ("PyAV demux", run_demux)):
                t0 = time.perf_counter()
                n = fn(path)
                times[name].append(time.perf_counter() - t0)
                assert n == ix.num_samples

        best = {k: min(v) for k, v in times.items()}
        print(f"\n{path.name}: {file_size / 1e6:.2f} MB, {ix.num_samples} samples, {ix.codec} "
              f"{ix.width}x{ix.height}, {len(ix.sync_samples)} sync, moov {ix.moov[1] / 1e3:.1f} KB at {ix.moov[0]}")
        for name, read in (("index_mp4", ix.bytes_read), ("PyAV demux", pyav_bytes)):
            print(f"  {name:11s} best {best[name] * 1e3:8.2f} ms (median {statistics.median(times[name]) * 1e3:8.2f})"
                  f"  read {read:>10,d} B = {read / file_size:8.4%} of the file")
        ratio_t = best["PyAV demux"] / best["index_mp4"]
        ratio_b = ix.bytes_read / file_size
        print(f"  time ratio (demux / index): {ratio_t:.1f}x   bytes ratio (index / file size): {ratio_b:.4%} "
              f"(index / demux bytes: {ix.bytes_read / pyav_bytes:.4%}; {ix.requests} range reads)")
        print(f"  http      {_http_row(path, ix)}")
        print(f"  sidecar   {_compact_row(ix)}")
        worst_bytes, worst_time = max(worst_bytes, ratio_b), min(worst_time, ratio_t)

    print()
    print(f"{'PASS' if worst_bytes < BYTES_TARGET else 'MISS'}: index bytes < {BYTES_TARGET:.0%} of the file "
          f"(worst {worst_bytes:.4%})")
    print(f"{'PASS' if worst_time > 1 else 'MISS'}: index_mp4 faster than a full PyAV demux (worst {worst_time:.1f}x)")


def _compact_row(ix) -> str:
    """Bytes of this file's sidecar arrays: NPZ schema v3 (int64/float64) vs the compact index."""
    from loader.lerobot.sidecar.compact import encode_arrays

    arrays = {
        "sample_pts": ix.sample_pts, "sample_durations": ix.sample_durations,
        "sample_composition_offsets": ix.sample_composition_offsets, "sample_sizes": ix.sample_sizes,
        "sample_offsets": ix.sample_offsets, "sync_samples": ix.sync_samples,
    }
    wide = sum(np.asarray(a).nbytes for a in arrays.values())
    specs, payloads = encode_arrays(arrays)
    compact = sum(p.nbytes for p in payloads)
    kinds = ", ".join(f"{k.removeprefix('sample_')}={v.get('dtype', 'range')}" for k, v in specs.items())
    return f"int64 arrays {wide:,d} B -> compact {compact:,d} B ({compact / wide:.1%}; {kinds})"


def _http_row(path: Path, local) -> str:
    from tests.support.http_server import RangeHTTPServer

    server = RangeHTTPServer(path.parent).start()
    try:
        url = server.url_for(path.name)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            ix = index_mp4(url)
            walls.append(time.perf_counter() - t0)
        assert np.array_equal(ix.sample_offsets, local.sample_offsets)
        return (f"index_mp4 over HTTP (127.0.0.1): best {min(walls) * 1e3:.2f} ms, {ix.requests} requests, "
                f"{ix.bytes_read:,d} B")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
