"""The build as tasks (``pid-shard plan | task --index I --of N | commit``), each task a real
process with its own working folder and HOME, equals the one-process ``pid-shard`` byte for byte;
a finished task does nothing when run again; a killed one, run again, gives the same bytes; the
commit refuses, naming them, while tasks are unfinished."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.tasks.records import WRITE, record_path, tasks_dir
from tests.support.build_data import SOURCE, output_files, snapshot
from tests.support.machines import kill_write_task_half_way, pid_shard, write_tasks

SETTINGS = ["--max-shard-size-mb", "0.25", "--part-size", "2", "--shuffle", "--seed", "3"]
# What the plan stages besides the tars: the same rows and settings as the one-process build.
STATE_COMPARED = ("intake_report.json", "samples.parquet", "plan.parquet", "sharding.json", "intake.json",
                  "intake_cache.parquet")


def _io(raw_root: Path, out: Path, source: bool = True) -> list[str]:
    return [*(["--input-dir", str(raw_root / SOURCE)] if source else []), "--output-dir", str(out)]


def _state(out: Path) -> dict[str, bytes]:
    return {n: (out / STATE_DIR / n).read_bytes() for n in STATE_COMPARED}


def _reference(raw_root: Path, tmp_path: Path, *extra: str) -> Path:
    ref = tmp_path / "reference"
    pid_shard(tmp_path, "reference", *_io(raw_root, ref), *SETTINGS, *extra, "--num-workers", "2")
    return ref


def _write_tasks(raw_root: Path, out: Path, tmp_path: Path, n: int, *extra: str) -> list[str]:
    """Write tasks 0 .. n-1 at once, each in its own process and folder; their outputs."""
    return write_tasks(tmp_path, n, *_io(raw_root, out), *extra)


def test_plan_tasks_commit_equal_one_process_build(raw_root: Path, tmp_path: Path) -> None:
    ref = _reference(raw_root, tmp_path)
    out = tmp_path / "out"
    # Intake tasks first (two slices in two processes): the plan then validates nothing itself.
    validated = []
    for i in range(2):
        res = pid_shard(tmp_path, f"intake-{i}", "task", "--stage", "intake", "--index", str(i), "--of", "2",
                         *_io(raw_root, out), "--num-workers", "1")
        validated.append(int(re.search(r"files validated: (\d+)", res.stdout).group(1)))
    # The slices are balanced by bytes, not count: together they are the 32 samples x 3 files.
    assert sum(validated) == 96 and all(v > 0 for v in validated)
    plan = pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    assert "files validated: 0  outcomes reused: 96" in plan.stdout
    assert not out.exists()  # nothing published before the commit

    outs = _write_tasks(raw_root, out, tmp_path, 3)
    assert all("shards written: " in o and "completion record" in o for o in outs)
    commit = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert f"source 'photos' -> {out}" in commit.stdout
    assert "manifests: 8 wdinfo.json" in commit.stdout

    files = output_files(out)
    assert files == output_files(ref)
    assert any(p.endswith(".tar") for p in files) and any(p.endswith("wdinfo.json") for p in files)
    assert _state(out) == _state(ref)
    assert not staging_dir(out).exists()
    # The version records which tasks made it.
    done = sorted(p.name for p in tasks_dir(out).glob(f"{WRITE}-*.json"))
    assert done == [f"write-{i:06d}-of-000003.json" for i in range(3)]


def test_bytes_do_not_depend_on_the_number_of_tasks(raw_root: Path, tmp_path: Path) -> None:
    ref = _reference(raw_root, tmp_path)
    for n in (1, 5):
        out = tmp_path / f"out-{n}"
        pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
        _write_tasks(raw_root, out, tmp_path, n)
        pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
        assert output_files(out) == output_files(ref), n


def test_a_finished_task_run_again_touches_nothing(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    intake = ["task", "--stage", "intake", "--index", "0", "--of", "1", *_io(raw_root, out)]
    pid_shard(tmp_path, "intake", *intake)
    pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    _write_tasks(raw_root, out, tmp_path, 3)
    staged = staging_dir(out)
    before = snapshot(staged)
    again = pid_shard(tmp_path, "again", "task", "--index", "1", "--of", "3", *_io(raw_root, out))
    assert "already done" in again.stdout and "nothing to do" in again.stdout
    again = pid_shard(tmp_path, "again", *intake)
    assert "already done" in again.stdout
    assert snapshot(staged) == before  # bytes, mtime and inode of every staged file, state included
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert output_files(out) == output_files(_reference(raw_root, tmp_path))


def test_write_task_killed_half_way_and_rerun_gives_the_same_bytes(raw_root: Path, tmp_path: Path) -> None:
    ref = _reference(raw_root, tmp_path)
    out = tmp_path / "out"
    pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    kill_write_task_half_way(tmp_path, "doomed", *_io(raw_root, out))  # one shard in place, the others not yet
    staged = staging_dir(out)
    assert not record_path(staged, WRITE, 0, 2).exists()  # no record: the task is not done

    refused = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False), check=False)
    assert refused.returncode == 2 and "no write task has finished" in refused.stderr

    rerun = pid_shard(tmp_path, "rerun", "task", "--index", "0", "--of", "2", *_io(raw_root, out))
    kept = int(rerun.stdout.split("already up to date: ")[1].split(";")[0])
    assert kept >= 1  # the shard finished before the kill was kept, not written again
    pid_shard(tmp_path, "other", "task", "--index", "1", "--of", "2", *_io(raw_root, out))
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert output_files(out) == output_files(ref)
    assert not [p for p in out.rglob("*.tmp-*")]


def test_a_killed_one_process_build_is_finished_by_write_task_0_of_1_and_the_commit(
    raw_root: Path, tmp_path: Path
) -> None:
    """``pid-shard`` is the plan, write task 0 of 1 and the commit: killed in its write task, it
    left exactly what a plan and a half-done task leave, and those commands finish it."""
    ref = _reference(raw_root, tmp_path)
    out = tmp_path / "out"
    kill_write_task_half_way(tmp_path, "doomed", *_io(raw_root, out), *SETTINGS, command=())
    assert not record_path(staging_dir(out), WRITE, 0, 1).exists()
    rerun = pid_shard(tmp_path, "rerun", "task", "--index", "0", "--of", "1", *_io(raw_root, out))
    assert int(rerun.stdout.split("already up to date: ")[1].split(";")[0]) >= 1  # kept, not rewritten
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert output_files(out) == output_files(ref)
    assert record_path(out, WRITE, 0, 1).is_file()  # its record went out with the version


def test_commit_refuses_naming_the_unfinished_tasks(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    none = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False), check=False)
    assert none.returncode == 2 and "Traceback" not in none.stderr
    assert "no write task has finished" in none.stderr
    for i in (0, 3):
        pid_shard(tmp_path, f"task-{i}", "task", "--index", str(i), "--of", "4", *_io(raw_root, out))
    res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("pid-shard commit: error: ")
    assert "write tasks 1, 2 of 4 have not finished" in res.stderr and "nothing was published" in res.stderr
    assert not out.exists()
    _write_tasks(raw_root, out, tmp_path, 4)  # 0 and 3 find their records; 1 and 2 write
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert output_files(out) == output_files(_reference(raw_root, tmp_path))


def test_rebuild_through_tasks_reuses_every_unchanged_tar(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid_shard(tmp_path, "first", *_io(raw_root, out), *SETTINGS)  # the one-process build first
    inodes = {p: (out / p).stat().st_ino for p in output_files(out) if p.endswith(".tar")}
    plan = pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    assert "up to date" in plan.stdout and not staging_dir(out).exists()
    # Another sharding of the same samples: the plan decodes nothing, the tasks write only new shards.
    plan = pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS[:-1], "4")
    assert "files validated: 0 " in plan.stdout
    _write_tasks(raw_root, out, tmp_path, 2)
    task = pid_shard(tmp_path, "again", "task", "--index", "0", "--of", "2", *_io(raw_root, out))
    assert "already done" in task.stdout
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    # Back to the first seed: every tar of the first build is unchanged, so each is hard-linked.
    pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    outs = _write_tasks(raw_root, out, tmp_path, 2)
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert all("shards written: " in o for o in outs)
    assert output_files(out) == output_files(_reference(raw_root, tmp_path))
    assert json.loads((out / STATE_DIR / "sharding.json").read_bytes())["seed"] == 3
    del inodes  # the seed-4 build replaced them; reuse across a swap is tests/test_build_incremental.py's


def test_task_argument_errors_are_clear(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [
        (["task", "--index", "3", "--of", "3", *_io(raw_root, out)], "must be below --of"),
        (["task", "--index", "-1", "--of", "3", *_io(raw_root, out)], "--index: must be >= 0"),
        (["task", "--of", "3", *_io(raw_root, out)], "required: --index"),
        (["task", "--index", "0", "--of", "2", "--stage", "merge", *_io(raw_root, out)], "invalid choice"),
        (["commit", "--output-dir", "s3://bucket/x", "--manifest-root", "absolute"], "keep relative roots"),
        (["commit", "--output-dir", "s3://Bucket/x"], "not an s3://bucket/prefix URL"),
        (["plan", "--output-dir", str(out)], "required: --input-dir"),
    ]
    for argv, expected in cases:
        res = pid_shard(tmp_path, "args", *argv, check=False)
        assert res.returncode == 2, argv
        assert "Traceback" not in res.stderr and expected in res.stderr, (argv, res.stderr)
    # A write task before any plan: a build error naming the step to run first.
    res = pid_shard(tmp_path, "args", "task", "--index", "0", "--of", "2", *_io(raw_root, out), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "run `pid-shard plan`" in res.stderr


def test_commit_sends_back_a_task_whose_shard_was_damaged_after_its_record(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid_shard(tmp_path, "plan", "plan", *_io(raw_root, out), *SETTINGS)
    _write_tasks(raw_root, out, tmp_path, 2)
    staged = staging_dir(out)
    rec = json.loads(record_path(staged, WRITE, 1, 2).read_bytes())
    assert rec["plan_shards_sha256"] and rec["shards"][1] > rec["shards"][0] and rec["written"]
    victim = sorted(p for p in staged.rglob("*.tar"))[-1]  # the last shard: write task 1's
    victim.unlink()
    res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False), check=False)
    assert res.returncode == 2 and "write task 1 of 2 has not finished" in res.stderr
    assert "must run again" in res.stderr and not record_path(staged, WRITE, 1, 2).exists()
    again = pid_shard(tmp_path, "again", "task", "--index", "1", "--of", "2", *_io(raw_root, out))
    assert "shards written: 1 " in again.stdout  # only the damaged shard; the others are kept
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, out, source=False))
    assert output_files(out) == output_files(_reference(raw_root, tmp_path))


def test_slices_cover_every_item_once_in_order() -> None:
    from pid_platform.sharding.intake.task import slice_bounds

    for total in (0, 1, 2, 7, 15, 100):
        for n in (1, 2, 3, 5, 16):
            spans = [slice_bounds(total, i, n) for i in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def test_a_task_process_starts_without_pyarrow_compute() -> None:
    # Importing pyarrow.compute costs a task process ~60 ms at start; build modules take it from
    # pid_platform.sharding.compute, imported on first use (by plans, commits and the intake).
    code = ("import sys, pid_platform.cli, pid_platform.sharding.tasks.run; "
            "print(sorted(m for m in sys.modules if m in ('pyarrow.compute', 'pyarrow.dataset')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
