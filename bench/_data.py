"""Data helpers shared by ``bench_loader_sync.py`` and ``bench_manifest_parse.py``.

* :func:`twin_dataset` - a built twin-tar dataset (image / caption / umt5) of about ``samples``
  samples, made from scikit-image's photographs (``pid_platform.demo.sample_data``) replicated under new
  names, built with ``pid_platform.sharding.pipeline.build_source``; cached in the work folder.
* :func:`combined_tars` - the same shards as *one* plain WebDataset tar each (members
  ``<key>.image.<ext>``, ``<key>.caption.json``, ``<key>.umt5.npy`` in sample order, the same bytes).
* :func:`warm` - read files once so the page cache is warm for every contender.
* :func:`synthetic_manifests` - a folder of wdinfo.json manifests listing many (non-existent) tars.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tarfile
from collections.abc import Iterable
from pathlib import Path

DATA_VERSION = 1  # bump when what is generated changes
MODALITIES = ("image", "caption", "umt5")
SOURCE = "photos"


def _done(folder: Path, stamp: dict) -> bool:
    f = folder / ".bench-done.json"
    return f.is_file() and json.loads(f.read_text()) == stamp


def _mark(folder: Path, stamp: dict) -> None:
    (folder / ".bench-done.json").write_text(json.dumps(stamp))


def twin_dataset(work: Path, samples: int, shard_mb: float, *, num_workers: int = 2, log=print) -> Path:
    """Output folder of a build (``<out>/<bucket>/<modality>/part_*/*.tar`` + wdinfo.json)."""
    from pid_platform.demo.sample_data import make_sample_source
    from pid_platform.sharding.pipeline import build_source
    from pid_platform.sharding.plan.shard_plan import ShardingConfig
    from pid_platform.sharding.storage import open_source_store

    stamp = {"v": DATA_VERSION, "samples": samples, "shard_mb": shard_mb}
    folder = work / f"twin-n{samples}-s{shard_mb:g}"
    if _done(folder, stamp):
        return folder / "out"
    if folder.exists():
        shutil.rmtree(folder)
    base = folder / "base"
    log(f"[data] generating the photographs (scikit-image) under {base}")
    make_sample_source(base, with_problems=False)
    stems = sorted(p.stem for p in (base / "caption").iterdir())
    image_ext = {p.stem: p.suffix for p in (base / "image").iterdir()}
    raw = folder / "raw" / SOURCE
    for m in MODALITIES:
        (raw / m).mkdir(parents=True)
    reps = -(-samples // len(stems))
    n = 0
    for r in range(reps):
        for stem in stems:
            if n == samples:
                break
            new = f"{stem}-r{r:04d}"
            for m, ext in (("image", image_ext[stem]), ("caption", ".json"), ("umt5", ".npy")):
                src = base / m / f"{stem}{ext}"
                dst = raw / m / f"{new}{ext}"
                try:
                    os.link(src, dst)  # same bytes, no extra disk
                except OSError:
                    shutil.copyfile(src, dst)
            n += 1
    log(f"[data] raw drop: {n} samples ({len(stems)} photographs x {reps} names); building twin tars "
        f"(max_shard_size_mb={shard_mb:g})")
    build_source(open_source_store(str(folder / "raw")), SOURCE, folder / "out",
                 ShardingConfig(max_shard_size_mb=shard_mb), num_workers=num_workers)
    shutil.rmtree(folder / "raw")
    shutil.rmtree(base)
    _mark(folder, stamp)
    return folder / "out"


def _iter_tar(path: str):
    with tarfile.open(path, "r:") as tf:
        for ti in tf:
            if ti.isfile():
                yield ti, tf.extractfile(ti).read()


def combined_tars(shards, dest: Path, modalities: tuple[str, ...] = MODALITIES) -> list[str]:
    """One plain WebDataset tar per shard of ``shards`` (a ShardTable), in the same order.

    Member ``i`` of every twin tar becomes ``<key>.<modality>.<ext>``, modality after modality,
    sample after sample; the bytes are the twins' own. Cached: rebuilt when the shard list changes.
    """
    stamp = {"v": DATA_VERSION, "fingerprint": shards.fingerprint(), "n": len(shards)}
    urls = [str(dest / f"{i:06d}.tar") for i in range(len(shards))]
    if _done(dest, stamp):
        return urls
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for shard, url in zip(shards, urls, strict=True):
        tmp = url + ".tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as out:
            iters = [_iter_tar(shard.url(m)) for m in modalities]
            for tup in zip(*iters, strict=True):
                key = tup[0][0].name.split(".", 1)[0]
                for m, (ti, data) in zip(modalities, tup, strict=True):
                    k, _, ext = ti.name.partition(".")
                    if k != key:
                        raise RuntimeError(f"{shard.path}: twin tars out of step ({k!r} vs {key!r})")
                    info = tarfile.TarInfo(f"{key}.{m}.{ext}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    out.addfile(info, _BytesReader(data))
        os.replace(tmp, url)
    _mark(dest, stamp)
    return urls


class _BytesReader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        out = self.data[self.pos : end]
        self.pos = end
        return out


def warm(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Read every file once (page cache); returns the bytes read."""
    total = 0
    for p in paths:
        with open(p, "rb") as fh:
            while chunk := fh.read(1 << 24):
                total += len(chunk)
    return total


def synthetic_manifests(work: Path, manifests: int, tars_per_manifest: int, *, seed: int = 0, log=print) -> Path:
    """``manifests`` wdinfo.json files (one per bucket leaf ``<src>/<bucket>/``) of ``tars_per_manifest``
    tars each, in our format (``loader.formats.wdinfo.write_wdinfo``): realistic paths, counts,
    per-modality byte sizes, sha256 digests and key-index paths. The tars themselves do not exist."""
    from loader.formats.twin_tar import BUCKET_NAMES, key_index_relpath, shard_relpath
    from loader.formats.wdinfo import TarEntry, WdinfoManifest, write_wdinfo

    stamp = {"v": DATA_VERSION, "manifests": manifests, "tars": tars_per_manifest, "seed": seed}
    folder = work / f"manifests-{manifests}x{tars_per_manifest}"
    if _done(folder, stamp):
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    log(f"[data] writing {manifests} manifests x {tars_per_manifest} tars under {folder}")
    rng = random.Random(seed)
    nb = len(BUCKET_NAMES)
    for j in range(manifests):
        source, bucket = f"source_{j // nb:04d}", BUCKET_NAMES[j % nb]
        tars = []
        for i in range(tars_per_manifest):
            rel = shard_relpath(i)
            count = rng.randint(800, 1200)
            tars.append(TarEntry(
                path=rel, count=count,
                bytes={"image": count * rng.randint(300_000, 700_000), "caption": count * 1536,
                       "umt5": count * 1_049_088},
                sha256={m: hashlib.sha256(f"{j}/{m}/{rel}".encode()).hexdigest() for m in MODALITIES},
                key_index=key_index_relpath(rel),
            ))
        man = WdinfoManifest(data_keys=list(MODALITIES), tars=tars, root=".",
                             chunk_size=max(t.count for t in tars), bucket=bucket, source=source)
        leaf = folder / source / bucket
        leaf.mkdir(parents=True, exist_ok=True)
        write_wdinfo(leaf, man)
    _mark(folder, stamp)
    return folder
