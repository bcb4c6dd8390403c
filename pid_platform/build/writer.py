"""Write the planned twin tars, in parallel, atomically, and skip shards already up to date."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes, remove_stale_temp_files
from loader.formats.twin_tar import TarMember, tar_path, write_tar
from pid_platform.build.layout import stamp_path
from pid_platform.build.parallel import ordered_map
from pid_platform.build.plan import ShardPlan
from pid_platform.build.storage import SourceStore


@dataclass(frozen=True)
class ShardResult:
    bucket: str
    index: int
    relpath: str
    count: int
    bytes: dict[str, int]
    written: bool  # False when an up-to-date shard from an earlier run was kept


def _up_to_date(out: Path, plan: ShardPlan) -> bool:
    sp = stamp_path(out, plan.bucket, plan.index)
    try:
        stamp = json.loads(sp.read_bytes())
    except (OSError, ValueError):
        return False
    if stamp.get("digest") != plan.digest():
        return False
    for m in plan.modalities:
        p = tar_path(out, plan.bucket, m, plan.relpath)
        if not p.is_file() or p.stat().st_size != plan.tar_bytes(m):
            return False
    return True


def _write_one(args: tuple[SourceStore, str, Path, ShardPlan]) -> ShardResult:
    store, source, out, plan = args
    sizes = {m: plan.tar_bytes(m) for m in plan.modalities}
    if _up_to_date(out, plan):
        return ShardResult(plan.bucket, plan.index, plan.relpath, len(plan.samples), sizes, False)
    # Invalidate the stamp first: a crash after some of this shard's tars were replaced must not
    # leave an older stamp vouching for the shard (tar sizes alone often match, e.g. one record).
    stamp_path(out, plan.bucket, plan.index).unlink(missing_ok=True)
    for m in plan.modalities:
        members = []
        for name, s in plan.members(m):
            f = s.files[m]
            if f.local_path is not None:
                members.append(TarMember(name, f.size, path=f.local_path))
            else:
                members.append(TarMember(name, f.size, data=store.read(source, f)))
        write_tar(tar_path(out, plan.bucket, m, plan.relpath), members)
    # The stamp comes after every tar of the shard: a crash before it means "rewrite the shard".
    atomic_write_bytes(stamp_path(out, plan.bucket, plan.index), json.dumps({"digest": plan.digest()}).encode())
    return ShardResult(plan.bucket, plan.index, plan.relpath, len(plan.samples), sizes, True)


def write_shards(
    store: SourceStore, source: str, out: Path, plans: list[ShardPlan], *, num_workers: int = 1, progress=None
) -> list[ShardResult]:
    remove_stale_temp_files(out)
    results: list[ShardResult] = []
    for res in ordered_map(_write_one, [(store, source, out, p) for p in plans], num_workers):
        results.append(res)
        if progress is not None:
            progress(res)
    return results
