"""Incremental builds: intake outcomes are kept by file identity, a rebuild with nothing new writes
nothing, a re-shard decodes no image, and whatever path a build took, its output is the output
of a build from scratch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.intake.cache import CACHE_NAME, IntakeCache
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.pipeline import build_source
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import open_source_store
from tests.conftest import SOURCE
from tests.support.build_data import (
    SMALL_BOUND_MB,
    add_sample,
    build,
    corrupt_jpeg_same_size,
    index_rows,
    output_files,
    rewrite_same_size,
    snapshot,
    source_file,
    stem_of,
)
from tests.support.seaweedfs import SeaweedS3, upload_tree

FILES = 32 * 3  # the drop: 32 samples, each an image, a caption and an embedding
# Files of the build state that describe the samples and the plan (the cache may legitimately
# differ: a from-scratch build never reads the files after a sample's first bad one).
STATE_COMPARED = ("intake_report.json", "samples.parquet", "plan.parquet", "sharding.json", "intake.json")


def _jpeg_stem(raw_root: Path, skip: int = 0) -> str:
    names = sorted(n for n in os.listdir(raw_root / SOURCE / "image") if n.endswith(".jpg"))
    return stem_of(names[skip])


def _state(out: Path) -> dict[str, bytes]:
    return {name: (out / STATE_DIR / name).read_bytes() for name in STATE_COMPARED}


def _same_as_from_scratch(raw_root: Path, out: Path, scratch: Path, **cfg) -> None:
    build(raw_root, scratch, **cfg)
    assert output_files(out) == output_files(scratch)
    assert _state(out) == _state(scratch)


def test_rebuild_with_nothing_changed_is_up_to_date_and_writes_nothing(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = build(raw_root, out, num_workers=2)
    assert not first.up_to_date
    assert (first.report.files_validated, first.report.outcomes_reused) == (FILES, 0)
    before = snapshot(out)

    again = build(raw_root, out, num_workers=2)
    assert again.up_to_date
    assert (again.report.files_validated, again.report.outcomes_reused) == (0, FILES)
    assert snapshot(out) == before  # bytes, mtimes and inodes: nothing rewritten, nothing touched
    assert sorted(os.listdir(tmp_path)) == ["out", "raw"]  # no staging folder, no lock file left
    assert (again.shards, again.samples, again.manifests) == (first.shards, first.samples, first.manifests)
    assert sum(b.written for b in again.buckets.values()) == 0 and again.removed == []


@pytest.mark.parametrize("atomic", [False, True], ids=["rewritten_in_place", "atomically_replaced"])
def test_same_size_new_bytes_are_validated_again_and_a_corrupt_file_is_dropped(
    raw_root: Path, tmp_path: Path, atomic: bool
) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    stem = _jpeg_stem(raw_root)
    image = source_file(raw_root, "image", stem)
    rewrite_same_size(image, corrupt_jpeg_same_size(image.read_bytes()), atomic=atomic)

    s = build(raw_root, out)
    assert not s.up_to_date
    assert s.report.files_validated == 1  # the image; its caption (checked first) was cached
    assert dict(s.report.dropped) == {"unreadable_image: image": 1}
    assert s.report.examples["unreadable_image: image"] == [stem]
    assert stem not in {r["basename"] for r in index_rows(out)}
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch")


def test_a_caption_rewritten_with_the_same_size_lands_in_the_tar(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    caption = source_file(raw_root, "caption", _jpeg_stem(raw_root))
    doc = json.loads(caption.read_bytes())
    doc["prompt"] = doc["prompt"].swapcase()
    rewrite_same_size(caption, json.dumps(doc).encode(), atomic=False)

    s = build(raw_root, out)
    assert (s.up_to_date, s.report.files_validated, s.samples) == (False, 1, 32)
    tars = [p for p in output_files(out) if "/caption/" in p and p.endswith(".tar")]
    assert any(json.dumps(doc).encode() in output_files(out)[p] for p in tars)
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch")


def test_a_deleted_file_leaves_the_build_and_its_cache(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    stem = _jpeg_stem(raw_root)
    source_file(raw_root, "image", stem).unlink()

    s = build(raw_root, out)
    assert (s.up_to_date, s.report.files_validated, s.samples) == (False, 0, 31)
    assert dict(s.report.dropped) == {"missing_modality: image": 1}
    assert stem not in {r["basename"] for r in index_rows(out)}
    cache = IntakeCache.load([out / STATE_DIR / CACHE_NAME], "full")
    assert len(cache) == FILES - 3  # the sample's other two files are orphans now: not validated
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch")


# Runs the build steps up to the crash point and then kills itself with SIGKILL: a real crash,
# at a chosen point between intake (which stages the cache) and the commit.
_CRASH = """
import os, signal, sys
from pathlib import Path
from pid_platform.sharding.pipeline import run_intake, run_key_indexes
from tests.support.build_data import run_sharding
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import LocalSourceStore
raw, out, point, bound = sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
store, config = LocalSourceStore(raw), ShardingConfig(max_shard_size_mb=bound)
run_intake(store, "photos", out, config, trust_pickle=False, num_workers=1, stop_if_up_to_date=True)
if point == "before_commit":
    run_sharding(store, "photos", out, config, num_workers=1)
    run_key_indexes(out, num_workers=1)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("point", ["after_intake", "before_commit"])
@pytest.mark.parametrize("published", [False, True], ids=["first_build", "rebuild"])
def test_a_crash_between_intake_and_commit_leaves_a_cache_the_next_build_uses_safely(
    raw_root: Path, tmp_path: Path, point: str, published: bool
) -> None:
    out = tmp_path / "out"
    if published:
        build(raw_root, out)
        add_sample(raw_root, "newcomer")  # so the crashed build has something to stage
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(raw_root), str(out), point, str(SMALL_BOUND_MB)],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])  # it imports tests.support
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    staged_cache = staging_dir(out) / STATE_DIR / CACHE_NAME
    assert staged_cache.is_file()
    assert out.exists() == published  # nothing was published by the crashed build

    # While nothing runs, one file gets new bytes (same size, same mtime) the staged cache has
    # an outcome for: that outcome must not be used.
    stem = _jpeg_stem(raw_root, skip=1)
    image = source_file(raw_root, "image", stem)
    rewrite_same_size(image, corrupt_jpeg_same_size(image.read_bytes()), atomic=False)

    s = build(raw_root, out)
    samples = 33 if published else 32
    assert s.report.files_validated == 1 and s.report.outcomes_reused == samples * 3 - 1
    assert dict(s.report.dropped) == {"unreadable_image: image": 1}
    assert s.samples == samples - 1
    assert not staging_dir(out).exists()
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch")


def test_incremental_build_is_byte_identical_to_a_build_from_scratch(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out, num_workers=2)
    # A day of changes: a sample added, one deleted, a caption rewritten, an image corrupted.
    add_sample(raw_root, "newcomer")
    gone, recaptioned, broken = _jpeg_stem(raw_root, 0), _jpeg_stem(raw_root, 1), _jpeg_stem(raw_root, 2)
    for m in ("caption", "image", "umt5"):
        source_file(raw_root, m, gone).unlink()
    source_file(raw_root, "caption", recaptioned).write_text(json.dumps({"prompt": "re-captioned, longer now"}))
    image = source_file(raw_root, "image", broken)
    image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])

    inc = build(raw_root, out, num_workers=2)
    # newcomer: 3 files; the new caption: 1; the broken image: 1 (its caption, checked first, was cached).
    assert (inc.report.files_validated, inc.samples) == (5, 31)
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch")
    # And a re-shard of the incremental output, against a from-scratch build with that bound.
    build(raw_root, out, max_shard_size_mb=1.0)
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch-1mb", max_shard_size_mb=1.0)


@pytest.mark.parametrize("cfg", [
    {"max_shard_size_mb": 1.0},
    {"shard_size": 3, "part_size": 2},
    {"shuffle": True, "seed": 7},
], ids=["bound", "shard_and_part_size", "shuffle_seed"])
def test_a_reshard_reuses_every_intake_outcome(raw_root: Path, tmp_path: Path, cfg: dict) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    s = build(raw_root, out, **cfg)
    assert not s.up_to_date
    assert (s.report.files_validated, s.report.outcomes_reused) == (0, FILES)  # no image decoded
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch", **cfg)
    assert build(raw_root, out, **cfg).up_to_date


def test_the_validation_level_is_a_setting_of_the_build(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    stem = _jpeg_stem(raw_root)
    image = source_file(raw_root, "image", stem)
    image.write_bytes(corrupt_jpeg_same_size(image.read_bytes()))  # header intact, data gone

    full = build(raw_root, out)
    assert (full.validate, full.samples, dict(full.report.dropped)) == ("full", 31, {"unreadable_image: image": 1})
    assert json.loads((out / STATE_DIR / "intake.json").read_bytes()) == {"rules_version": 1, "validate": "full"}

    header = build(raw_root, out, validate="header")
    assert (header.up_to_date, header.report.files_validated) == (False, FILES)  # a new level: all again
    assert (header.validate, header.samples, header.report.dropped_total) == ("header", 32, 0)
    assert json.loads((out / STATE_DIR / "intake.json").read_bytes())["validate"] == "header"
    assert build(raw_root, out, validate="header").up_to_date

    back = build(raw_root, out)
    # All again, but the embedding of the sample whose image fails: a sample stops at its first failure.
    assert (back.up_to_date, back.report.files_validated, back.samples) == (False, FILES - 1, 31)
    _same_as_from_scratch(raw_root, out, tmp_path / "scratch")


def test_header_level_reads_size_and_orientation_like_the_full_level(raw_root: Path, tmp_path: Path) -> None:
    full, header = build(raw_root, tmp_path / "full"), build(raw_root, tmp_path / "header", validate="header")
    assert output_files(tmp_path / "full") == output_files(tmp_path / "header")
    assert (full.samples, header.samples) == (32, 32)


def test_revalidate_validates_every_file_and_runs_every_step(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = output_files(out)
    s = build(raw_root, out, revalidate=True)
    assert (s.up_to_date, s.report.files_validated, s.report.outcomes_reused) == (False, FILES, 0)
    assert output_files(out) == before


def test_a_cache_made_under_other_rules_is_not_used(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    path = out / STATE_DIR / CACHE_NAME
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"rules_version": b"0"}), path)

    s = build(raw_root, out)
    assert (s.up_to_date, s.report.files_validated) == (False, FILES)  # every file under the current rules
    assert build(raw_root, out).up_to_date  # and that cache was published for the next build


@pytest.mark.parametrize("target", ["manifest", "key_index"])
def test_a_changed_manifest_or_key_index_is_not_up_to_date(raw_root: Path, tmp_path: Path, target: str) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = output_files(out)
    name = "wdinfo.json" if target == "manifest" else ".parquet"
    victim = next(out / p for p in before if p.endswith(name))
    victim.write_bytes(victim.read_bytes() + b" ")
    s = build(raw_root, out)
    assert not s.up_to_date and s.report.files_validated == 0
    assert output_files(out) == before  # put back as the build writes it


def test_s3_rebuild_keys_outcomes_by_etag(s3_env: SeaweedS3, photo_drop_template: Path, tmp_path: Path) -> None:
    client = s3_env.client()
    s3_env.make_bucket("incremental")
    upload_tree(client, photo_drop_template, "incremental", "drops")
    store = open_source_store("s3://incremental/drops")
    config = ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)
    out = tmp_path / "out"
    first = build_source(store, SOURCE, out, config, num_workers=2)
    assert first.report.files_validated == FILES
    assert build_source(store, SOURCE, out, config, num_workers=2).up_to_date

    # New bytes of the same size under the same key: the ETag changes, the outcome is found again.
    stem = _jpeg_stem(photo_drop_template / "")
    key = f"drops/{SOURCE}/image/{stem}.jpg"
    data = client.get_object(Bucket="incremental", Key=key)["Body"].read()
    client.put_object(Bucket="incremental", Key=key, Body=corrupt_jpeg_same_size(data))
    s = build_source(store, SOURCE, out, config, num_workers=2)
    assert (s.up_to_date, s.report.files_validated, s.samples) == (False, 1, 31)
    assert dict(s.report.dropped) == {"unreadable_image: image": 1}


# Lists a source (every modality folder, then the basename join) in a fresh process and reports
# what it cost.
_LIST = """
import json, resource, sys, time
from pid_platform.sharding.intake.listing import list_source
from pid_platform.sharding.storage import LocalSourceStore
store = LocalSourceStore(sys.argv[1])
t = time.perf_counter()
listing = list_source(store, "big")
seconds = time.perf_counter() - t
print(json.dumps({"entries": sum(listing.report.files_seen.values()), "complete": len(listing),
                  "seconds": seconds, "first": listing.complete["name.image"][0].as_py(),
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PID_SLOW_TESTS"), reason="2-4 minutes of making a million files: "
                    "run with PID_SLOW_TESTS=1 (listing and basename join: measured 269 MB, 10 s under load)")
def test_listing_a_million_files_stays_under_500_mb(tmp_path: Path) -> None:
    per_modality = 500_000
    root = tmp_path / "raw"
    for m, ext in (("image", "jpg"), ("caption", "json")):
        folder = root / "big" / m
        folder.mkdir(parents=True)
        for i in range(per_modality):
            os.mknod(folder / f"{i:07d}.{ext}")
    try:
        proc = subprocess.run([sys.executable, "-c", _LIST, str(root)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        print(f"listing 1,000,000 files: {got['seconds']:.1f} s, peak RSS {got['max_rss_mb']:.0f} MB")
        assert got["entries"] == 2 * per_modality and got["first"] == "0000000.jpg"
        assert got["complete"] == per_modality
        assert got["max_rss_mb"] < 500
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)  # a million inodes: not left in the temp folder
