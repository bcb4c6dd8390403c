"""Publishing: a build stages a whole new version beside its output and swaps folders to commit.

Until the swap the output folder is exactly the last good version (bytes and mtimes), whatever
the build does or however it fails; unchanged tars are hard-linked into the new version, not
rewritten; a crash between the swap's two renames is repaired by the next build; files the build
did not write survive.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loader.formats.twin_tar import SourceChangedError, tar_path
from loader.formats.wdinfo import WDINFO_NAME
from loader.wds.discovery import find_manifests
from loader.wds.errors import ManifestError
from pid_platform.sharding.catalog import build_catalog
from pid_platform.sharding.commit import versions
from pid_platform.sharding.commit.manifests import remove_unplanned, write_manifests
from pid_platform.sharding.commit.verify_output import manifest_mismatches
from pid_platform.sharding.errors import BuildError, OutputNotWritableError
from pid_platform.sharding.layout import STATE_DIR, sha_cache_path
from pid_platform.sharding.pipeline import (
    build_source,
    load_sharding_config,
    run_intake,
    run_key_indexes,
)
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import LocalSourceStore
from tests.support.build_data import (
    SMALL_BOUND_MB,
    SOURCE,
    all_problems,
    build,
    index_rows,
    jpeg_bytes,
    load_plans,
    manifests,
    output_files,
    photo,
    run_sharding,
    source_file,
)

COARSE = ShardingConfig(max_shard_size_mb=1.0)  # one shard per bucket instead of SMALL_BOUND_MB's several


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``, build state included: its bytes and mtime."""
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _tar_inodes(out: Path) -> dict[str, int]:
    return {p: (out / p).stat().st_ino for p in output_files(out) if p.endswith(".tar")}


def _stage(raw_root: Path, out: Path, config: ShardingConfig) -> list:
    """Intake and tar writing only (into the staging folder); returns each shard's result."""
    store = LocalSourceStore(raw_root)
    run_intake(store, SOURCE, out, config, trust_pickle=False, num_workers=1)
    return run_sharding(store, SOURCE, out, config, num_workers=1)[1]


def _stage_until_commit(raw_root: Path, out: Path, config: ShardingConfig) -> None:
    """Everything a build does before its first rename: a complete staging folder, marked so."""
    _stage(raw_root, out, config)
    run_key_indexes(out, num_workers=1)
    staged = versions.staging_dir(out)
    plans = load_plans(staged, load_sharding_config(staged))
    remove_unplanned(staged, plans)
    write_manifests(staged, SOURCE, plans)
    (staged / STATE_DIR / versions.COMMITTING).write_bytes(b"")


@pytest.mark.parametrize("failure", ["source_changed", "unwritable_tar"])
def test_failed_reshard_leaves_the_output_untouched(raw_root: Path, tmp_path: Path, failure: str) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = _snapshot(out)
    buckets = sorted(m.bucket for m in manifests(out))
    # The 4:3 bucket is the 7th of 8 and cut differently by COARSE: its one shard must be written.
    blocked = tar_path(versions.staging_dir(out), "aspect_ratio_4_3", "caption", "part_000000/000000.tar")
    changed = source_file(raw_root, "image", "rocket-4x3")
    done: list[int] = []

    def progress(n: int, _total: int) -> None:
        done.append(n)
        if n == 1 and failure == "source_changed":  # after intake, while tars are being written
            old_size = changed.stat().st_size
            changed.write_bytes(jpeg_bytes(photo("coffee", (200, 150))))
            assert changed.stat().st_size != old_size

    if failure == "unwritable_tar":
        blocked.mkdir(parents=True)  # a folder where the tar must go: the rename into place fails
    with pytest.raises(SourceChangedError if failure == "source_changed" else IsADirectoryError):
        build_source(LocalSourceStore(raw_root), SOURCE, out, COARSE, num_workers=1, progress=progress)

    assert len(done) == 6  # six buckets' shards were staged before the failure
    assert _snapshot(out) == before
    assert manifest_mismatches(out, buckets) == []
    assert all_problems(out) == []  # old config, old plans, old tars: still one consistent version

    if failure == "unwritable_tar":
        blocked.rmdir()
    again = build_source(LocalSourceStore(raw_root), SOURCE, out, COARSE, num_workers=1)
    assert sum(b.written for b in again.buckets.values()) == 1  # resumed: only the failed shard
    assert all_problems(out, max_shard_size_mb=COARSE.max_shard_size_mb) == []
    assert not versions.staging_dir(out).exists() and not versions.old_dir(out).exists()


def test_unchanged_shards_are_hard_linked_not_rewritten(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    inodes = _tar_inodes(out)
    plans = load_plans(out, load_sharding_config(out))
    sha_inodes = {p.index: sha_cache_path(out, p.bucket, p.index).stat().st_ino for p in plans if p.bucket == ""}
    results = _stage(raw_root, out, ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB))
    assert results and not any(r.written for r in results)
    staged = versions.staging_dir(out)
    for rel, ino in inodes.items():
        st = (staged / rel).stat()
        assert (st.st_ino, st.st_nlink) == (ino, 2)  # one file, two names: published and staged
    summary = build(raw_root, out)
    assert sum(b.written for b in summary.buckets.values()) == 0 and summary.removed == []
    assert _tar_inodes(out) == inodes
    assert all((out / rel).stat().st_nlink == 1 for rel in inodes)  # the old folder is gone
    # The checksum cache came along with the tars: a no-op rebuild hashes nothing again.
    assert {i: sha_cache_path(out, "", i).stat().st_ino for i in sha_inodes} == sha_inodes


@pytest.mark.parametrize("how", ["in_place", "replaced_same_mtime"])
def test_a_tar_changed_behind_the_builds_back_is_rewritten(raw_root: Path, tmp_path: Path, how: str) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    reference = output_files(out)
    row = index_rows(out)[0]
    victim = tar_path(out, row["bucket"], "caption", row["tar"])
    st = victim.stat()
    damaged = victim.read_bytes().replace(row["key"].encode(), b"x" * len(row["key"]), 1)
    assert len(damaged) == st.st_size and damaged != reference[victim.relative_to(out).as_posix()]
    if how == "in_place":  # same size and inode, new mtime
        with open(victim, "r+b") as fh:
            fh.write(damaged)
    else:  # a copy tool: a new file under the old name, size and mtime kept
        scratch = victim.with_name("scratch")
        scratch.write_bytes(damaged)
        os.replace(scratch, victim)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    results = _stage(raw_root, out, ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB))
    assert [(r.bucket, r.relpath) for r in results if r.written] == [(row["bucket"], row["tar"])]
    build(raw_root, out)
    assert output_files(out) == reference
    assert all_problems(out) == []


def test_crash_after_the_first_rename_is_finished_by_the_next_build(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    _stage_until_commit(raw_root, out, COARSE)
    staged_version = output_files(versions.staging_dir(out))
    os.rename(out, versions.old_dir(out))  # the crash: F moved aside, S not yet in its place
    assert not out.exists()

    versions.begin(out)  # the first step of any build repairs it
    assert output_files(out) == staged_version
    assert not versions.old_dir(out).exists()
    assert not (out / STATE_DIR / versions.COMMITTING).exists()
    assert all_problems(out, max_shard_size_mb=COARSE.max_shard_size_mb) == []

    coarse = build(raw_root, out, max_shard_size_mb=COARSE.max_shard_size_mb)
    assert sum(b.written for b in coarse.buckets.values()) == 0
    assert output_files(out) == staged_version


def test_crash_before_the_stage_was_complete_restores_the_previous_output(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = _snapshot(out)
    _stage(raw_root, out, COARSE)  # tars staged, no manifests, no COMMITTING marker
    os.rename(out, versions.old_dir(out))  # F moved aside by hand: S must not be published

    versions.recover(out)
    assert _snapshot(out) == before
    assert not versions.old_dir(out).exists()

    coarse = build(raw_root, out, max_shard_size_mb=COARSE.max_shard_size_mb)
    assert sum(b.written for b in coarse.buckets.values()) == 0  # the stage was kept and finished
    assert all_problems(out, max_shard_size_mb=COARSE.max_shard_size_mb) == []


def test_an_old_folder_beside_an_output_not_made_by_a_swap_is_left_alone(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    old = versions.old_dir(out)
    os.rename(out, old)
    (out / "notes").mkdir(parents=True)  # someone made a new output folder by hand
    previous = _snapshot(old)
    versions.recover(out)
    assert _snapshot(old) == previous
    with pytest.raises(BuildError, match=str(old)):
        build(raw_root, out)
    assert _snapshot(old) == previous


def test_files_deleted_after_an_interrupted_carry_over_stay_deleted(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    (out / "notes.txt").write_bytes(b"soon deleted")
    _stage_until_commit(raw_root, out, COARSE)
    versions._carry(out, versions.staging_dir(out))  # the commit got this far, then stopped
    assert (versions.staging_dir(out) / "notes.txt").is_file()
    (out / "notes.txt").unlink()
    build(raw_root, out, max_shard_size_mb=COARSE.max_shard_size_mb)
    assert not (out / "notes.txt").exists()
    assert all_problems(out, max_shard_size_mb=COARSE.max_shard_size_mb) == []


def test_crash_after_the_swap_deletes_the_old_version_next_time(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    _stage_until_commit(raw_root, out, COARSE)
    staged_version = output_files(versions.staging_dir(out))
    os.rename(out, versions.old_dir(out))
    os.rename(versions.staging_dir(out), out)  # both renames done; the old folder not yet deleted
    versions.recover(out)
    assert not versions.old_dir(out).exists()
    assert not (out / STATE_DIR / versions.COMMITTING).exists()
    assert output_files(out) == staged_version


def test_user_files_survive_a_rebuild_and_a_switch_to_flat_mode(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    user = {
        "notes/readme.txt": b"mine",
        "aspect_ratio_1_1/notes.md": b"inside a bucket the flat build drops",
        "aspect_ratio_1_1/caption/part_000000/000000.tar.md5": b"not a tar of the layout",
        "README.parquet": b"not a key index of the layout",
    }
    for rel, data in user.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    inodes = {rel: (out / rel).stat().st_ino for rel in user}
    (out / "keep" / "empty").mkdir(parents=True)
    (out / "latest").symlink_to("notes/readme.txt")
    old_build_files = {p for p in output_files(out) if p not in user and p != "latest"}

    flat = build(raw_root, out, classify_aspect_ratio=False)
    files = output_files(out)
    assert {rel: files.get(rel) for rel in user} == user
    assert {rel: (out / rel).stat().st_ino for rel in user} == inodes  # the same files, not copies
    assert (out / "keep" / "empty").is_dir() and os.readlink(out / "latest") == "notes/readme.txt"
    assert not any(p.startswith("aspect_ratio_") and p not in user for p in files)
    new_build_files = {p for p in files if p not in user and p != "latest"}
    assert {p.relative_to(out).as_posix() for p in flat.removed} == old_build_files - new_build_files
    assert all_problems(out, classify_aspect_ratio=False) == []

    build(raw_root, out)  # and back to buckets
    assert {rel: output_files(out).get(rel) for rel in user} == user
    assert all_problems(out) == []


def test_catalog_and_discovery_ignore_staging_and_old_folders(raw_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "out"
    out = root / SOURCE
    build(raw_root, out)
    _stage_until_commit(raw_root, out, COARSE)  # a complete, unpublished version with manifests
    os.rename(out, versions.old_dir(out))
    os.mkdir(out)  # and a stray old folder beside an output folder holding nothing yet
    assert list(versions.staging_dir(out).rglob(WDINFO_NAME))
    _path, catalog = build_catalog(root)
    assert catalog.sources == {}
    with pytest.raises(ManifestError):
        find_manifests(str(root))  # a folder search skips dot-folders too
    os.rmdir(out)
    versions.recover(out)
    _path, catalog = build_catalog(root)
    assert sorted(catalog.sources) == [SOURCE]
    assert all(m.startswith(f"{SOURCE}/") for m in catalog.sources[SOURCE].manifests)
    assert all(Path(m).is_relative_to(out) for m in find_manifests(str(root)))


def test_an_output_path_that_is_a_file_is_refused_before_any_work(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_bytes(b"not a folder")
    with pytest.raises(OutputNotWritableError, match=str(out)):
        build(raw_root, out)
    assert out.read_bytes() == b"not a folder"
