"""Every way of running a build gives readers the same output (issue 31's acceptance), for a
folder and for an ``s3://`` output:

* ``pid-shard`` (one process);
* ``pid-shard plan | task --index I --of 3 | commit``, each a real process with its own HOME and
  work folder (``tests/support/machines.py``), sharing only the source and the output;
* Dagster's fan-out of ``source_build`` on a real sqlite instance with the multiprocess executor
  (every step its own process, three write-task steps), as ``tests/test_build_fanout.py`` runs it.

Each output is built twice by each way: from nothing, then over itself after the source lost a
sample (the incremental build, where unchanged shards are kept or copied inside the bucket).
What is compared is what a reader sees: every tar byte for byte, every key index's rows (and its
bytes), every ``wdinfo.json`` (fields and bytes), and the set of files; the build's private state
folder (``.pid-build``: task records, stamps, caches) is no part of the output contract and is
left out.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from loader.formats.layout import STATE_DIR
from loader.formats.wdinfo import WDINFO_NAME
from pid_platform.defs.partitions import SOURCES
from pid_platform.sharding.settings import SETTINGS_NAME
from tests.support.build_data import SOURCE, output_files
from tests.support.dagster_runs import use_roots
from tests.support.machines import pid_shard, write_tasks
from tests.support.s3_objects import current_version, pointer
from tests.support.seaweedfs import SeaweedS3, upload_tree
from tests.test_build_fanout import (
    PID_SHARD_SETTINGS,
    SETTINGS_FILE,
    TASKS,
    WRITE_STEP,
    _execute,
    _launchpad_config,
    _task_steps,
)

_BUCKETS = itertools.count()

# Normalised before comparing, and why:
# * nothing inside a version: every tar, key index and ``wdinfo.json`` is compared byte for byte
#   (the key index's rows and the manifest's parsed fields too, so a failure reads as contents).
#   A manifest names its tars and key indexes relative to its own folder and holds no version id,
#   clock, run id or absolute root, so a difference there is a real one.
# * the S3 pointer (``pid-current.json``): ``built_by`` names the host and pid that switched it, and
#   ``retired`` when older versions stopped being current; both differ from run to run by design
#   and no reader reads them. Its ``version`` id (the plan derives it from what is built),
#   ``manifests``, ``uses`` and ``format_version`` are compared.
# Left out as no part of the output contract: ``.pid-build/`` (the state folder), whose task
# records say how many write tasks made the version (one for ``pid-shard``, three for the others).
POINTER_NOT_COMPARED = ("built_by", "retired")


def _reader_view(files: dict[str, bytes]) -> dict[str, object]:
    """Path -> what a reader gets from it: a tar's bytes, a key index's rows and bytes, a manifest
    parsed and its bytes; everything under the state folder left out."""
    view: dict[str, object] = {}
    for path, data in files.items():
        if STATE_DIR in path.split("/"):
            continue
        if path.endswith(".parquet"):
            view[path] = (pq.read_table(io.BytesIO(data)).to_pylist(), data)
        elif path.endswith(WDINFO_NAME):
            view[path] = (json.loads(data), data)
        else:
            view[path] = data
    return view


def _assert_same(reference: dict[str, object], other: dict[str, object], way: str) -> None:
    """Equal views, or a failure naming the files that differ (not a dump of megabytes)."""
    assert sorted(other) == sorted(reference), f"{way}: other files than pid-shard's"
    differ = [p for p in reference if other[p] != reference[p]]
    assert not differ, f"{way}: differs from pid-shard in {differ}"
    kinds = {p.rsplit(".", 1)[-1] for p in reference}
    assert {"tar", "parquet", "json"} <= kinds, kinds  # the comparison saw tars, indexes and manifests


def _write_settings_file(raw_root: Path) -> None:
    # The source's own settings file, as the launchpad writes it: the Dagster run reads it, and it
    # says what PID_SHARD_SETTINGS tells the command line.
    (raw_root / SOURCE / SETTINGS_NAME).write_text(SETTINGS_FILE)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """A persistent (sqlite) instance, as the multiprocess executor needs; the source registered."""
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions(SOURCES, [SOURCE])
        yield inst


def _dagster_fanout(instance: dg.DagsterInstance) -> None:
    """The whole ``source_build`` through the multiprocess executor, into PID_OUTPUT_ROOT; it must
    have fanned out into TASKS write-task steps (not run the build in one step)."""
    ok, run_id = _execute(instance, _launchpad_config())
    assert ok
    assert _task_steps(instance, run_id, dg.DagsterEventType.STEP_SUCCESS) == [
        f"{WRITE_STEP}[{i}_of_{TASKS}]" for i in range(TASKS)]


def _last_sample_files(raw_root: Path) -> list[str]:
    """The source files (relative to the source) of the sample whose key sorts last."""
    folder = raw_root / SOURCE
    last = max(p.stem for p in (folder / "image").iterdir())
    return sorted(p.relative_to(folder).as_posix() for p in folder.glob(f"*/{last}.*"))


# Each test builds twice: once from nothing, then again over its own output after the source
# lost a sample (the incremental build: unchanged shards kept or copied, the changed ones written).
ROUNDS = ("first", "incremental")


@pytest.mark.slow
def test_a_folder_output_is_the_same_built_three_ways(
    raw_root: Path, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _write_settings_file(raw_root)
    source = ["--input-dir", str(raw_root / SOURCE)]
    one, tasked = tmp_path / "one-process", tmp_path / "tasked"
    use_roots(monkeypatch, raw_root, tmp_path / "dagster")
    monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / "dagster-work"))
    for build in ROUNDS:
        if build == "incremental":
            gone = _last_sample_files(raw_root)
            assert len(gone) == 3
            for name in gone:
                (raw_root / SOURCE / name).unlink()
        pid_shard(tmp_path, "one-process", *source, "--output-dir", str(one), *PID_SHARD_SETTINGS,
                  "--num-workers", "2")
        reference = _reader_view(output_files(one))

        pid_shard(tmp_path, f"planner-{build}", "plan", *source, "--output-dir", str(tasked), *PID_SHARD_SETTINGS)
        write_tasks(tmp_path, TASKS, *source, "--output-dir", str(tasked))
        pid_shard(tmp_path, f"committer-{build}", "commit", "--output-dir", str(tasked))
        _assert_same(reference, _reader_view(output_files(tasked)), f"{build}: plan | task x3 | commit")

        _dagster_fanout(instance)
        _assert_same(reference, _reader_view(output_files(tmp_path / "dagster" / SOURCE)), f"{build}: Dagster")
    assert sum(json.loads(v[1])["total_key_count"] for p, v in reference.items() if p.endswith(WDINFO_NAME)) == 31


@pytest.mark.slow
def test_an_s3_output_is_the_same_built_three_ways(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = next(_BUCKETS)
    client = s3_env.client()
    raw, out = s3_env.make_bucket(f"ways-raw-{n}"), s3_env.make_bucket(f"ways-out-{n}")
    _write_settings_file(raw_root)
    upload_tree(client, raw_root, raw, "drops")
    source = ["--input-dir", f"s3://{raw}/drops/{SOURCE}"]
    monkeypatch.setenv("PID_RAW_ROOT", f"s3://{raw}/drops")
    monkeypatch.setenv("PID_OUTPUT_ROOT", f"s3://{out}/dagster")
    monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / "dagster-work"))

    def published(prefix: str) -> tuple[dict, dict[str, object]]:
        at = {k: v for k, v in pointer(client, out, prefix).items() if k not in POINTER_NOT_COMPARED}
        assert at["version"] and at["manifests"]
        return at, _reader_view(current_version(client, out, prefix))

    versions = []
    for build in ROUNDS:
        if build == "incremental":
            for name in _last_sample_files(raw_root):
                client.delete_object(Bucket=raw, Key=f"drops/{SOURCE}/{name}")
        pid_shard(tmp_path, "one-process", *source, "--output-dir", f"s3://{out}/one-process",
                  *PID_SHARD_SETTINGS, "--num-workers", "2")
        ref_pointer, reference = published("one-process")
        versions.append(ref_pointer["version"])

        url = f"s3://{out}/tasked"
        pid_shard(tmp_path, f"planner-{build}", "plan", *source, "--output-dir", url, *PID_SHARD_SETTINGS)
        write_tasks(tmp_path, TASKS, *source, "--output-dir", url)
        pid_shard(tmp_path, f"committer-{build}", "commit", "--output-dir", url)
        tasked_pointer, tasked = published("tasked")
        _assert_same(reference, tasked, f"{build}: plan | task x3 | commit")
        assert tasked_pointer == ref_pointer

        _dagster_fanout(instance)
        dagster_pointer, by_dagster = published(f"dagster/{SOURCE}")
        _assert_same(reference, by_dagster, f"{build}: Dagster")
        assert dagster_pointer == ref_pointer
    assert versions[0] != versions[1]
    assert sum(json.loads(v[1])["total_key_count"] for p, v in reference.items() if p.endswith(WDINFO_NAME)) == 31
