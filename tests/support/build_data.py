"""Helpers shared by the build tests (no tests here): run a build, read back what it wrote.

The raw drop comes from the ``raw_root`` / ``photo_drop_template`` fixtures: source ``photos``
with ``image/``, ``caption/`` and ``umt5/`` folders of 32 real photographs.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from loader.formats.key_index import read_key_index
from loader.formats.twin_tar import TarMember, write_tar
from loader.formats.wdinfo import WDINFO_NAME, WdinfoManifest, read_wdinfo
from pid_platform.demo.sample_data import load_photo
from pid_platform.sharding.commit import versions
from pid_platform.sharding.commit.verify_output import (
    key_index_mismatches,
    manifest_mismatches,
    size_bound_violations,
    twin_key_mismatches,
)
from pid_platform.sharding.layout import STATE_DIR, state_dir
from pid_platform.sharding.pipeline import (
    BuildSummary,
    build_source,
    build_step,
    planned_results,
    stage_plan_files,
)
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.plan_files import PLAN
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.plan.tables import read_plans
from pid_platform.sharding.storage import LocalSourceStore, SourceStore
from pid_platform.sharding.tasks.write import FolderTarget, write_range
from pid_platform.sharding.write.tars import ShardResult

SOURCE = "photos"
MODALITIES = ["caption", "image", "umt5"]
CLEAN_SAMPLES = 32
# Small enough that the 32 photographs (2.6 MB) make several shards per bucket.
SMALL_BOUND_MB = 0.25


def stem_of(name: str) -> str:
    """A raw file's basename, as ``listing.stems`` computes it for a column of names."""
    return name.rsplit(".", 1)[0] if "." in name else name


def build(raw_root: Path, out: Path, *, num_workers: int = 1, trust_pickle: bool = False,
          validate: str = "full", revalidate: bool = False, **cfg) -> BuildSummary:
    config = ShardingConfig(**({"max_shard_size_mb": SMALL_BOUND_MB} | cfg))
    return build_source(
        LocalSourceStore(raw_root), SOURCE, out, config, num_workers=num_workers, trust_pickle=trust_pickle,
        validate=validate, revalidate=revalidate,
    )


def load_plans(folder: Path, config: ShardingConfig) -> list[ShardPlan]:
    """Every shard of ``folder``'s plan with its samples, all at once (a test's small build; a
    build step streams them: ``plan_files.iter_shard_plans``, ``iter_shard_range``)."""
    return read_plans(state_dir(folder) / PLAN, config.part_size)


@build_step
def run_sharding(store: SourceStore, source: str, out: Path, config: ShardingConfig, *,
                 num_workers: int) -> tuple[list[ShardRef], list[ShardResult]]:
    """Plan the staged samples (``stage_plan_files``), then write every planned shard's tars as
    write task 0 of 1 does (``tasks.write.write_range``), without key indexes (``run_key_indexes``)
    or record: the build's steps one by one, for a test that stops or changes things between them."""
    stage_plan_files(store, source, out, config)
    target = FolderTarget(out, versions.staging_dir(out), key_indexes=False)
    _found, written = write_range(store, source, target, target.shards, 0, len(target.shards),
                                  num_workers=num_workers, progress=None)
    return target.shards, planned_results(target.shards, set(written).__contains__)


def plans_of(out: Path, **cfg) -> list[ShardPlan]:
    return load_plans(out, ShardingConfig(**({"max_shard_size_mb": SMALL_BOUND_MB} | cfg)))


def output_files(out: Path) -> dict[str, bytes]:
    """Every file of the output contract (the build's private state folder left out)."""
    files = {}
    for dirpath, dirs, names in os.walk(out):
        dirs[:] = sorted(d for d in dirs if d != STATE_DIR)
        for n in names:
            p = Path(dirpath) / n
            files[p.relative_to(out).as_posix()] = p.read_bytes()
    return dict(sorted(files.items()))


def manifests(out: Path) -> list[WdinfoManifest]:
    return [read_wdinfo(p) for p in sorted(out.rglob(WDINFO_NAME)) if STATE_DIR not in p.parts]


def index_rows(out: Path) -> list[dict]:
    """Key-index rows of every tar, in manifest order, each with ``manifest`` and ``tar`` added."""
    rows = []
    for man in manifests(out):
        for t in man.tars:
            assert t.key_index is not None
            table = read_key_index(Path(man.manifest_dir) / t.key_index).to_pylist()
            rows += [r | {"manifest": man, "tar": t.path} for r in table]
    return rows


def all_problems(out: Path, **cfg) -> list[str]:
    """Everything ``verify_output.py`` finds wrong with a build's output."""
    config = ShardingConfig(**({"max_shard_size_mb": SMALL_BOUND_MB} | cfg))
    plans = load_plans(out, config)
    buckets = sorted({p.bucket for p in plans})
    return (
        twin_key_mismatches(out, plans)
        + size_bound_violations(out, plans, config)
        + manifest_mismatches(out, buckets)
        + key_index_mismatches(out, buckets)
    )


def source_file(raw_root: Path, modality: str, basename: str) -> Path:
    """The raw file of ``basename`` in ``modality`` (whatever its extension)."""
    folder = raw_root / SOURCE / modality
    hits = [folder / n for n in os.listdir(folder) if stem_of(n) == basename]
    assert len(hits) == 1, (modality, basename, hits)
    return hits[0]


def accounted(raw_root: Path, summary: BuildSummary) -> tuple[set[str], set[str], set[str]]:
    """(stems on disk, stems kept, stems the report names as dropped): nothing lost silently."""
    seen = set()
    for m in os.listdir(raw_root / SOURCE):
        folder = raw_root / SOURCE / m
        seen |= {stem_of(n) for n in os.listdir(folder) if not n.startswith(".")}
    kept = {r["basename"] for r in index_rows(summary.out)}
    dropped = {ex for reason in summary.report.dropped for ex in summary.report.examples[reason]}
    return seen, kept, dropped


def assert_nothing_lost(raw_root: Path, summary: BuildSummary) -> None:
    seen, kept, dropped = accounted(raw_root, summary)
    assert kept.isdisjoint(dropped)
    assert seen == kept | dropped, f"unaccounted stems: {sorted(seen - kept - dropped)}"
    assert summary.report.samples == len(kept) == summary.samples


def jpeg_bytes(im: Image.Image, exif_orientation: int | None = None, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    kw = {}
    if exif_orientation:
        ex = Image.Exif()
        ex[0x0112] = exif_orientation
        kw["exif"] = ex.tobytes()
    im.save(buf, "JPEG", quality=quality, **kw)
    return buf.getvalue()


def photo(name: str = "astronaut", size: tuple[int, int] | None = None) -> Image.Image:
    im = load_photo(name)
    return im.resize(size) if size else im


def add_sample(
    raw_root: Path, stem: str, *, image: bytes | None = None, image_ext: str = "jpg",
    caption: dict | bytes | None = None, embedding: np.ndarray | None = None,
    modalities: tuple[str, ...] = ("image", "caption", "umt5"),
) -> None:
    """Write one sample's files (real photograph defaults) into the modalities named."""
    src = raw_root / SOURCE
    if "image" in modalities:
        data = image if image is not None else jpeg_bytes(photo(size=(96, 96)))
        (src / "image" / f"{stem}.{image_ext}").write_bytes(data)
    if "caption" in modalities:
        doc = caption if caption is not None else {"prompt": f"a photograph called {stem}"}
        (src / "caption" / f"{stem}.json").write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    if "umt5" in modalities:
        np.save(src / "umt5" / f"{stem}.npy", embedding if embedding is not None else np.zeros((8, 64), np.float16))


def reverse_members_in_place(path: Path) -> None:
    """Overwrite a tar with its members in reverse order, keeping its size, inode and mtime: keys
    out of step in a way no stamp can see (the build itself never writes a file in place)."""
    with tarfile.open(path) as tf:
        members = [TarMember(i.name, i.size, data=tf.extractfile(i).read()) for i in tf if i.isfile()]
    st = path.stat()
    scratch = path.with_name("scratch")
    write_tar(scratch, members[::-1])
    data = scratch.read_bytes()
    scratch.unlink()
    assert len(data) == st.st_size and len(members) > 1
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under ``folder`` (build state included): bytes, mtime and inode."""
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino)
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def rewrite_same_size(path: Path, data: bytes, *, atomic: bool) -> None:
    """Give ``path`` new bytes of the same size and put its old mtime back: only the ctime (and,
    for ``atomic``, the inode) can tell. In place: written through the open file; atomic: a new
    file renamed over the old name, as most tools save."""
    st = path.stat()
    assert len(data) == st.st_size and data != path.read_bytes()
    if atomic:
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(data)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, path)
    else:
        with open(path, "r+b") as fh:
            fh.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def corrupt_jpeg_same_size(data: bytes) -> bytes:
    """A JPEG whose header is intact and whose second half is gone (0xFF fill, same size): a
    header check passes, a full decode fails."""
    half = len(data) // 2
    return data[:half] + b"\xff" * (len(data) - half)
