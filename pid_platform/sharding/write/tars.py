"""Write the planned twin tars into the staging folder, in parallel, atomically, reusing every
shard already up to date there or in the published output."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loader.formats.atomic import TMP_MARKER
from loader.formats.twin_tar import TarMember, key_index_relpath, tar_path, write_tar
from pid_platform.sharding.commit.versions import link_atomic
from pid_platform.sharding.layout import bucket_dir, sha_cache_path, stamp_path, write_staged_state
from pid_platform.sharding.parallel import ordered_map
from pid_platform.sharding.plan.shard_plan import ShardPlan
from pid_platform.sharding.storage import SourceStore


@dataclass(frozen=True)
class ShardResult:
    bucket: str
    index: int
    relpath: str
    count: int
    bytes: dict[str, int]
    written: bool  # False when an up-to-date shard was kept or hard-linked from the published output


def _tar_stats(folder: Path, plan: ShardPlan) -> dict[str, list[int]] | None:
    # Size, mtime and inode of each tar: a tar replaced or rewritten behind the build's back
    # (even with its old size) no longer matches what the stamp recorded when it was written.
    stats = {}
    for m in plan.modalities:
        try:
            st = os.stat(tar_path(folder, plan.bucket, m, plan.relpath))
        except FileNotFoundError:
            return None
        stats[m] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return stats


def shard_up_to_date(folder: Path, plan: ShardPlan) -> bool:
    """Whether ``folder`` holds ``plan``'s tars as its stamp recorded them when they were written."""
    try:
        stamp = json.loads(stamp_path(folder, plan.bucket, plan.index).read_bytes())
    except (OSError, ValueError):
        return False
    if stamp.get("digest") != plan.digest():
        return False
    stats = _tar_stats(folder, plan)
    return (
        stats is not None
        and stamp.get("tars") == stats
        and all(stats[m][0] == plan.tar_bytes(m) for m in plan.modalities)
    )


def _write_stamp(folder: Path, plan: ShardPlan) -> None:
    # After every tar of the shard: a crash before it means "rewrite the shard".
    doc = {"digest": plan.digest(), "tars": _tar_stats(folder, plan)}
    write_staged_state(stamp_path(folder, plan.bucket, plan.index), json.dumps(doc).encode())


AfterShard = Callable[[ShardPlan, ShardResult], object]


def _carry_digests(previous: Path, base: ShardPlan, out: Path, plan: ShardPlan) -> None:
    """The checksums ``previous`` cached for ``base``'s tars, as cache entries of ``plan`` in
    ``out`` (the same files, hard-linked): the reused tars are not read again to hash them."""
    try:
        cache = json.loads(sha_cache_path(previous, base.bucket, base.index).read_bytes())
    except (OSError, ValueError):
        return
    old, new, carried = base.digest(), plan.digest(), {}
    for m in base.modalities:
        st = os.stat(tar_path(out, plan.bucket, m, plan.relpath))
        stat = f"{st.st_size}:{st.st_ino}:{st.st_mtime_ns}"
        hit = cache.get(m) if isinstance(cache, dict) else None
        if isinstance(hit, list) and len(hit) == 2 and hit[0] == f"{old}:{stat}":
            carried[m] = [f"{new}:{stat}", hit[1]]
    if carried:
        write_staged_state(sha_cache_path(out, plan.bucket, plan.index), json.dumps(carried).encode())


def _write_tars(store: SourceStore, source: str, out: Path, plan: ShardPlan, modalities: tuple[str, ...]) -> None:
    for m in modalities:
        members = []
        for name, s in plan.members(m):
            # By name under the source root, checked against the planned fingerprint: a plan
            # file (shared, so it could be changed) never decides which file is read.
            f = s.files[m]
            path = store.planned_path(source, f)
            if path is not None:
                members.append(TarMember(name, f.size, path=path))
            else:
                members.append(TarMember(name, f.size, data=store.read(source, f)))
        write_tar(tar_path(out, plan.bucket, m, plan.relpath), members, durable=False)


def _shard_one(store: SourceStore, source: str, out: Path, previous: Path | None, plan: ShardPlan,
               reuse: tuple[str, ...] | None) -> ShardResult:
    sizes = {m: plan.tar_bytes(m) for m in plan.modalities}
    result = ShardResult(plan.bucket, plan.index, plan.relpath, len(plan.samples), sizes, False)
    if shard_up_to_date(out, plan):  # written by an earlier, unfinished run of this build
        return result
    # Invalidate the stamp first: a crash after some of this shard's tars were replaced must not
    # leave an older stamp vouching for the shard.
    stamp_path(out, plan.bucket, plan.index).unlink(missing_ok=True)
    # Tars up to date in ``previous`` are the same files (hard links): the whole shard's, or, when
    # it adds modalities to the committed plan, those of the committed plan's (``base``). Only the
    # others are written.
    base = plan.restricted(reuse) if reuse and set(reuse) < set(plan.modalities) else None
    linked = next((p for p in (plan, base) if p is not None and previous is not None
                   and shard_up_to_date(previous, p)), None)
    for m in linked.modalities if linked is not None else ():
        link_atomic(tar_path(previous, plan.bucket, m, plan.relpath), tar_path(out, plan.bucket, m, plan.relpath))
    if linked is not None and linked is base:
        _carry_digests(previous, base, out, plan)
    elif linked is not None and (sha := sha_cache_path(previous, plan.bucket, plan.index)).is_file():
        # The checksums of these very files: spares hashing them again.
        link_atomic(sha, sha_cache_path(out, plan.bucket, plan.index))
    written = tuple(m for m in plan.modalities if linked is None or m not in linked.modalities)
    _write_tars(store, source, out, plan, written)
    _write_stamp(out, plan)
    return ShardResult(plan.bucket, plan.index, plan.relpath, len(plan.samples), sizes, bool(written))


def shard_files(out: Path, plan: ShardPlan) -> list[Path]:
    """Every file a write of ``plan`` puts under ``out``: its tars, key index, stamp and digests."""
    return [
        *(tar_path(out, plan.bucket, m, plan.relpath) for m in plan.modalities),
        bucket_dir(out, plan.bucket) / key_index_relpath(plan.relpath),
        stamp_path(out, plan.bucket, plan.index),
        sha_cache_path(out, plan.bucket, plan.index),
    ]


def remove_stale_temp_files_of(out: Path, plans: list[ShardPlan]) -> list[Path]:
    """Delete the temporary files a crashed writer of ``plans`` left under ``out``, and only
    those: write tasks of other shards may be writing beside them right now."""
    names: dict[Path, set[str]] = {}
    for plan in plans:
        for f in shard_files(out, plan):
            names.setdefault(f.parent, set()).add(f.name)
    removed = []
    for folder, mine in sorted(names.items()):
        try:
            entries = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in sorted(entries):
            if TMP_MARKER in name and name.rsplit(TMP_MARKER, 1)[0] in mine:
                p = folder / name
                try:
                    p.unlink()
                except FileNotFoundError:
                    continue
                removed.append(p)
    return removed


def write_shards(
    store: SourceStore, source: str, out: Path, plans: list[ShardPlan], *, previous: Path | None = None,
    num_workers: int = 1, progress=None, then: AfterShard | None = None, reuse: tuple[str, ...] | None = None,
) -> list[ShardResult]:
    """Write ``plans`` under ``out`` (a build's staging folder). A shard already up to date in
    ``out`` is kept; one up to date in ``previous`` (the published output) is hard-linked.

    ``then(plan, result)`` runs on the worker once the shard's tars are in place (written, kept
    or linked; ``result.written`` says which), before the result is reported: the build's next
    steps, shard by shard, while other shards are still being written.
    The leftovers of a crashed writer are cleared beside ``plans``' files only, not under all
    of ``out``: other write tasks may be writing there (the commit clears the rest).
    ``reuse``: the modalities of ``previous``'s plan when ``plans`` add modalities to it
    (``plan/add_modality.py``): a shard whose tars of those are up to date there has them
    hard-linked and only the added modalities' tars written.
    """
    remove_stale_temp_files_of(out, plans)
    # Several workers take the largest shards first: they then end together on small ones, not
    # one of them on the last big shard while the others wait (buckets make shard sizes uneven).
    order = list(range(len(plans)))
    if num_workers > 1:
        order.sort(key=lambda i: (-plans[i].total_bytes, i))

    def one(plan: ShardPlan) -> ShardResult:
        result = _shard_one(store, source, out, previous, plan, reuse)
        if then is not None:
            then(plan, result)
        return result

    results: list[ShardResult | None] = [None] * len(plans)
    for i, res in zip(order, ordered_map(one, [plans[i] for i in order], num_workers, threads=True), strict=True):
        results[i] = res
        if progress is not None:
            progress(res)
    return results  # type: ignore[return-value]
