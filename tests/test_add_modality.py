"""A modality folder added to a built source writes only that modality's tars (issue 18 part 10).

The committed plan is kept (same shards, same member order), every committed tar is reused
untouched (locally the same inode; on S3 no PutObject, CopyObject or UploadPart for it), and the
keys the new folder lacks follow ``new_modality_missing_keys``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from loader.formats.twin_tar import iter_member_headers, split_member_name
from loader.wds.pipeline import build_dataset
from pid_platform.sharding.commit.verify_output import (
    key_index_mismatches,
    manifest_mismatches,
    size_bound_violations,
    twin_key_mismatches,
)
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.pipeline import build_source
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.settings import parse_settings, source_settings
from pid_platform.sharding.storage import LocalSourceStore
from tests.conftest import SOURCE
from tests.support.build_data import SMALL_BOUND_MB, build, manifests, plans_of

NEW = "umt5"  # the sample source's embedding folder: the modality added to a built image+caption source


def tars(out: Path, modality: str) -> dict[str, os.stat_result]:
    """Every tar of ``modality`` under ``out``, relative to it, with its stat."""
    found = {}
    for p in sorted(out.rglob("*.tar")):
        rel = p.relative_to(out)
        if STATE_DIR not in rel.parts and modality in rel.parts:
            found[rel.as_posix()] = p.stat()
    return found


def member_keys(path: Path) -> list[str]:
    return [split_member_name(name)[0] for name, _, _ in iter_member_headers(path)]


def items(spec: str, modalities: list[str], **kw) -> dict[str, dict[str, bytes]]:
    dataset = build_dataset(spec, modalities=modalities, decode=None, shuffle=False, **kw)
    return {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in dataset}


@pytest.fixture
def without_new(raw_root: Path, tmp_path: Path) -> Path:
    """The new modality's folder, moved out of the source (move it back to add it)."""
    aside = tmp_path / "aside"
    aside.mkdir()
    shutil.move(raw_root / SOURCE / NEW, aside / NEW)
    return aside / NEW


def test_adding_a_modality_locally_writes_only_its_tars(raw_root: Path, without_new: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = build(raw_root, out)
    assert first.report.modalities == ["caption", "image"]
    before = {m: tars(out, m) for m in ("image", "caption")}
    assert before["image"] and before["caption"]
    plans_before = [(p.bucket, p.relpath, [s.key for s in p.samples]) for p in plans_of(out)]

    shutil.move(without_new, raw_root / SOURCE / NEW)
    second = build(raw_root, out)
    assert not second.up_to_date and second.report.modalities == ["caption", "image", NEW]
    # Every image and caption tar is the very file the first build wrote: same inode, same mtime.
    for m in ("image", "caption"):
        after = tars(out, m)
        assert sorted(after) == sorted(before[m])
        for rel, st in after.items():
            assert (st.st_ino, st.st_mtime_ns, st.st_size) == (
                before[m][rel].st_ino, before[m][rel].st_mtime_ns, before[m][rel].st_size), rel
    # The new modality's tars: the same shard names, members in the same order (twins).
    new = tars(out, NEW)
    assert sorted(r.replace(f"/{NEW}/", "/image/") for r in new) == sorted(before["image"])
    for rel in new:
        assert member_keys(out / rel) == member_keys(out / rel.replace(f"/{NEW}/", "/image/"))
    assert [(p.bucket, p.relpath, [s.key for s in p.samples]) for p in plans_of(out)] == plans_before

    # The manifests say which modalities the plan (its size bound) was cut with.
    for man in manifests(out):
        assert man.data_keys == ["caption", "image", NEW] and man.plan_modalities == ["caption", "image"]
    cut = load_plan_cut(out)
    assert cut is not None and cut.plan_modalities == ("caption", "image") and cut.added_modalities == (NEW,)
    plans = plans_of(out)
    buckets = sorted({p.bucket for p in plans})
    config = ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)
    assert size_bound_violations(out, plans, config, cut.plan_modalities) == []
    assert twin_key_mismatches(out, plans) + manifest_mismatches(out, buckets) + key_index_mismatches(out, buckets) == []

    # The loader reads all three in zip mode; the items are those of a build from scratch.
    scratch = build(raw_root, tmp_path / "scratch")
    mods = ["caption", "image", NEW]
    got = items(str(out), mods)
    assert len(got) == scratch.samples == 32
    assert got == items(str(scratch.out), mods)
    assert items(str(out), mods, mode="index") == got

    # A rebuild with nothing changed stays a no-op over the extended plan.
    again = build(raw_root, out)
    assert again.up_to_date
    assert tars(out, NEW) == new


def drop_new_file(raw_root: Path) -> str:
    """Delete one file of the new modality; returns its basename."""
    victim = sorted((raw_root / SOURCE / NEW).iterdir())[0]
    victim.unlink()
    return victim.stem


def test_missing_keys_reshard_drops_them_with_a_full_reshard(raw_root: Path, without_new: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = tars(out, "image")
    shutil.move(without_new, raw_root / SOURCE / NEW)
    gone = drop_new_file(raw_root)
    second = build(raw_root, out)  # new_modality_missing_keys: reshard (the default)
    assert second.samples == 31 and load_plan_cut(out) is None
    assert all(m.plan_modalities is None for m in manifests(out))
    keys = set(items(str(out), ["caption", "image", NEW]))
    assert len(keys) == 31 and not any(k.startswith(gone) for k in keys)
    # A full re-shard: the tars were cut again (new files), not left in place.
    assert {r: st.st_ino for r, st in tars(out, "image").items()} != {r: st.st_ino for r, st in before.items()}


def test_missing_keys_keep_keeps_the_plan_and_index_mode_skips_them(raw_root: Path, without_new: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out, new_modality_missing_keys="keep")
    before = tars(out, "image")
    shutil.move(without_new, raw_root / SOURCE / NEW)
    gone = drop_new_file(raw_root)
    second = build(raw_root, out, new_modality_missing_keys="keep")
    assert not second.up_to_date
    cut = load_plan_cut(out)
    assert cut is not None and cut.keys_without == 1
    assert {r: st.st_ino for r, st in tars(out, "image").items()} == {r: st.st_ino for r, st in before.items()}
    # Image and caption still serve every key; index mode skips the one without the new modality.
    assert len(items(str(out), ["caption", "image"])) == 32
    three = items(str(out), ["caption", "image", NEW], mode="index", missing_key_policy="skip")
    assert len(three) == 31 and not any(k.startswith(gone) for k in three)
    plans = plans_of(out, new_modality_missing_keys="keep")
    buckets = sorted({p.bucket for p in plans})
    # The one shard with the kept key: its new-modality tar holds one member fewer than the shard's keys.
    [short] = manifest_mismatches(out, buckets)
    assert f"/{NEW}/" in short and "members" in short
    assert key_index_mismatches(out, buckets) == []
    assert build(raw_root, out, new_modality_missing_keys="keep").up_to_date


def _pid_positional_zip(out: Path) -> list[tuple[str, ...]]:
    """What PiD's reader does with a manifest: for each tar it lists, the member streams of every
    modality's tar zipped by position (no check that the members share a key)."""
    tuples = []
    for path in sorted(out.rglob("wdinfo.json")):
        if STATE_DIR in path.parts:
            continue
        doc = json.loads(path.read_text())
        root = Path(doc["root"])
        for rel in doc["data_list"]:
            streams = [member_keys(root / m / rel) for m in doc["data_keys"]]
            # zip stops at the shortest: a short tar's tail is never read
            tuples.extend(zip(*streams, strict=False))
    return tuples


def test_keep_is_refused_to_the_roots_pid_reads_and_reshard_stays_positional(
        raw_root: Path, without_new: Path, tmp_path: Path) -> None:
    from pid_platform.sharding.commit.manifest_roots import rewrite_manifest_roots
    out = tmp_path / "out"
    # As settings: refused before any work.
    with pytest.raises(ShardingConfigError, match="manifest root 'absolute' with new_modality_missing_keys: keep"):
        build_source(LocalSourceStore(raw_root), SOURCE, out, ShardingConfig(new_modality_missing_keys="keep"),
                     manifest_root="absolute")
    assert not out.exists()
    # An output that kept a key without the new modality: its roots stay relative.
    build(raw_root, out, new_modality_missing_keys="keep")
    shutil.move(without_new, raw_root / SOURCE / NEW)
    drop_new_file(raw_root)
    build(raw_root, out, new_modality_missing_keys="keep")
    assert load_plan_cut(out).keys_without == 1
    with pytest.raises(ShardingConfigError, match="1 keys are kept without a member of \\['umt5'\\]"):
        rewrite_manifest_roots(out, "absolute")
    assert all(m.root == "." for m in manifests(out))
    # reshard with absolute roots: PiD's positional zip pairs only matching keys.
    build(raw_root, out)
    rewrite_manifest_roots(out, "absolute")
    tuples = _pid_positional_zip(out)
    assert len(tuples) == 31 and all(len(set(t)) == 1 for t in tuples)


def test_a_bad_missing_keys_setting_is_refused_naming_it(raw_root: Path) -> None:
    with pytest.raises(ShardingConfigError, match="new_modality_missing_keys='drop' is invalid.*'reshard'.*'keep'"):
        ShardingConfig(new_modality_missing_keys="drop")
    (raw_root / SOURCE / "sharding.yaml").write_text("new_modality_missing_keys: sometimes\n")
    with pytest.raises(ShardingConfigError, match=r"sharding\.yaml.*new_modality_missing_keys='sometimes'"):
        source_settings(LocalSourceStore(raw_root), SOURCE, ShardingConfig())
    assert parse_settings(b"new_modality_missing_keys: keep\n", "x") == {"new_modality_missing_keys": "keep"}
    assert ShardingConfig().version() == ShardingConfig(new_modality_missing_keys="reshard").version()
    assert ShardingConfig(new_modality_missing_keys="keep").version() != ShardingConfig().version()
    json.dumps(ShardingConfig().__dict__)  # the state file records it as plain JSON


def test_adding_a_modality_to_an_s3_output_sends_only_its_tars(
    s3_env, raw_root: Path, without_new: Path, tmp_path: Path
) -> None:
    from pid_platform.cli import shard_main
    from pid_platform.sharding.commit.s3_output import S3Output, cleanup_versions
    from pid_platform.sharding.tasks.staging import COPIED_STATE
    from tests.support.s3_objects import S3Requests, keys, pointer

    client = s3_env.client()
    s3_env.make_bucket("addmod")
    url = "s3://addmod/photos"

    def shard() -> int:
        return shard_main(["--input-dir", str(raw_root / SOURCE), "--output-dir", url, "--work-dir",
                           str(tmp_path / "work"), "--max-shard-size-mb", str(SMALL_BOUND_MB), "--num-workers", "1"])

    assert shard() == 0
    v1 = pointer(client, "addmod", "photos")["version"]
    v1_keys = keys(client, "addmod", f"photos/versions/{v1}")
    assert any("/image/" in k for k in v1_keys)

    shutil.move(without_new, raw_root / SOURCE / NEW)
    with S3Requests() as requests:
        assert shard() == 0
    writes = requests.writes()
    assert writes, "the new modality's tars were sent"
    # No image or caption tar was uploaded or copied: only the new modality's tars, key indexes,
    # manifests, settings, the claim and the pointer.
    assert [w for w in writes if "/image/" in w[1] or "/caption/" in w[1]] == []
    sent_tars = sorted(k for op, k in writes if k.endswith(".tar"))
    assert sent_tars and all(f"/{NEW}/" in k for k in sent_tars)
    # No tar copied either (the commit copies the staged plan's big state files inside the bucket).
    assert not any(op == "CopyObject" and not k.split("/.pid-build/")[-1].startswith(tuple(COPIED_STATE))
                   for op, k in writes)

    p2 = pointer(client, "addmod", "photos")
    assert p2["version"] != v1 and p2["uses"] == [v1] and v1 not in p2.get("retired", {})
    # The new version's folder holds its key indexes and manifests; its tars stay in v1's folder.
    v2_keys = keys(client, "addmod", f"photos/versions/{p2['version']}")
    assert not any(k.endswith(".tar") for k in v2_keys)
    assert set(keys(client, "addmod", f"photos/versions/{v1}")) >= set(v1_keys)

    # The loader reads all three modalities by the prefix; the items equal a local build's from scratch.
    scratch = build(raw_root, tmp_path / "scratch")
    mods = ["caption", "image", NEW]
    got = items(url, mods)
    assert len(got) == 32 and got == items(str(scratch.out), mods)
    assert items(url, mods, mode="index") == got
    # The readers of v1 (two modalities) still read it whole.
    v1_manifests = [f"{url}/versions/{v1}/{m}" for m in pointer(client, "addmod", "photos")["manifests"]]
    assert len(items(v1_manifests, ["caption", "image"])) == 32

    # The cleanup never deletes the version whose folder the current one reads its tars from.
    report = cleanup_versions(S3Output(url), grace_s=0)
    assert v1 not in report.removed
    assert items(url, mods) == got

    # Built again unchanged: the same version, nothing sent.
    with S3Requests() as requests:
        assert shard() == 0
    # (Only the bucket's write probe, the publish claim and the build lease, all deleted again.)
    housekeeping = (".write-probe-", ".pid-claims", ".pid-build")
    assert [w for w in requests.writes() if not w[1].split("/")[1].startswith(housekeeping)] == []
    assert pointer(client, "addmod", "photos")["version"] == p2["version"]


def test_the_tasked_build_adds_a_modality_as_the_one_process_build_does(raw_root: Path, without_new: Path,
                                                                       tmp_path: Path) -> None:
    from pid_platform.sharding.tasks.commit import run_commit
    from pid_platform.sharding.tasks.plan import run_plan
    from pid_platform.sharding.tasks.write import run_write_task
    from tests.support.build_data import output_files

    one, tasked = tmp_path / "one", tmp_path / "tasked"
    build(raw_root, one)
    build(raw_root, tasked)
    before = tars(tasked, "image")
    shutil.move(without_new, raw_root / SOURCE / NEW)
    build(raw_root, one)
    store, config = LocalSourceStore(raw_root), ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)
    run_plan(store, SOURCE, tasked, config)
    for i in range(3):
        run_write_task(store, SOURCE, tasked, i, 3)
    run_commit(tasked)
    assert {r: st.st_ino for r, st in tars(tasked, "image").items()} == {r: st.st_ino for r, st in before.items()}
    assert output_files(tasked) == output_files(one)


def test_a_version_stops_being_used_by_being_retired(
    s3_env, raw_root: Path, without_new: Path, tmp_path: Path
) -> None:
    """After a full re-shard the folder the added modality's version read from is retired with
    it, and the cleanup removes both; the current version stays whole."""
    from pid_platform.cli import shard_main
    from pid_platform.sharding.commit.s3_output import S3Output, cleanup_versions
    from tests.support.s3_objects import pointer

    client = s3_env.client()
    s3_env.make_bucket("addmod-retire")
    url = "s3://addmod-retire/photos"

    def shard(*extra: str) -> int:
        return shard_main(["--input-dir", str(raw_root / SOURCE), "--output-dir", url, "--work-dir",
                           str(tmp_path / "work"), "--num-workers", "1", *extra])

    assert shard("--max-shard-size-mb", str(SMALL_BOUND_MB)) == 0
    v1 = pointer(client, "addmod-retire", "photos")["version"]
    shutil.move(without_new, raw_root / SOURCE / NEW)
    assert shard("--max-shard-size-mb", str(SMALL_BOUND_MB)) == 0
    v2 = pointer(client, "addmod-retire", "photos")
    assert v2["uses"] == [v1]
    assert cleanup_versions(S3Output(url), grace_s=0).removed == []  # v1 is used, v2 current
    assert shard("--max-shard-size-mb", "1") == 0  # another bound: a full re-shard, a version of its own
    v3 = pointer(client, "addmod-retire", "photos")
    assert "uses" not in v3 and set(v3["retired"]) == {v1, v2["version"]}
    assert sorted(cleanup_versions(S3Output(url), grace_s=0).removed) == sorted([v1, v2["version"]])
    assert len(items(url, ["caption", "image", NEW])) == 32
