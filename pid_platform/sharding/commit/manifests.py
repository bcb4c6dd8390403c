"""Key indexes, then wdinfo.json per bucket, written into the staging folder before its commit."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from loader.formats.errors import FormatError
from loader.formats.key_index import KeyIndexRow, key_index_table, write_key_index
from loader.formats.layout import BUILD_OUTPUT_PATH
from loader.formats.twin_tar import (
    BLOCK,
    is_member_header,
    key_index_relpath,
    member_span,
    shard_relpath,
    tar_path,
)
from loader.formats.wdinfo import (
    WDINFO_NAME,
    TarEntry,
    WdinfoManifest,
    derive_chunk_size,
    manifest_root,
    write_wdinfo,
)
from pid_platform.sharding.layout import STATE_DIR, bucket_dir
from pid_platform.sharding.parallel import ordered_map
from pid_platform.sharding.plan.columnar import Shard
from pid_platform.sharding.plan.shard_plan import ShardPlan
from pid_platform.sharding.state_doc import load_state_doc
from pid_platform.sharding.write.tar_digests import tar_digests


def planned_headers(path: Path, plan: ShardPlan, modality: str) -> list[tuple[str, int, int]]:
    """``(name, header_offset, size)`` of each member of ``plan``'s tar for ``modality``, after
    checking the tar holds exactly those headers where the plan puts them, and nothing more.

    One 512-byte read per member at a known offset rather than a parse of every header in
    turn: the key index step costs milliseconds, not a Python tar parser per member.
    """
    headers, pos = [], 0
    with open(path, "rb") as fh:
        fd = fh.fileno()
        for name, s in plan.members(modality):
            size = s.files[modality].size
            if not is_member_header(os.pread(fd, BLOCK, pos), name, size):
                raise FormatError(
                    f"{path}: member {len(headers)} (byte {pos}) is not {name!r} of {size} bytes as the shard "
                    "plan says; the tar changed after it was written - re-materialize twin_tar_shards"
                )
            headers.append((name, pos, size))
            pos += member_span(size)
        total, want = os.fstat(fd).st_size, plan.tar_bytes(modality)
        if total != want or os.pread(fd, BLOCK, pos).strip(b"\0"):
            raise FormatError(
                f"{path}: {total} bytes where the shard plan's {len(headers)} members make {want}, or more members "
                "follow them; the tar changed after it was written - re-materialize twin_tar_shards"
            )
    return headers


def write_key_index_of(out: Path, plan: ShardPlan) -> str:
    """The key index of ``plan``'s tars in ``out``, from their headers (checked against the plan)."""
    members = {m: iter(planned_headers(tar_path(out, plan.bucket, m, plan.relpath), plan, m)) for m in plan.modalities}
    # A key kept without a modality's file (``plan/add_modality.py``) has no member there: null columns.
    rows = [
        KeyIndexRow(
            s.key, s.basename, plan.bucket or None, s.width, s.height,
            {m: next(members[m]) if m in s.files else (None, None, None) for m in plan.modalities},
        )
        for s in plan.samples
    ]
    rel = key_index_relpath(plan.relpath)
    write_key_index(bucket_dir(out, plan.bucket) / rel, key_index_table(rows, plan.modalities))
    return rel


def write_key_indexes(out: Path, plans: list[ShardPlan], num_workers: int = 1) -> list[str]:
    # Threads: reading headers and writing parquet release the GIL; no process start-up per build.
    return list(ordered_map(lambda p: write_key_index_of(out, p), plans, num_workers, threads=True))


TarSha256 = Callable[[Path, Shard], dict[str, str]]


@dataclass(frozen=True)
class BucketManifest:
    bucket: str
    path: Path
    manifest: WdinfoManifest


def write_manifests(out: Path, source: str, plans: Sequence[Shard], num_workers: int = 1,
                    root_base: str | None = None, *, tar_sha256: TarSha256 | None = None,
                    plan_modalities: Sequence[str] | None = None) -> list[BucketManifest]:
    """One wdinfo.json per bucket leaf, each written after all the tars and indexes it lists.

    ``root_base`` (``wdinfo.root_base``): None writes relative roots (``"."``); else each root is
    ``<root_base>/<bucket>``, where the published output folder is. Every manifest gets the
    build's one ``chunk_size``, the largest count of any tar: safe whichever manifest PiD reads first.
    ``tar_sha256(out, shard)``: each tar's sha256 (default ``tar_digests``: the writer's cache,
    else the file hashed); the scale benchmark, which writes no tars, passes its own.
    ``plan_modalities``: the modalities the shards were cut with, when modalities were added to
    the plan later (``plan/add_modality.py``); each manifest then says so.
    """
    # Hashing every tar again on each run is the slowest part of a no-op rebuild, and the
    # writer hashed each tar it wrote already: the cache answers for all but tars changed since.
    sha = tar_digests if tar_sha256 is None else tar_sha256
    chunk_size = derive_chunk_size([p.count for p in plans])
    shas = list(ordered_map(lambda p: sha(out, p), plans, num_workers, threads=True))
    by_bucket: dict[str, list[tuple[Shard, dict[str, str]]]] = defaultdict(list)
    for p, digests in zip(plans, shas, strict=True):
        by_bucket[p.bucket].append((p, digests))
    written = []
    for bucket in sorted(by_bucket):
        entries = []
        for p, digests in by_bucket[bucket]:
            entries.append(TarEntry(p.relpath, p.count, {m: p.tar_bytes(m) for m in p.modalities}, digests,
                                    key_index_relpath(p.relpath)))
        modalities = list(by_bucket[bucket][0][0].modalities)
        manifest = WdinfoManifest(
            data_keys=modalities, tars=entries, root=manifest_root(root_base, bucket), chunk_size=chunk_size,
            bucket=bucket or None, source=source,
            plan_modalities=list(plan_modalities) if plan_modalities is not None else None,
        )
        path = write_wdinfo(bucket_dir(out, bucket), manifest)
        written.append(BucketManifest(bucket, path, manifest))
    return written


def remove_unplanned(out: Path, plans: Sequence[Shard]) -> list[Path]:
    """Delete outputs no plan names: in the staging folder, those an earlier, unfinished build
    with another sharding left there, so the published version holds only what it lists.

    Only files of the layout this build writes (tars, key indexes, manifests) are ever removed,
    and only folders those removals left empty.
    """
    # Strings, not Paths: a source of millions of samples has a few hundred thousand outputs, and
    # a Path per output costs more than the walk.
    root = os.fspath(Path(out))
    keep: set[str] = set()
    base: dict[str, str] = {}
    for p in plans:
        b = base.get(p.bucket)
        if b is None:
            b = base[p.bucket] = os.fspath(bucket_dir(Path(root), p.bucket))
            keep.add(f"{b}/{WDINFO_NAME}")
        for m in p.modalities:
            keep.add(f"{b}/{m}/{p.relpath}")
        keep.add(f"{b}/{key_index_relpath(p.relpath)}")
    removed = []
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            dirs[:] = [x for x in dirs if x != STATE_DIR]
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(files):
            f = os.path.join(dirpath, name)
            if f in keep:
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            if BUILD_OUTPUT_PATH.match(rel) is not None:
                os.unlink(f)
                removed.append(Path(f))
    # Deepest first, so a part folder goes before the modality folder that held it.
    emptied = {p for f in removed for p in f.parents if p != out and p.is_relative_to(out)}
    for d in sorted(emptied, key=lambda p: -len(p.parts)):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return sorted(removed)


def listed_outputs(folder: Path) -> set[Path] | None:
    """The build files (relative to ``folder``) that the build state in ``folder`` lists: every
    planned shard's tars and key index, and one manifest per bucket. ``None`` when the folder
    carries no readable build state (it was not made by a build).

    This, not the file-name pattern, says what a previous version owned: a file that merely
    looks like a tar of the layout was put there by someone else and is never deleted.
    """
    state = folder / STATE_DIR
    try:
        part_size = int(load_state_doc((state / "sharding.json").read_bytes(), state / "sharding.json")["part_size"])
        plan = state / "plan.parquet"
        mods = [c.split(".", 1)[1] for c in pq.read_schema(plan).names if c.startswith("name.")]
        shards = pq.read_table(plan, columns=["shard_bucket", "shard_index"]).to_pydict()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    base = Path()
    listed: set[Path] = set()
    for bucket, index in set(zip(shards["shard_bucket"], shards["shard_index"], strict=True)):
        rel = shard_relpath(index, part_size)
        listed.update(tar_path(base, bucket, m, rel) for m in mods)
        listed.add(bucket_dir(base, bucket) / key_index_relpath(rel))
        listed.add(bucket_dir(base, bucket) / WDINFO_NAME)
    return listed
