"""The tasked build of an ``s3://`` output (``pid-shard plan | task --index I --of N | commit``):
each task a real process with its own HOME and work folder (``PID_WORK_ROOT``), sharing only the
bucket (SeaweedFS on 127.0.0.1) and the source; the version equals the one-process ``pid-shard``
build byte for byte, its id included; a killed write task run again gives the same bytes and
keeps what it had sent; the commit refuses while a task is unfinished and publishes nothing."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from pid_platform.sharding.tasks.staging import STAGED
from tests.conftest import SOURCE
from tests.support.machines import kill_write_task_half_way, pid_shard, write_tasks
from tests.support.s3_objects import current_version, keys, objects, pointer
from tests.support.seaweedfs import SeaweedS3, upload_tree

_TEST_NUMBER = itertools.count()
SETTINGS = ["--max-shard-size-mb", "0.25", "--part-size", "2", "--shuffle", "--seed", "3"]


@dataclass(frozen=True)
class Buckets:
    """A source bucket and an output bucket of this test's own (the server lives for the session)."""

    source: str  # s3://.../photos
    out: str  # the output bucket's name
    client: object

    def url(self, prefix: str) -> str:
        return f"s3://{self.out}/{prefix}"

    def version(self, prefix: str) -> tuple[str, dict[str, bytes]]:
        """The id and objects of the version ``prefix``'s pointer names."""
        return pointer(self.client, self.out, prefix)["version"], current_version(self.client, self.out, prefix)

    def keys(self, prefix: str) -> list[str]:
        return keys(self.client, self.out, prefix)


@pytest.fixture
def s3(s3_env: SeaweedS3, raw_root: Path) -> Buckets:
    n = next(_TEST_NUMBER)
    raw, out = s3_env.make_bucket(f"tasks-raw-{n}"), s3_env.make_bucket(f"tasks-out-{n}")
    client = s3_env.client()
    upload_tree(client, raw_root, raw, "drops")
    return Buckets(f"s3://{raw}/drops/{SOURCE}", out, client)


def _io(source: str | None, url: str) -> list[str]:
    return [*(["--input-dir", source] if source else []), "--output-dir", url]


def _write_tasks(tmp_path: Path, source: str, url: str, n: int) -> list[str]:
    return write_tasks(tmp_path, n, *_io(source, url))


def _reference(tmp_path: Path, s3: Buckets, name: str = "reference", *settings: str) -> tuple[str, dict[str, bytes]]:
    """The one-process build of the source into a prefix of its own: its version id and objects."""
    pid_shard(tmp_path, name, *_io(s3.source, s3.url(name)), *(settings or SETTINGS), "--num-workers", "2")
    return s3.version(name)


def test_tasks_on_three_machines_equal_the_one_process_build(s3: Buckets, tmp_path: Path) -> None:
    ref_version, ref = _reference(tmp_path, s3)
    url = s3.url("tasked")
    validated = 0
    for i in range(2):  # intake tasks spread the validation; the plan then validates nothing itself
        res = pid_shard(tmp_path, f"intake-{i}", "task", "--stage", "intake", "--index", str(i), "--of", "2",
                        *_io(s3.source, url))
        validated += int(res.stdout.split("files validated: ")[1].split()[0])
    assert validated == 96  # 32 samples x 3 modalities, each file by one task
    plan = pid_shard(tmp_path, "planner", "plan", *_io(s3.source, url), *SETTINGS)
    assert "files validated: 0  outcomes reused: 96" in plan.stdout
    assert f"staged as version {ref_version}" in plan.stdout  # the id comes from the plan
    assert "pid-current.json" not in s3.keys("tasked")  # nothing published before the commit

    outs = _write_tasks(tmp_path, s3.source, url, 3)
    assert all("shards written: " in o and "completion record" in o for o in outs)
    again = pid_shard(tmp_path, "task-1", "task", "--index", "1", "--of", "3", *_io(s3.source, url))
    assert "already done" in again.stdout
    for i in range(3):  # a write task keeps no tar once it is in the bucket
        assert not list((tmp_path / "machines" / f"task-{i}").rglob("*.tar"))

    commit = pid_shard(tmp_path, "committer", "commit", *_io(None, url))
    assert f"-> {url}/versions/{ref_version}" in commit.stdout and "manifests: 8 wdinfo.json" in commit.stdout
    assert s3.version("tasked") == (ref_version, ref)
    assert any(k.endswith(".tar") for k in ref) and any(k.endswith("wdinfo.json") for k in ref)
    assert not [k for k in s3.keys("tasked") if k.startswith(STAGED)]  # the staging is gone

    # A plan of the same build again: already served, nothing staged, the tasks have nothing to do.
    plan = pid_shard(tmp_path, "planner-2", "plan", *_io(s3.source, url), *SETTINGS)
    assert "already serves the version" in plan.stdout
    assert "files validated: 0 " in plan.stdout  # a fresh machine: the version's outcomes were reused
    task = pid_shard(tmp_path, "late", "task", "--index", "0", "--of", "2", *_io(s3.source, url))
    assert "nothing staged" in task.stdout
    assert "nothing staged" in pid_shard(tmp_path, "committer", "commit", *_io(None, url)).stdout


def test_a_killed_write_task_rerun_gives_the_same_bytes_and_the_commit_waits_for_it(
    s3: Buckets, tmp_path: Path
) -> None:
    ref_version, ref = _reference(tmp_path, s3)
    url = s3.url("killed")
    pid_shard(tmp_path, "planner", "plan", *_io(s3.source, url), *SETTINGS)
    kill_write_task_half_way(tmp_path, "doomed", *_io(s3.source, url))  # one shard in place, the others not yet

    pid_shard(tmp_path, "other", "task", "--index", "1", "--of", "2", *_io(s3.source, url))
    refused = pid_shard(tmp_path, "committer", "commit", *_io(None, url), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "write task 0 of 2 has not finished" in refused.stderr and "nothing was published" in refused.stderr
    assert "pid-current.json" not in s3.keys("killed")

    rerun = pid_shard(tmp_path, "rerun", "task", "--index", "0", "--of", "2", *_io(s3.source, url))
    kept = int(rerun.stdout.split("already up to date: ")[1].split(";")[0].split()[0])
    assert kept >= 1  # the shard sent before the kill was kept, not written again
    pid_shard(tmp_path, "committer", "commit", *_io(None, url))
    assert s3.version("killed") == (ref_version, ref)


def test_a_rebuild_by_tasks_copies_unchanged_tars_inside_the_bucket(s3: Buckets, tmp_path: Path) -> None:
    url = s3.url("rebuilt")
    settings = ["--max-shard-size-mb", "0.25", "--part-size", "2"]  # no shuffle: shards follow the keys

    def tasked_build(machine: str) -> list[str]:
        pid_shard(tmp_path, f"{machine}-plan", "plan", *_io(s3.source, url), *settings)
        outs = _write_tasks(tmp_path, s3.source, url, 2)
        pid_shard(tmp_path, f"{machine}-commit", "commit", *_io(None, url))
        return outs

    tasked_build("first")
    first, old = s3.version("rebuilt")
    # The last key's files leave the source: only the shard that held it changes.
    raw_bucket, raw_prefix = s3.source[len("s3://"):].split("/", 1)
    listed = keys(s3.client, raw_bucket, raw_prefix)
    last = max(Path(k).stem for k in listed if k.startswith("image/"))
    for k in listed:
        if Path(k).stem == last:
            s3.client.delete_object(Bucket=raw_bucket, Key=f"{raw_prefix}/{k}")
    outs = tasked_build("second")
    copied = sum(int(o.split("tars copied inside the bucket: ")[1].split()[0].rstrip(";"))
                 for o in outs if "copied inside" in o)
    vid, new = s3.version("rebuilt")
    assert vid != first and objects(s3.client, s3.out, f"rebuilt/versions/{first}")  # kept until the cleanup
    unchanged = [k for k in new if k.endswith(".tar") and old.get(k) == new[k]]
    assert copied == len(unchanged) > 0
    assert (vid, new) == _reference(tmp_path, s3, "reference-2", *settings)
