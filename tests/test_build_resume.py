"""Re-runs: up-to-date shards are kept, changed ones rewritten, stale ones dropped - safely.

``_reshard`` runs intake and tar writing only: they fill the staging folder beside ``out`` and
leave ``out`` as it was; the next full build continues from that staging folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loader.formats.atomic import TMP_MARKER
from loader.formats.errors import FormatError
from loader.formats.twin_tar import SourceChangedError, file_sha256, iter_member_headers, tar_path
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.layout import sha_cache_path, stamp_path
from pid_platform.sharding.pipeline import run_intake, run_key_indexes
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import LocalSourceStore
from tests.support.build_data import (
    SMALL_BOUND_MB,
    SOURCE,
    all_problems,
    build,
    index_rows,
    jpeg_bytes,
    manifests,
    output_files,
    photo,
    reverse_members_in_place,
    run_sharding,
    source_file,
)

CONFIG = ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)


def _reshard(raw_root: Path, out: Path, config: ShardingConfig = CONFIG):
    """Intake and tar writing only, to see each shard's ShardResult."""
    store = LocalSourceStore(raw_root)
    run_intake(store, SOURCE, out, config, trust_pickle=False, num_workers=1)
    return run_sharding(store, SOURCE, out, config, num_workers=1)


def _mtimes(out: Path) -> dict[str, int]:
    return {p: (out / p).stat().st_mtime_ns for p in output_files(out) if p.endswith(".tar")}


def test_rerun_keeps_every_up_to_date_shard(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = build(raw_root, out)
    before, times = output_files(out), _mtimes(out)
    _plans, results = _reshard(raw_root, out)
    assert results and not any(r.written for r in results)
    again = build(raw_root, out)
    assert sum(b.written for b in again.buckets.values()) == 0
    assert again.shards == first.shards
    assert output_files(out) == before
    assert _mtimes(out) == times  # not rewritten with equal bytes: not touched at all


def test_changing_one_source_file_rewrites_only_its_shard(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = output_files(out)
    row = {r["basename"]: r for r in index_rows(out)}["chelsea-3x4"]
    source_file(raw_root, "caption", "chelsea-3x4").write_text(json.dumps({"prompt": "a cat, re-captioned"}))
    _plans, results = _reshard(raw_root, out)
    written = [(r.bucket, r.relpath) for r in results if r.written]
    assert written == [(row["bucket"], row["tar"])]
    s = build(raw_root, out)  # the full path, manifests included
    after = output_files(out)
    changed = {p for p in after if after[p] != before.get(p)}
    bucket, tar = row["bucket"], row["tar"]
    assert changed == {
        f"{bucket}/caption/{tar}",
        f"{bucket}/_key_index/{tar[:-4]}.parquet",  # the caption's size moved
        f"{bucket}/wdinfo.json",  # the caption tar's sha256 moved
    }
    assert all_problems(out) == []
    assert s.samples == 32


def test_resharding_removes_stale_tars_after_the_new_manifests(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    fine = build(raw_root, out, max_shard_size_mb=0.1)
    old_tars = {p for p in output_files(out) if p.endswith(".tar")}
    coarse = build(raw_root, out, max_shard_size_mb=1.0)
    assert coarse.shards < fine.shards
    files = output_files(out)
    tars = {p for p in files if p.endswith(".tar")}
    listed = {
        f"{m.bucket}/{k}/{t}" for m in manifests(out) for t in m.data_list for k in m.data_keys
    }
    assert tars == listed
    assert {str(p.relative_to(out)) for p in coarse.removed} >= old_tars - tars
    parquets = {p for p in files if p.endswith(".parquet")}
    assert parquets == {f"{m.bucket}/{t.key_index}" for m in manifests(out) for t in m.tars}
    assert all_problems(out, max_shard_size_mb=1.0) == []
    # And back to flat mode: every bucket folder goes.
    flat = build(raw_root, out, classify_aspect_ratio=False, max_shard_size_mb=1.0)
    assert not any(p.startswith("aspect_ratio_") for p in output_files(out))
    assert flat.samples == 32


def test_stale_removal_touches_only_files_of_the_build_layout(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)  # a folder no build made is refused (test_hostile_inputs); this one is ours
    mine = [out / "notes" / "old.tar", out / "other-source" / "image" / "part_000000" / "000000.tar",
            out / "README.parquet", out / "keep" / "empty"]
    for p in mine[:3]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"user data")
    mine[3].mkdir(parents=True)
    build(raw_root, out, shard_size=4)  # a re-shard: the previous version's tars are dropped
    assert all(p.exists() for p in mine)


def test_crash_between_twin_tars_does_not_leave_a_stale_stamp(raw_root: Path, tmp_path: Path) -> None:
    """A shard whose tars were partly replaced must be rewritten, even if a stamp vouched for it.

    Build A shards 4 samples per tar; build B (8 per tar) stages shard 0's caption tar, then
    fails on a source file that changed since intake. Caption tars of 4 and 8 short captions
    have the same size (one 10 KiB record), so only the stamp can tell them apart.
    """
    out = tmp_path / "out"
    flat4 = {"classify_aspect_ratio": False, "shard_size": 4}
    build(raw_root, out, **flat4)
    published = output_files(out)
    b_config = ShardingConfig(classify_aspect_ratio=False, shard_size=8)
    store = LocalSourceStore(raw_root)
    samples = run_intake(store, SOURCE, out, b_config, trust_pickle=False, num_workers=1).samples
    fifth = samples["basename"][5].as_py()  # in B's shard 0, in A's shard 1
    changed = source_file(raw_root, "image", fifth)
    changed.write_bytes(jpeg_bytes(photo("coffee", (200, 300))))
    with pytest.raises(SourceChangedError, match=changed.name):
        run_sharding(store, SOURCE, out, b_config, num_workers=1)
    staged = staging_dir(out)
    caption0 = tar_path(staged, None, "caption", "part_000000/000000.tar")
    assert len(iter_member_headers(caption0)) == 8  # B's caption tar is staged ...
    assert caption0.stat().st_size == tar_path(out, None, "caption", "part_000000/000000.tar").stat().st_size
    assert not stamp_path(staged, "", 0).exists()  # ... and no stamp vouches for shard 0 there
    assert not [p for p in staged.rglob(f"*{TMP_MARKER}*")]
    assert output_files(out) == published  # the failed build never touched the output
    build(raw_root, out, **flat4)
    assert all_problems(out, **flat4) == []
    caption0_rel = "caption/part_000000/000000.tar"  # A's shard 0 again, not B's staged tar
    assert output_files(out)[caption0_rel] == published[caption0_rel]


def test_manifest_sha256_follows_a_rewrite_that_keeps_size_and_mtime(raw_root: Path, tmp_path: Path) -> None:
    # Coarse filesystem timestamps (or a copy tool preserving mtimes) can give a rewritten tar
    # the same size and mtime as before; the manifest must still list its real checksum.
    out = tmp_path / "out"
    build(raw_root, out)
    row = index_rows(out)[0]
    victim = tar_path(out, row["bucket"], "caption", row["tar"])
    st = victim.stat()
    cap = source_file(raw_root, "caption", row["basename"])
    doc = json.loads(cap.read_bytes())
    doc["prompt"] = doc["prompt"].swapcase()  # same length, other bytes
    cap.write_text(json.dumps(doc))
    _reshard(raw_root, out)
    rewritten = tar_path(staging_dir(out), row["bucket"], "caption", row["tar"])  # staged, not yet published
    assert rewritten.stat().st_size == st.st_size
    os.utime(rewritten, ns=(st.st_atime_ns, st.st_mtime_ns))
    build(raw_root, out)
    assert all_problems(out) == []
    assert victim.read_bytes() != b"" and victim.stat().st_ino != st.st_ino  # the new tar is published


def test_key_indexes_refuse_a_staged_tar_changed_after_it_was_written(raw_root: Path, tmp_path: Path) -> None:
    # Key indexes take each member's offset from the plan and read only its header there: a tar
    # whose members moved (same size, inode and mtime) must still be refused, naming the tar.
    out = tmp_path / "out"
    plans, _results = _reshard(raw_root, out)
    plan = next(p for p in plans if p.count > 1)
    victim = tar_path(staging_dir(out), plan.bucket, "caption", plan.relpath)
    reverse_members_in_place(victim)
    with pytest.raises(FormatError, match=f"{victim}.*re-materialize twin_tar_shards"):
        run_key_indexes(out, num_workers=1)
    assert not out.exists()  # nothing was published


def test_digests_the_writer_keeps_are_the_staged_tars_sha256(raw_root: Path, tmp_path: Path) -> None:
    # The writer hashes each tar as it writes it; the manifests list those digests unread.
    out = tmp_path / "out"
    plans, _results = _reshard(raw_root, out)
    staged = staging_dir(out)
    for p in plans:
        cached = json.loads(sha_cache_path(staged, p.bucket, p.index).read_bytes())
        for m in p.modalities:
            assert cached[m][1] == file_sha256(tar_path(staged, p.bucket, m, p.relpath))
