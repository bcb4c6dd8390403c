"""Shard writing: our ``write_shards`` (1 and 2 workers) against GNU ``tar -cf`` on the same tars.

    python bench/bench_shard_write.py [--size-mb 1024] [--shard-mb 64] [--repeat 5] [--work-dir DIR]
                                      [--no-fsync-row] [--profile {ours1,ours2,tar}]

A raw drop of real photographs (scikit-image's bundled ones, cropped to the 8 aspect ratios,
resized, given film grain and re-encoded at several JPEG qualities, plus a few PNGs; 100 KB - 3 MB
each, replicated under new names with distinct bytes) with JSON captions and float16 ``.npy``
embeddings is generated once and cached in the work folder. Intake and planning run once,
untimed. Then, over the same planned shards, each contender writes every tar of every shard into
a fresh output folder:

* ``ours, 1 worker``  - ``pid_platform.sharding.write.tars.write_shards(num_workers=1)``
* ``ours, 2 workers`` - the same with ``num_workers=2``
* ``GNU tar -cf``     - one ``tar -cf <tar> -C <modality folder> -T <list>`` per tar, run one
  after another, with the same member names in the same order (headers normalised with
  ``--format=ustar --owner=0 --group=0 --numeric-owner --mtime=@0 --mode=0644``)
* ``GNU tar -cf + fsync (info)`` - the same plus ``sync <tar>`` after each tar: what durability
  costs GNU tar. Informational, no target: like GNU tar, our writer leaves tars in the page cache;
  the build fsyncs the staged version's files once, at its commit point.

Every input file is read once before each run so the page cache is equally warm for every
contender; outputs are deleted and ``sync`` is run before each run. One untimed warm-up round
(first touch of page-cache memory, forkserver start) also checks the output: ours with 1 and 2
workers must be byte-identical, and GNU tar's tars must hold the same members, data, padding and
sizes, with headers differing at most in devmajor/devminor. Then ``--repeat`` timed rounds,
contenders round-robin; the best time is reported with the median beside it.

Targets: ours with 1 worker >= 1.0x GNU tar; ours with 2 workers faster than GNU tar. A miss is
printed as MISS; the exit status does not depend on it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from loader.formats.twin_tar import iter_member_headers, tar_path
from pid_platform.sharding.intake.task import intake
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan, plan_shards
from pid_platform.sharding.plan.tables import table_samples
from pid_platform.sharding.storage import LocalSourceStore
from pid_platform.sharding.write.tars import write_shards

# numpy, Pillow and the photographs are imported only to generate the drop: worker processes
# (forkserver) re-import this file, and their start-up should cost what it costs in a build.

SOURCE = "bench"
DROP_VERSION = 1  # bump when the generated drop changes
PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
    "camera", "moon", "brick", "grass", "coins", "clock", "cat", "colorwheel",
)
RATIOS = ((21, 9), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16))
LONG_SIDES = (720, 1024, 1600, 2048, 2560, 3200)
QUALITIES = (70, 80, 88, 92, 95)
MIN_IMAGE, MAX_IMAGE = 100_000, 3_000_000
POOL = 120  # distinct encodings; the drop replicates them under new names with distinct bytes


# ---------------------------------------------------------------- the raw drop


def _grain(im, sigma: float, rng):
    """Sensor-like noise: upscaled photographs are too smooth to encode to realistic sizes."""
    import numpy as np
    from PIL import Image

    a = np.asarray(im, dtype=np.int16)
    a = a + rng.normal(0.0, sigma, a.shape).astype(np.int16)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def _pool(rng: random.Random) -> list[tuple[str, str, bytes]]:
    """(stem prefix, ext, encoded bytes) of distinct images, each between 100 KB and 3 MB."""
    import numpy as np
    from PIL import Image

    from pid_platform.demo.sample_data import center_crop, load_photo

    photos = {name: load_photo(name) for name in PHOTOS}
    nrng = np.random.default_rng(1234)
    out: list[tuple[str, str, bytes]] = []
    attempts = 0
    while len(out) < POOL:
        attempts += 1
        if attempts > POOL * 20:
            raise RuntimeError("could not generate images in the size range; check Pillow")
        photo = rng.choice(PHOTOS)
        rw, rh = rng.choice(RATIOS)
        png = rng.random() < 0.08
        long_side = rng.choice((480, 640, 800)) if png else rng.choice(LONG_SIDES)
        w, h = (long_side, long_side * rh // rw) if rw >= rh else (long_side * rw // rh, long_side)
        im = center_crop(photos[photo], rw, rh).resize((w, h), Image.LANCZOS)
        im = _grain(im, rng.choice((1.5, 3.0, 5.0)), nrng)
        buf = io.BytesIO()
        if png:
            im.save(buf, "PNG", compress_level=6)
            ext = "png"
        else:
            im.save(buf, "JPEG", quality=rng.choice(QUALITIES))
            ext = "jpg"
        data = buf.getvalue()
        if MIN_IMAGE <= len(data) <= MAX_IMAGE:
            out.append((f"{photo.replace('_', '')}-{rw}x{rh}-{w}x{h}", ext, data))
    return out


def _tag_jpeg(data: bytes, text: bytes) -> bytes:
    # A COM segment right after SOI: a valid JPEG with distinct bytes.
    assert data[:2] == b"\xff\xd8"
    return data[:2] + b"\xff\xfe" + struct.pack(">H", len(text) + 2) + text + data[2:]


def _tag_png(data: bytes, text: bytes) -> bytes:
    # A tEXt chunk after IHDR (8-byte signature + 25-byte IHDR chunk).
    body = b"Comment\0" + text
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return data[:33] + chunk + data[33:]


def make_drop(raw: Path, size_mb: int) -> dict:
    """Write ``raw/<SOURCE>/{image,caption,umt5}`` totalling about ``size_mb`` MB."""
    import numpy as np

    src = raw / SOURCE
    if src.exists():
        shutil.rmtree(src)
    for m in ("image", "caption", "umt5"):
        (src / m).mkdir(parents=True)
    rng = random.Random(42)
    t0 = time.perf_counter()
    pool = _pool(rng)
    print(f"  {len(pool)} distinct encodings in {time.perf_counter() - t0:.1f}s", flush=True)
    erng = np.random.default_rng(7)
    target = size_mb * 1_000_000
    total = n = 0
    sizes = []
    while total < target:
        prefix, ext, data = pool[rng.randrange(len(pool))]
        stem = f"{prefix}-{n:06d}"
        tag = f"pid-bench {stem}".encode()
        img = _tag_jpeg(data, tag) if ext == "jpg" else _tag_png(data, tag)
        (src / "image" / f"{stem}.{ext}").write_bytes(img)
        cap = json.dumps({
            "prompt": f"A grainy photograph ({prefix.split('-')[0]}), sample {n}, {len(img)} bytes, "
                      f"re-encoded for the shard-writing benchmark.",
            "prompt_medium": f"Photograph {prefix}.",
            "prompt_short": prefix.split("-")[0],
        }).encode()
        (src / "caption" / f"{stem}.json").write_bytes(cap)
        emb = erng.standard_normal((rng.randint(16, 120), 256)).astype(np.float16)
        with open(src / "umt5" / f"{stem}.npy", "wb") as fh:
            np.save(fh, emb)
        total += len(img) + len(cap) + (src / "umt5" / f"{stem}.npy").stat().st_size
        sizes.append(len(img))
        n += 1
    return {"version": DROP_VERSION, "size_mb": size_mb, "samples": n, "bytes": total,
            "image_min": min(sizes), "image_median": int(statistics.median(sizes)), "image_max": max(sizes)}


def ensure_drop(work: Path, size_mb: int) -> dict:
    raw = work / "raw"
    stamp = work / "drop.json"
    try:
        info = json.loads(stamp.read_text())
        if info.get("version") == DROP_VERSION and info.get("size_mb") == size_mb and (raw / SOURCE).is_dir():
            print(f"raw drop: cached at {raw / SOURCE}")
            return info
    except (OSError, ValueError):
        pass
    print(f"raw drop: generating ~{size_mb} MB at {raw / SOURCE} (once) ...", flush=True)
    t0 = time.perf_counter()
    stamp.unlink(missing_ok=True)
    info = make_drop(raw, size_mb)
    stamp.write_text(json.dumps(info))  # written last: a half-made drop is regenerated
    print(f"  done in {time.perf_counter() - t0:.1f}s")
    return info


# ---------------------------------------------------------------- contenders


def warm_cache(plans: list[ShardPlan]) -> int:
    n = 0
    for p in plans:
        for s in p.samples:
            for f in s.files.values():
                with open(f.local_path, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        n += len(chunk)
    return n


def write_lists(plans: list[ShardPlan], lists: Path) -> list[tuple[Path, Path, Path]]:
    """Per tar: (file list, modality folder, tar path relative to the output folder)."""
    jobs = []
    for p in plans:
        for m in p.modalities:
            names = []
            folder = None
            for member, s in p.members(m):
                f = s.files[m]
                if f.name != member:
                    raise SystemExit(
                        f"bench drop: {m}/{f.name} becomes member {member}; GNU tar would need --transform. "
                        "Delete the work folder and regenerate the drop."
                    )
                names.append(f.name)
                folder = Path(f.local_path).parent
            rel = tar_path(Path("."), p.bucket, m, p.relpath)
            lst = lists / f"{p.bucket or '_flat'}-{m}-{p.index:06d}.txt"
            lst.parent.mkdir(parents=True, exist_ok=True)
            lst.write_text("".join(n + "\n" for n in names))
            jobs.append((lst, folder, rel))
    return jobs


TAR_FLAGS = ("--format=ustar", "--owner=0", "--group=0", "--numeric-owner", "--mtime=@0", "--mode=0644")


def run_gnu_tar(jobs: list[tuple[Path, Path, Path]], out: Path, fsync: bool = False) -> None:
    for lst, folder, rel in jobs:
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-cf", str(dest), *TAR_FLAGS, "-C", str(folder), "-T", str(lst)], check=True)
        if fsync:
            subprocess.run(["sync", str(dest)], check=True)  # coreutils: fsync(2) of that file


def fresh(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.sync()  # no writeback of an earlier run's output overlaps the next timed run


def tar_digests(out: Path, plans: list[ShardPlan]) -> dict[str, str]:
    d = {}
    for p in plans:
        for m in p.modalities:
            path = tar_path(out, p.bucket, m, p.relpath)
            d[str(path.relative_to(out))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return d


# Header fields GNU tar fills differently from ours: the checksum (it covers the others) and
# devmajor/devminor, which GNU tar writes as octal zeros and we (like CPython) leave NUL.
_MASKED = ((148, 156), (329, 345))


def compare_with_gnu(ours: Path, gnu: Path, plans: list[ShardPlan]) -> str:
    """Same members, sizes, data and padding; returns how the header bytes compare."""
    differ = 0
    for p in plans:
        for m in p.modalities:
            a = tar_path(ours, p.bucket, m, p.relpath).read_bytes()
            b = tar_path(gnu, p.bucket, m, p.relpath).read_bytes()
            ha = iter_member_headers(tar_path(ours, p.bucket, m, p.relpath))
            hb = iter_member_headers(tar_path(gnu, p.bucket, m, p.relpath))
            if len(a) != len(b) or ha != hb:
                raise SystemExit(f"{p.bucket}/{m}/{p.relpath}: GNU tar and ours disagree on members, sizes or "
                                 "tar size; the comparison would be unfair")
            if a == b:
                continue
            differ += 1
            ma, mb = bytearray(a), bytearray(b)
            for _n, off, _sz in ha:
                for lo, hi in _MASKED:
                    ma[off + lo : off + hi] = mb[off + lo : off + hi] = bytes(hi - lo)
            if ma != mb:
                raise SystemExit(f"{p.bucket}/{m}/{p.relpath}: GNU tar and ours differ beyond devmajor/devminor")
    if not differ:
        return "byte-identical"
    return "identical except devmajor/devminor (GNU tar: octal zeros, ours: NUL) and so the header checksum"


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="raw drop size in MB (default 1024)")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pid-bench-shard-write")
    ap.add_argument("--shard-mb", type=float, default=64.0, help="max_shard_size_mb of the plan (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds (default 5), after one untimed warm-up round")
    ap.add_argument("--no-fsync-row", action="store_true", help="skip the informational 'GNU tar + fsync' row")
    ap.add_argument("--profile", choices=("ours1", "ours2", "tar"), help="cProfile one run of a contender and exit")
    args = ap.parse_args(argv)
    if shutil.which("tar") is None:
        raise SystemExit("GNU tar not found on PATH")
    work: Path = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    info = ensure_drop(work, args.size_mb)
    print(f"  {info['samples']} samples, {info['bytes'] / 1e6:.0f} MB; images {info['image_min'] / 1e3:.0f} KB / "
          f"{info['image_median'] / 1e3:.0f} KB / {info['image_max'] / 1e6:.2f} MB (min / median / max)")

    store = LocalSourceStore(work / "raw")
    t0 = time.perf_counter()
    table, report, _ = intake(store, SOURCE, num_workers=os.cpu_count() or 1)
    samples = table_samples(table)
    if report.dropped_total:
        print(f"  warning: intake dropped {report.dropped_total} samples: {dict(report.dropped)}")
    config = ShardingConfig(max_shard_size_mb=args.shard_mb)
    plans = plan_shards(samples, report.modalities, config)
    out_bytes = sum(p.total_bytes for p in plans)
    ntars = sum(len(p.modalities) for p in plans)
    print(f"intake + plan (untimed): {time.perf_counter() - t0:.1f}s; {len(samples)} samples -> {len(plans)} shards, "
          f"{ntars} tars, {out_bytes / 1e6:.0f} MB of tar ({args.shard_mb:g} MB bound, "
          f"{len({p.bucket for p in plans})} aspect buckets)")

    jobs = write_lists(plans, work / "lists")
    contenders = {
        "ours1": ("ours, 1 worker", lambda o: write_shards(store, SOURCE, o, plans, num_workers=1)),
        "ours2": ("ours, 2 workers", lambda o: write_shards(store, SOURCE, o, plans, num_workers=2)),
        "tar": ("GNU tar -cf", lambda o: run_gnu_tar(jobs, o)),
    }
    if not args.no_fsync_row:
        contenders["tarsync"] = ("GNU tar -cf + fsync (info)", lambda o: run_gnu_tar(jobs, o, fsync=True))
    outs = {k: work / f"out-{k}" for k in contenders}
    t0 = time.perf_counter()
    n = warm_cache(plans)
    print(f"page cache warmed: read {n / 1e6:.0f} MB of inputs in {time.perf_counter() - t0:.1f}s")

    if args.profile:
        import cProfile
        import pstats

        out = outs[args.profile]
        fresh(out)
        contenders[args.profile][1](out)  # warm-up, as in a timed round
        fresh(out)
        warm_cache(plans)
        prof = cProfile.Profile()
        prof.enable()
        contenders[args.profile][1](out)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        fresh(out)
        return 0

    # Round 0 warms up (first-touch of page-cache memory, the forkserver process) and checks
    # the output; rounds 1..repeat are timed. Contenders alternate so drift hits them alike.
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for rnd in range(args.repeat + 1):
        for key, (_label, fn) in contenders.items():
            out = outs[key]
            fresh(out)
            warm_cache(plans)  # the same warm state for every contender and every round
            t = time.perf_counter()
            fn(out)
            dt = time.perf_counter() - t
            if rnd:
                times[key].append(dt)
            elif key == "ours1":
                ref = tar_digests(out, plans)
            elif key == "ours2" and tar_digests(out, plans) != ref:
                raise SystemExit("ours with 2 workers wrote different bytes than with 1 worker")
        if rnd == 0:
            how = compare_with_gnu(outs["ours2"], outs["tar"], plans)
            print(f"check: ours, 1 and 2 workers: byte-identical; vs GNU tar: same members, data, padding and "
                  f"tar sizes; headers {how}")
        else:
            print(f"round {rnd}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in contenders), flush=True)
    for out in outs.values():
        fresh(out)

    best = {k: min(v) for k, v in times.items()}
    tar_s = best["tar"]
    print()
    print(f"shard writing: {out_bytes / 1e6:.0f} MB in {ntars} tars ({len(plans)} shards), {os.cpu_count()} CPUs; "
          f"best and median of {args.repeat} rounds; MB/s = 10^6 bytes of tar per second of the best run; "
          f"vs tar = GNU tar seconds / contender seconds (> 1 is faster)")
    print(f"{'contender':<28}{'best s':>8}{'median s':>10}{'MB/s':>8}{'vs tar':>8}")
    for key, (label, _fn) in contenders.items():
        s = best[key]
        print(f"{label:<28}{s:>8.2f}{statistics.median(times[key]):>10.2f}{out_bytes / 1e6 / s:>8.0f}"
              f"{tar_s / s:>7.2f}x")
    print("(neither our writer nor plain GNU tar fsyncs per tar; the build fsyncs the staged files once, at its commit point)")
    r1, r2 = tar_s / best["ours1"], tar_s / best["ours2"]
    print()
    print(f"{'PASS' if r1 >= 1.0 else 'MISS'}: ours with 1 worker >= 1.0x GNU tar ({r1:.2f}x)")
    print(f"{'PASS' if r2 > 1.0 else 'MISS'}: ours with 2 workers faster than GNU tar ({r2:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
