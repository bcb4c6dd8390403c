"""The plan on disk (``plan/plan_files.py``): both writers give the same two files; the
coordinator reads one row per shard; a write task reads only the row groups of its own shards;
and a real tasked build turns no sample into an object outside its write tasks."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.intake.task import slice_bounds
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.plan import tables
from pid_platform.sharding.plan.columnar import write_plan_file
from pid_platform.sharding.plan.plan_files import (
    PLAN,
    SHARDS,
    iter_shard_range,
    load_shards,
    shard_ref,
    write_cut,
    write_planned,
)
from pid_platform.sharding.plan.shard_plan import ShardingConfig, plan_shards
from pid_platform.sharding.plan.tables import read_plans, samples_table, write_table
from pid_platform.sharding.storage import LocalSourceStore
from tests.support.build_data import SMALL_BOUND_MB, SOURCE, build, output_files
from tests.test_plan_columnar import MODS, make_samples

CONFIG = ShardingConfig(max_shard_size_mb=1.0, part_size=3, shuffle=True, seed=5)


def _state(folder: Path) -> Path:
    (folder / STATE_DIR).mkdir(parents=True, exist_ok=True)
    return folder / STATE_DIR


def test_both_plan_writers_give_the_same_two_files(tmp_path: Path) -> None:
    samples = make_samples(700, 3)
    objects, columns = tmp_path / "objects", tmp_path / "columns"
    write_table(_state(columns) / "samples.parquet", samples_table(samples, MODS))
    plans = plan_shards(samples, MODS, CONFIG)
    refs_objects = write_planned(objects, plans, MODS, CONFIG)
    refs_columns = write_cut(columns, _state(columns) / "samples.parquet", CONFIG)
    for name in (PLAN, SHARDS):
        assert (_state(objects) / name).read_bytes() == (_state(columns) / name).read_bytes()
    assert refs_objects == refs_columns == [shard_ref(p) for p in plans]
    assert len(refs_columns) > 20


def _small_row_groups(folder: Path, n: int, rows: int) -> list:
    """A plan of ``n`` samples in row groups of ``rows`` (a big source's layout, small)."""
    samples = make_samples(n, 11)
    state = _state(folder)
    write_table(state / "samples.parquet", samples_table(samples, MODS))
    write_plan_file(state / "samples.parquet", state / PLAN, CONFIG, row_group_rows=rows, batch_rows=37,
                    shards_path=state / SHARDS)
    return read_plans(state / PLAN, CONFIG.part_size)


def test_a_write_task_reads_only_the_row_groups_of_its_own_shards(tmp_path: Path, monkeypatch) -> None:
    everything = _small_row_groups(tmp_path, 900, 50)
    shards = load_shards(tmp_path, CONFIG)
    assert shards == [shard_ref(p) for p in everything]
    assert pq.ParquetFile(_state(tmp_path) / PLAN).num_row_groups == 18
    read: list[int] = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, g, *a, **k: read.append(g) or real(self, g, *a, **k))
    starts = [0]
    for p in everything:
        starts.append(starts[-1] + p.count)
    for of in (1, 4, 9):
        for index in range(of):
            read.clear()
            first, stop = slice_bounds(len(shards), index, of)
            mine = [p for batch in iter_shard_range(tmp_path, CONFIG, shards, first, stop) for p in batch]
            assert mine == everything[first:stop]
            # Exactly the row groups holding rows starts[first]:starts[stop], each once.
            want = list(range(starts[first] // 50, (starts[stop] - 1) // 50 + 1)) if stop > first else []
            assert read == want
            if of == 9:
                assert len(read) < 18 / 2  # a ninth of the plan, not the plan


def test_stale_or_missing_shards_file_falls_back_to_the_plan_and_mixed_files_are_refused(
        tmp_path: Path, caplog) -> None:
    everything = _small_row_groups(tmp_path, 400, 64)
    want = [shard_ref(p) for p in everything]
    state = _state(tmp_path)
    (state / SHARDS).unlink()
    assert load_shards(tmp_path, CONFIG) == want
    # A shards file of another plan (other rows) beside this plan: named, then not used.
    other = tmp_path / "other"
    _small_row_groups(other, 300, 64)
    (state / SHARDS).write_bytes((_state(other) / SHARDS).read_bytes())
    with caplog.at_level(logging.WARNING):
        assert load_shards(tmp_path, CONFIG) == want
    assert "written for another plan" in caplog.text and str(state / SHARDS) in caplog.text
    # A task handed the shards of another plan refuses rather than write the wrong samples.
    with pytest.raises(ValueError, match="two plans"):
        list(iter_shard_range(tmp_path, CONFIG, load_shards(other, CONFIG), 0, 3))


def test_a_tasked_build_makes_sample_objects_only_in_its_write_tasks(raw_root: Path, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """The plan cuts columns and the commit reads a row per shard; each write task turns only
    its own shards' rows into objects. The bytes are the one-process build's."""
    from pid_platform.sharding.tasks.commit import run_commit
    from pid_platform.sharding.tasks.plan import run_plan
    from pid_platform.sharding.tasks.write import run_write_task

    ref = tmp_path / "one"
    build(raw_root, ref)
    converted: list[int] = []
    real = tables.table_samples
    monkeypatch.setattr(tables, "table_samples", lambda t: converted.append(t.num_rows) or real(t))

    def no_object_plan(*_a, **_k):
        raise AssertionError("the plan step planned objects")

    monkeypatch.setattr("pid_platform.sharding.plan.add_modality.plan_shards", no_object_plan)
    out, store = tmp_path / "tasked", LocalSourceStore(raw_root)
    config = ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)
    plan = run_plan(store, SOURCE, out, config)
    assert converted == [] and plan.shards > 6
    shards = load_shards(staging_dir(out), config)
    for i in range(3):
        converted.clear()
        first, stop = slice_bounds(len(shards), i, 3)
        run_write_task(store, SOURCE, out, i, 3)
        assert converted == [sum(s.count for s in shards[first:stop])]
    converted.clear()
    run_commit(out)
    assert converted == []
    assert output_files(out) == output_files(ref)
    # A rebuild that changes nothing stops at the intake; one with other settings re-cuts columns.
    run_plan(store, SOURCE, out, ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB, shuffle=True))
    assert converted == []


def test_the_committed_build_carries_both_plan_files(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    config = ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)
    assert (out / STATE_DIR / SHARDS).is_file()
    assert load_shards(out, config) == [shard_ref(p) for p in read_plans(out / STATE_DIR / PLAN, config.part_size)]


def test_a_ranged_object_reads_any_part_and_refuses_a_replaced_object(tmp_path: Path) -> None:
    from loader.io.errors import PreconditionFailedError
    from loader.io.objects import open_store

    store = open_store(tmp_path)
    data = bytes(range(256)) * 64
    store.put("plan.parquet", data)
    with store.open_ranged("plan.parquet") as f:
        assert f.seekable() and f.read(4) == data[:4]
        f.seek(-8, 2)
        assert f.read() == data[-8:] and f.read(3) == b""
        f.seek(1000)
        assert f.read(10) == data[1000:1010] and f.tell() == 1010
        assert f.requests == 3
        store.put("plan.parquet", b"another plan" * 100)
        f.seek(0)
        with pytest.raises(PreconditionFailedError):
            f.read(4)


def test_s3_write_tasks_read_the_staged_plan_by_ranges_and_refuse_another_plans_rows(
        s3_env, raw_root: Path, tmp_path: Path, capsys) -> None:
    from pid_platform.cli import shard_main
    from pid_platform.sharding.tasks.staging import STAGED
    from tests.support.s3_objects import S3Requests

    bucket = s3_env.make_bucket("plan-files-ranges")
    url = f"s3://{bucket}/photos"
    io_args = ["--input-dir", str(raw_root / SOURCE), "--output-dir", url]
    machines = iter(range(100))

    def work() -> list[str]:  # a machine of its own for each task
        return ["--work-dir", str(tmp_path / "machines" / f"m{next(machines)}")]

    assert shard_main(["plan", *io_args, "--max-shard-size-mb", str(SMALL_BOUND_MB), *work()]) == 0
    with S3Requests() as requests:
        assert shard_main(["task", "--index", "0", "--of", "2", *io_args, "--num-workers", "1", *work()]) == 0
    plan_key = f"photos/{STAGED}/state/plan.parquet"
    reads = [r for op, k, r in requests.calls if op == "GetObject" and k == plan_key]
    # The footer and the task's row group, each a range; the plan is never fetched whole.
    assert reads and all(r is not None and r.startswith("bytes=") for r in reads) and len(reads) <= 12
    # The staged plan.parquet replaced by another plan's (the same samples, other shards): the
    # other task refuses, naming the object, and sends nothing.
    client = s3_env.client()
    other = tmp_path / "other"
    build(raw_root, other, max_shard_size_mb=SMALL_BOUND_MB / 2)
    client.put_object(Bucket=bucket, Key=plan_key, Body=(other / STATE_DIR / PLAN).read_bytes())
    capsys.readouterr()
    assert shard_main(["task", "--index", "1", "--of", "2", *io_args, "--num-workers", "1", *work()]) != 0
    err = capsys.readouterr().err
    assert f"{url}/{STAGED}/state/plan.parquet: not the plan" in err and "staging anew" in err
    assert not any(k.startswith(f"photos/{STAGED}/tasks/write-000001") for k in
                   (o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="photos/").get("Contents", [])))


def test_the_s3_commit_copies_the_big_state_inside_the_bucket_and_refuses_a_plan_staged_meanwhile(
        s3_env, raw_root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    from loader.formats.version_pointer import POINTER_NAME
    from loader.io.objects import S3Objects
    from pid_platform.cli import shard_main
    from pid_platform.sharding.tasks.staging import STAGED
    from tests.support.s3_objects import S3Requests, keys, pointer

    bucket = s3_env.make_bucket("plan-files-commit")
    client = s3_env.client()
    machines = iter(range(100))

    def work() -> list[str]:
        return ["--work-dir", str(tmp_path / "machines" / f"m{next(machines)}")]

    def plan_and_tasks(prefix: str) -> list[str]:
        io_args = ["--input-dir", str(raw_root / SOURCE), "--output-dir", f"s3://{bucket}/{prefix}"]
        assert shard_main(["plan", *io_args, "--max-shard-size-mb", str(SMALL_BOUND_MB), *work()]) == 0
        for i in range(2):
            assert shard_main(["task", "--index", str(i), "--of", "2", *io_args, "--num-workers", "1", *work()]) == 0
        return ["--output-dir", f"s3://{bucket}/{prefix}"]

    # A plan staged anew while the commit copies: staged.json changes under it; nothing switches.
    out_args = plan_and_tasks("raced")
    real_copy = S3Objects.copy
    raced = []

    def copy_then_restage(self, src, dst):
        real_copy(self, src, dst)
        if "/.pid-build/" in dst and not raced:
            raced.append(dst)
            key = f"raced/{STAGED}/staged.json"
            doc = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
            client.put_object(Bucket=bucket, Key=key, Body=json.dumps({**doc, "version": "0" * 20}).encode())

    monkeypatch.setattr(S3Objects, "copy", copy_then_restage)
    capsys.readouterr()
    assert shard_main(["commit", *out_args, *work()]) != 0
    assert "changed while the commit copied the staged state" in capsys.readouterr().err and raced
    assert not [k for k in keys(client, bucket, "raced") if k.endswith(POINTER_NAME)]  # nothing published
    monkeypatch.setattr(S3Objects, "copy", real_copy)

    # An undisturbed commit: the big state files are copied, never fetched whole.
    out_args = plan_and_tasks("photos")
    staged_sha = json.loads(client.get_object(Bucket=bucket, Key=f"photos/{STAGED}/staged.json")["Body"].read())["state"]
    with S3Requests() as requests:
        assert shard_main(["commit", *out_args, *work()]) == 0
    calls = requests.calls
    big = ("samples.parquet", "plan.parquet", "intake_cache.parquet")
    whole_gets = [k for op, k, r in calls if op == "GetObject" and r is None and k.endswith(big)]
    assert whole_gets == []
    copied = sorted(k.rsplit("/", 1)[1] for op, k, _ in calls if op == "CopyObject")
    assert copied == sorted(big)
    version = pointer(client, bucket, "photos")["version"]
    for name in big:  # the very bytes the plan staged
        got = client.get_object(Bucket=bucket, Key=f"photos/versions/{version}/.pid-build/{name}")["Body"].read()
        assert hashlib.sha256(got).hexdigest() == staged_sha[name]


def test_shard_plans_stream_a_row_group_at_a_time_with_no_shard_cut_in_two(tmp_path: Path) -> None:
    from pid_platform.sharding.plan.plan_files import iter_shard_plans

    everything = _small_row_groups(tmp_path, 900, 50)
    chunks = list(iter_shard_plans(tmp_path, CONFIG))
    assert [p for c in chunks for p in c] == everything
    assert len(chunks) > 5
    # A chunk holds the shards that end in its row group: never more than a row group's rows
    # plus the shard that ran on into it.
    biggest = max(p.count for p in everything)
    assert all(sum(p.count for p in c) <= 50 + biggest for c in chunks)


def test_a_write_task_holds_one_row_groups_shards_at_a_time(tmp_path: Path, monkeypatch) -> None:
    everything = _small_row_groups(tmp_path, 900, 50)
    shards = load_shards(tmp_path, CONFIG)
    biggest = max(p.count for p in everything)
    read: list[int] = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, g, *a, **k: read.append(g) or real(self, g, *a, **k))
    for of in (1, 2, 5):
        for index in range(of):
            read.clear()
            first, stop = slice_bounds(len(shards), index, of)
            batches = list(iter_shard_range(tmp_path, CONFIG, shards, first, stop))
            assert [p for b in batches for p in b] == everything[first:stop]
            assert all(b and sum(p.count for p in b) <= 50 + biggest for b in batches)
            assert len(read) == len(set(read))  # each row group read once
            if of == 1:
                assert len(batches) > 10


def test_the_one_process_build_and_write_tasks_turn_a_row_group_into_objects_at_a_time(
        raw_root: Path, tmp_path: Path, monkeypatch) -> None:
    """With plan row groups of 5 rows, no step converts more than a row group's shards (plus the
    shard that runs on into it) into sample objects, and the bytes do not change."""
    from pid_platform.sharding.plan import columnar
    from pid_platform.sharding.tasks.commit import run_commit
    from pid_platform.sharding.tasks.plan import run_plan
    from pid_platform.sharding.tasks.write import run_write_task

    ref = tmp_path / "ref"
    build(raw_root, ref, shard_size=3)
    monkeypatch.setattr(columnar, "ROW_GROUP_ROWS", 5)
    converted: list[int] = []
    real = tables.table_samples
    monkeypatch.setattr(tables, "table_samples", lambda t: converted.append(t.num_rows) or real(t))
    one = tmp_path / "one"
    build(raw_root, one, shard_size=3)
    assert len(converted) > 5 and max(converted) <= 5 + 3 and sum(converted) == 32
    assert output_files(one) == output_files(ref)

    converted.clear()
    out, store = tmp_path / "tasked", LocalSourceStore(raw_root)
    run_plan(store, SOURCE, out, ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB, shard_size=3))
    for i in range(2):
        run_write_task(store, SOURCE, out, i, 2)
    run_commit(out)
    assert len(converted) > 5 and max(converted) <= 5 + 3 and sum(converted) == 32
    assert output_files(out) == output_files(ref)
