"""Checks of built output against its contracts; each returns human-readable problems."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from loader.formats.key_index import read_key_columns
from loader.formats.layout import key_index_relpath
from loader.formats.twin_tar import file_sha256, iter_member_headers, split_member_name, tar_path
from loader.formats.wdinfo import WDINFO_NAME, read_wdinfo
from loader.io import urls
from pid_platform.sharding.layout import bucket_dir
from pid_platform.sharding.plan.columnar import Shard
from pid_platform.sharding.plan.shard_plan import ShardingConfig, is_oversize_singleton


def _keys(path: Path) -> list[str]:
    return [split_member_name(name)[0] for name, _, _ in iter_member_headers(path)]


def twin_key_mismatches(out: Path, plans: Sequence[Shard]) -> list[str]:
    problems = []
    for p in plans:
        seqs = {m: _keys(tar_path(out, p.bucket, m, p.relpath)) for m in p.modalities}
        first_mod, first = next(iter(seqs.items()))
        for m, keys in seqs.items():
            if keys != first:
                problems.append(
                    f"{p.bucket or '.'}/{p.relpath}: {m} holds {len(keys)} keys, {first_mod} holds {len(first)}; "
                    f"sequences differ"
                )
    return problems


def size_bound_violations(out: Path, plans: Sequence[Shard], config: ShardingConfig,
                          modalities: Sequence[str] | None = None) -> list[str]:
    """Shards whose tars exceed the bound; ``modalities``: those the plan was cut with, when others
    were added to it later (the bound holds for those alone; the manifests' ``plan_modalities``)."""
    if config.shard_size > 0:
        return []
    problems = []
    for p in plans:
        if modalities is not None:
            p = p.restricted(tuple(modalities))  # noqa: PLW2901 - the shard as it was cut
        total = sum(tar_path(out, p.bucket, m, p.relpath).stat().st_size for m in p.modalities)
        if total > config.max_shard_bytes and not is_oversize_singleton(p, config):
            problems.append(f"{p.bucket or '.'}/{p.relpath}: {total} bytes > bound {config.max_shard_bytes}")
    return problems


def _root_problem(path: Path, root: str, leaf: Path) -> list[str]:
    """A local root (relative, or absolute as for PiD) must name the manifest's folder, where the
    build's layout puts the tars; a URL root names where the output is published, not checked here."""
    if urls.has_scheme(root):
        return []
    where = Path(root) if os.path.isabs(root) else leaf / root
    if where.is_dir() and os.path.samefile(where, leaf):
        return []
    return [f"{path}: root {root!r} does not name the manifest's folder {leaf}; "
            "rewrite it (pid-rewrite-roots) or rebuild"]


def manifest_mismatches(out: Path, buckets: list[str]) -> list[str]:
    problems = []
    for b in buckets:
        path = bucket_dir(out, b) / WDINFO_NAME
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        man = read_wdinfo(path)
        root = bucket_dir(out, b)  # the layout: tars beside the manifest, whatever root says
        problems += _root_problem(path, man.root, root)
        for t in man.tars:
            for m in man.data_keys:
                tp = root / m / t.path
                if not tp.is_file():
                    problems.append(f"{tp}: listed in {path} but missing")
                    continue
                n = len(iter_member_headers(tp))
                if n != t.count:
                    problems.append(f"{tp}: holds {n} members, {path} says {t.count}")
                if t.bytes.get(m) not in (None, tp.stat().st_size):
                    problems.append(f"{tp}: {tp.stat().st_size} bytes, {path} says {t.bytes[m]}")
                if t.sha256.get(m) and file_sha256(tp) != t.sha256[m]:
                    problems.append(f"{tp}: sha256 differs from the one {path} lists")
    return problems


def damaged_shards(out: Path, plans: Sequence[Shard]) -> list[tuple[Shard, Path]]:
    """The shards of the committed build in ``out`` with a tar missing or whose sha256 differs
    from the one its manifest lists (every tar is read), with the first such tar."""
    listed: dict[tuple[str, str], dict[str, str]] = {}
    for b in sorted({p.bucket for p in plans}):
        path = bucket_dir(out, b) / WDINFO_NAME
        if path.is_file():
            listed.update({(b, t.path): t.sha256 for t in read_wdinfo(path).tars})
    damaged = []
    for p in plans:
        sha = listed.get((p.bucket, p.relpath), {})
        for m in p.modalities:
            tp = tar_path(out, p.bucket, m, p.relpath)
            if not tp.is_file() or (sha.get(m) and file_sha256(tp) != sha[m]):
                damaged.append((p, tp))
                break
    return damaged


def key_index_mismatches(out: Path, buckets: list[str]) -> list[str]:
    """Each key index a manifest lists must name every tar member in order, with its exact offset and size."""
    problems = []
    for b in buckets:
        path = bucket_dir(out, b) / WDINFO_NAME
        man = read_wdinfo(path)
        for t in man.tars:
            if t.key_index is None:
                problems.append(f"{path}: {t.path} lists no key index")
                continue
            problems += _key_index_problems(Path(man.manifest_dir or ".") / t.key_index, bucket_dir(out, b), t.path,
                                            list(man.data_keys), shown_as=t.key_index)
    return problems


def planned_key_index_mismatches(out: Path, plans: Sequence[Shard]) -> list[str]:
    """The same for the key index of every planned shard, before any manifest lists them (staged)."""
    problems = []
    for p in plans:
        root = bucket_dir(out, p.bucket)
        index = root / key_index_relpath(p.relpath)
        if not index.is_file():
            problems.append(f"{index}: missing")
            continue
        problems += _key_index_problems(index, root, p.relpath, list(p.modalities), shown_as=str(index))
    return problems


def _key_index_problems(index: Path, root: Path, tar_rel: str, data_keys: list[str], *, shown_as: str) -> list[str]:
    problems = []
    idx = read_key_columns(index, data_keys, members=True, sizes=True)
    for m in data_keys:
        headers = iter_member_headers(root / m / tar_rel)
        if not (m in idx.members and m in idx.offsets and m in idx.sizes):
            problems.append(f"{shown_as}: no member/offset/size columns for {m}")
            continue
        # A key kept without this modality (``plan/add_modality.py``, keep) has null columns, no member.
        listed = [row for row in zip(idx.members[m], idx.offsets[m], idx.sizes[m], strict=True) if row[0] is not None]
        if listed != [tuple(h) for h in headers]:
            problems.append(f"{shown_as}: {m} members/offsets/sizes differ from {root / m / tar_rel}")
    keys = [split_member_name(n)[0] for n in idx.members.get(data_keys[0], [])]
    if keys != idx.keys:
        problems.append(f"{shown_as}: key column differs from the member names")
    return problems
