"""The tasked build trusts nothing it did not verify (issue 31, parts 3-5): each test forces one
finding of a hostile probe with real ``pid-shard`` processes (each its own HOME and work folder,
as on separate machines), a real SeaweedFS and pause points or SIGSTOP, and fails on the code
before the fix.

* a commit of a plan cut before a newer publish is refused (``PublishRaceError``), pointer kept;
* a plan that lost its lease while stalled stages nothing and exits 2;
* a plan killed while staging makes ``task`` and ``commit`` exit 2 naming ``pid-shard plan``;
* a changed ``staged.json`` or ``plan.parquet`` is refused naming the file, and a plan whose
  ``path.<m>`` names a file outside the source never makes a task read it;
* a source file rewritten in place at the same size after the plan is refused;
* a write record whose tar checksum or size was altered is refused by the commit naming the
  record and the tar, before anything is switched (a bucket's and a folder's); one whose shard
  lost a tar since is deleted, its task named to run again, as for a folder;
* a tar deleted from the served version is sent again by the tasked build, never copied onto itself.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loader.formats.version_pointer import POINTER_NAME
from loader.wds.pipeline import build_dataset
from pid_platform.defs.shards.tasks import s3_sample_set_to_cut
from pid_platform.sharding.commit.lease import LEASE_REL, RENEW_ENV, TTL_ENV, BuildLeaseHeldError
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import LocalSourceStore
from pid_platform.sharding.tasks.plan import PLAN_BEFORE_STAGING_POINT, stage_plan_in_bucket
from pid_platform.sharding.tasks.staging import STAGED, STAGING_POINT
from tests.conftest import SOURCE
from tests.support.machines import pid_shard, write_tasks
from tests.support.paused_procs import pid_shard as pid_shard_argv
from tests.support.s3_objects import keys, pointer
from tests.support.seaweedfs import SeaweedS3

SETTINGS = ["--max-shard-size-mb", "0.25", "--part-size", "2"]
# Publishes a version built in a local folder, without a plan staged in the bucket.
PUBLISH_FOLDER = "from tests.support.lease_free_publish import main; main()"
_N = itertools.count()


def _io(raw_root: Path, url: str, source: bool = True) -> list[str]:
    return [*(["--input-dir", str(raw_root / SOURCE)] if source else []), "--output-dir", url]


def _bucket(s3_env: SeaweedS3, name: str) -> tuple[object, str, str]:
    bucket = s3_env.make_bucket(f"verified-{name}-{next(_N)}")
    return s3_env.client(), bucket, f"s3://{bucket}/photos"


def _staged_doc(client, bucket: str) -> dict:
    return json.loads(client.get_object(Bucket=bucket, Key=f"photos/{STAGED}/staged.json")["Body"].read())


def _machine(tmp_path: Path, name: str, **env: str) -> dict[str, str]:
    (tmp_path / name / "home").mkdir(parents=True)
    return {"HOME": str(tmp_path / name / "home"), "PID_WORK_ROOT": str(tmp_path / name / "work"), **env}


def read_keys(url: str) -> list[str]:
    """Every sample of the version served at ``url``, each tar checked against its sha256."""
    dataset = build_dataset(url, modalities=["image", "caption", "umt5"], decode=None, shuffle=False,
                            verify="sha256")
    return sorted(s["__key__"] for s in dataset)


def test_a_commit_of_a_plan_cut_before_a_newer_publish_is_refused(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client, bucket, url = _bucket(s3_env, "stale")
    pid_shard(tmp_path, "first", *_io(raw_root, url), *SETTINGS)
    first = pointer(client, bucket, "photos")["version"]
    plan = pid_shard(tmp_path, "planner", "plan", *_io(raw_root, url), *SETTINGS, "--no-classify-aspect-ratio")
    assert "staged as version" in plan.stdout
    # A newer version is published after the plan was cut, by a publisher that stages nothing
    # (``tests/support/lease_free_publish.py``: an older release, a script). A
    # newer ``pid-shard`` would stage its plan over this one, which the commit then never sees.
    local = tmp_path / "newer-local"
    pid_shard(tmp_path, "newer", "--input-dir", str(raw_root / SOURCE), "--output-dir", str(local), *SETTINGS,
              "--shuffle", "--seed", "5")
    subprocess.run([sys.executable, "-c", PUBLISH_FOLDER, str(local), url], check=True, timeout=240,
                   env={**os.environ, "HOME": str(tmp_path)})
    newer = pointer(client, bucket, "photos")
    assert newer["version"] != first
    write_tasks(tmp_path, 2, *_io(raw_root, url))

    refused = pid_shard(tmp_path, "committer", "commit", *_io(raw_root, url, source=False), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    err = refused.stderr
    assert f"names version {newer['version']}" in err and f"cut against version {first}" in err
    assert "nothing was switched" in err and "pid-shard plan" in err
    assert pointer(client, bucket, "photos") == newer  # readers keep the newer build
    assert len(read_keys(url)) == 32
    assert _staged_doc(client, bucket)["pointer"]["version"] == first  # the pointer the plan saw


def test_a_plan_that_lost_its_lease_while_stalled_stages_nothing(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket, url = _bucket(s3_env, "stalled")
    pid_shard(tmp_path, "first", *_io(raw_root, url), *SETTINGS)
    short = {TTL_ENV: "12", RENEW_ENV: "2"}
    stalled = procs(pid_shard_argv("plan", *_io(raw_root, url), *SETTINGS, "--no-classify-aspect-ratio",
                                   "--num-workers", "1"),
                    tmp_path / "a", PLAN_BEFORE_STAGING_POINT, _machine(tmp_path, "ma", **short))
    stalled.wait_reached(PLAN_BEFORE_STAGING_POINT)  # its plan is cut; nothing staged yet
    os.kill(stalled.proc.pid, signal.SIGSTOP)  # a GC pause, a suspended VM: past its lease's TTL
    try:
        time.sleep(13)
        newer = procs(pid_shard_argv("plan", *_io(raw_root, url), *SETTINGS, "--shuffle", "--seed", "5",
                                     "--num-workers", "1"), tmp_path / "b", env=_machine(tmp_path, "mb"))
        assert newer.finish() == 0, newer.stderr()  # took the expired lease over and staged its plan
    finally:
        os.kill(stalled.proc.pid, signal.SIGCONT)
    staged = _staged_doc(client, bucket)
    assert f"staged as version {staged['version']}" in newer.stdout()
    stalled.release(PLAN_BEFORE_STAGING_POINT)
    assert stalled.finish() == 2
    err = stalled.stderr()
    assert "Traceback" not in err and "this build lost its lease" in err, err
    assert _staged_doc(client, bucket) == staged  # the newer plan stays staged, untouched
    assert f"photos/{LEASE_REL}" not in keys(client, bucket)  # nobody holds it now
    write_tasks(tmp_path, 2, *_io(raw_root, url))
    pid_shard(tmp_path, "committer", "commit", *_io(raw_root, url, source=False))
    assert pointer(client, bucket, "photos")["version"] == staged["version"]


def test_the_dagster_plan_step_stages_nothing_while_another_build_holds_the_lease(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    """The plan op's work (``s3_sample_set_to_cut`` then ``stage_plan_in_bucket``) takes the
    build lease as ``pid-shard plan`` does: a live lease of another machine stops it unstaged."""
    client, bucket, url = _bucket(s3_env, "dagster-plan")
    pid_shard(tmp_path, "first", *_io(raw_root, url), *SETTINGS)
    output, out = S3Output(url), tmp_path / "dagster-work" / SOURCE
    assert s3_sample_set_to_cut(output, out, SOURCE) == "committed"
    t = time.time()
    lease = {"lease_version": 1, "host": "other-machine", "pid": 4242, "token": "f" * 32, "started": t - 5,
             "renewed": t - 5, "expires": t + 595, "ttl_s": 600.0, "version": None}
    client.put_object(Bucket=bucket, Key=f"photos/{LEASE_REL}", Body=json.dumps(lease).encode())
    config = ShardingConfig(max_shard_size_mb=0.25, part_size=2, shuffle=True, seed=5)
    with pytest.raises(BuildLeaseHeldError, match="other-machine pid 4242"):
        stage_plan_in_bucket(LocalSourceStore(raw_root), SOURCE, output, out, config)
    assert not [k for k in keys(client, bucket, "photos") if k.startswith(f"{STAGED}/")]
    client.delete_object(Bucket=bucket, Key=f"photos/{LEASE_REL}")
    _plans, version = stage_plan_in_bucket(LocalSourceStore(raw_root), SOURCE, output, out, config)
    assert _staged_doc(client, bucket)["version"] == version


def test_a_plan_killed_while_staging_makes_tasks_and_commit_refuse(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket, url = _bucket(s3_env, "killed")
    pid_shard(tmp_path, "first", *_io(raw_root, url), *SETTINGS)
    served = pointer(client, bucket, "photos")
    plan = procs(pid_shard_argv("plan", *_io(raw_root, url), *SETTINGS, "--no-classify-aspect-ratio",
                                "--num-workers", "1"), tmp_path / "a", STAGING_POINT,
                 _machine(tmp_path, "ma", **{TTL_ENV: "12", RENEW_ENV: "2"}))
    plan.wait_reached(STAGING_POINT)
    plan.proc.kill()
    plan.finish()
    killed = time.monotonic()
    assert "staged.json" not in keys(client, bucket, f"photos/{STAGED}")
    task = pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "2", *_io(raw_root, url), check=False)
    time.sleep(max(0.0, killed + 13 - time.monotonic()))  # the commit takes the dead plan's lease once it expires
    commit = pid_shard(tmp_path, "committer", "commit", *_io(raw_root, url, source=False), check=False)
    for res in (task, commit):
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "no plan is staged" in res.stderr and "killed while staging" in res.stderr
        assert "run `pid-shard plan`" in res.stderr and "up to date" not in res.stdout
    assert pointer(client, bucket, "photos") == served


def test_a_damaged_staged_json_is_refused_naming_it(s3_env: SeaweedS3, raw_root: Path, tmp_path: Path) -> None:
    client, bucket, url = _bucket(s3_env, "badid")
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, url), *SETTINGS)
    key = f"photos/{STAGED}/staged.json"
    doc = _staged_doc(client, bucket)
    for field, value in (("version", "../../elsewhere"), ("in_place", {"base": "../x", "reused": []})):
        client.put_object(Bucket=bucket, Key=key, Body=json.dumps({**doc, field: value}).encode())
        res = pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, url), check=False)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{url}/{STAGED}/staged.json: not a staged plan" in res.stderr and "not a version id" in res.stderr
    assert not [k for k in keys(client, bucket, "photos") if "elsewhere" in k or k.startswith("x/")]


def _plan_pointing_at(plan: pa.Table, attacker: Path) -> pa.Table:
    """``plan`` with every caption's ``path.caption`` naming a file of the same name in ``attacker``."""
    names = plan.column("name.caption").to_pylist()
    at = plan.schema.get_field_index("path.caption")
    return plan.set_column(at, "path.caption", pa.array([str(attacker / n) for n in names], pa.string()))


def _attacker_files(raw_root: Path, attacker: Path) -> dict[str, bytes]:
    """A secret of the same name and size as each caption, outside the source."""
    attacker.mkdir()
    secrets = {}
    for f in sorted((raw_root / SOURCE / "caption").iterdir()):
        secrets[f.name] = (b"SECRET-KEY-" * 1000)[: f.stat().st_size]
        (attacker / f.name).write_bytes(secrets[f.name])
    return secrets


def test_a_changed_staged_plan_is_refused_and_never_reads_outside_the_source(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client, bucket, url = _bucket(s3_env, "tampered")
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, url), *SETTINGS)
    _attacker_files(raw_root, tmp_path / "attacker")
    key = f"photos/{STAGED}/state/plan.parquet"
    plan = pq.read_table(io.BytesIO(client.get_object(Bucket=bucket, Key=key)["Body"].read()))
    sink = io.BytesIO()
    pq.write_table(_plan_pointing_at(plan, tmp_path / "attacker"), sink)
    client.put_object(Bucket=bucket, Key=key, Body=sink.getvalue())

    res = pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, url), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{url}/{STAGED}/state/plan.parquet: not the plan {url}/{STAGED}/staged.json names" in res.stderr
    assert "pid-shard plan" in res.stderr
    sent = [k for k in keys(client, bucket, "photos") if k.endswith(".tar")]
    assert sent == []  # not one tar of that plan was written


def _each_forgery(record: dict, tar: str, refused: Callable[[dict], None]) -> None:
    """``record`` naming a checksum, then a size, that no tar has: each must be ``refused``."""
    for field, forge in (("digests", lambda _sha: "0" * 64), ("tar_sizes", lambda size: size + 512)):
        forged = json.loads(json.dumps(record))
        forged[field]["0"][tar] = forge(forged[field]["0"][tar])
        refused(forged)


def test_an_altered_write_record_is_refused_by_the_commit_naming_it(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client, bucket, url = _bucket(s3_env, "record")
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, url), *SETTINGS)
    pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, url))
    key = f"photos/{STAGED}/tasks/write-000000-of-000001.json"
    record = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    tar = sorted(record["digests"]["0"])[0]

    def altered(doc: dict) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=json.dumps(doc).encode())
        res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, url, source=False), check=False)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{url}/{STAGED}/tasks/write-000000-of-000001.json: names {url}/versions/" in res.stderr
        assert f"/{tar}/" in res.stderr and "nothing was published" in res.stderr
        assert POINTER_NAME not in keys(client, bucket, "photos")  # nothing was switched

    _each_forgery(record, tar, altered)
    # A damaged record (strict reader): one line naming it, not "no finished write task".
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(record).encode()[:-40])
    res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, url, source=False), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{url}/{key.removeprefix('photos/')}: not valid JSON" in res.stderr, res.stderr
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(record).encode())
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, url, source=False))
    assert len(read_keys(url)) > 0


def test_a_tar_deleted_from_the_bucket_after_its_record_sends_its_task_back(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    """As for a folder (the one commit body): a shard that lost an object since its task's record
    makes the commit delete the record and name the task to run again, which sends it again."""
    client, bucket, url = _bucket(s3_env, "lost")
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, url), *SETTINGS)
    pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, url))
    tar = next(k for k in keys(client, bucket, "photos") if k.startswith("versions/") and k.endswith(".tar"))
    client.delete_object(Bucket=bucket, Key=f"photos/{tar}")
    res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, url, source=False), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "write task 0 of 1 has not finished" in res.stderr and "must run again" in res.stderr, res.stderr
    assert f"{STAGED}/tasks/write-000000-of-000001.json" not in keys(client, bucket, "photos")
    assert POINTER_NAME not in keys(client, bucket, "photos")  # nothing was switched
    pid_shard(tmp_path, "again", "task", "--index", "0", "--of", "1", *_io(raw_root, url))
    assert tar in keys(client, bucket, "photos")  # sent again
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, url, source=False))
    assert len(read_keys(url)) > 0


def test_an_altered_write_record_of_a_folder_is_refused_by_the_commit_naming_it(raw_root: Path, tmp_path: Path) -> None:
    """The folder's commit, the bucket's body: its manifests take the records' checksums, so a
    record naming a checksum or size no tar has is refused, naming the record and the tar."""
    out = tmp_path / "out"
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, str(out)), *SETTINGS)
    pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, str(out)))
    path = staging_dir(out) / STATE_DIR / "tasks" / "write-000000-of-000001.json"
    record = json.loads(path.read_bytes())
    tar = sorted(record["digests"]["0"])[0]

    def altered(doc: dict) -> None:
        path.write_text(json.dumps(doc))
        res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, str(out), source=False), check=False)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{path}: names {staging_dir(out)}/" in res.stderr and f"/{tar}/" in res.stderr, res.stderr
        assert "nothing was published" in res.stderr and not out.exists()

    _each_forgery(record, tar, altered)
    path.write_text(json.dumps(record))
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, str(out), source=False))
    assert out.is_dir()


def test_a_write_record_of_an_older_pid_shard_sends_its_task_back(raw_root: Path, tmp_path: Path) -> None:
    """A folder's write record as pid-shard wrote it before records carried tar digests and sizes
    (a build staged before an upgrade), one lacking only the sizes, or one lacking one shard's
    entry: the commit, which takes its checksums from the records, counts none of its shards,
    and the task run again writes a record the commit takes (the write task and the commit ask
    one question, ``is_write_record_of``; before, a task found a record with digests but no sizes,
    or without one shard's digests, done, and the commit refused forever)."""
    out = tmp_path / "out"
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, str(out)), *SETTINGS)
    pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, str(out)))
    path = staging_dir(out) / STATE_DIR / "tasks" / "write-000000-of-000001.json"
    record = json.loads(path.read_bytes())
    last = str(record["shards"][1] - 1)
    for forged in ({k: v for k, v in record.items() if k not in ("digests", "tar_sizes", "key_index_bytes")},
                   # with the digests but not the sizes: done for none of its shards (a half-read
                   # record covered its first shard)
                   {k: v for k, v in record.items() if k != "tar_sizes"},
                   # every field, but its last shard's digests gone: the task found it done, the
                   # commit found that shard unfinished, and neither moved again
                   {**record, "digests": {k: v for k, v in record["digests"].items() if k != last}}):
        path.write_text(json.dumps(forged))
        res = pid_shard(tmp_path, "commit", "commit", *_io(raw_root, str(out), source=False), check=False)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "no write task has finished for the staged plan" in res.stderr and not out.exists(), res.stderr
    pid_shard(tmp_path, "again", "task", "--index", "0", "--of", "1", *_io(raw_root, str(out)))
    assert json.loads(path.read_bytes())["digests"] == record["digests"]
    pid_shard(tmp_path, "commit", "commit", *_io(raw_root, str(out), source=False))
    assert out.is_dir()


def test_a_plan_naming_files_outside_the_source_is_read_by_name_under_it(raw_root: Path, tmp_path: Path) -> None:
    """A folder output's staged plan.parquet rewritten: the write task still reads each file by
    its name under its own source root, never the path the plan carries."""
    out = tmp_path / "out"
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, str(out)), *SETTINGS)
    secrets = _attacker_files(raw_root, tmp_path / "attacker")
    plan_file = staging_dir(out) / STATE_DIR / "plan.parquet"
    pq.write_table(_plan_pointing_at(pq.read_table(plan_file), tmp_path / "attacker"), plan_file)
    write_tasks(tmp_path, 1, *_io(raw_root, str(out)))
    pid_shard(tmp_path, "committer", "commit", *_io(raw_root, str(out), source=False))
    tars = list(out.rglob("caption/**/*.tar"))
    assert tars and not any(b"SECRET-KEY-" in t.read_bytes() for t in tars)
    first = sorted(secrets)[0]
    assert any((raw_root / SOURCE / "caption" / first).read_bytes() in t.read_bytes() for t in tars)


def test_a_source_file_rewritten_in_place_after_the_plan_is_refused(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid_shard(tmp_path, "planner", "plan", *_io(raw_root, str(out)), *SETTINGS)
    caption = sorted((raw_root / SOURCE / "caption").iterdir())[0]
    size = caption.stat().st_size
    time.sleep(0.01)  # a rewrite moves the file's times
    with open(caption, "r+b") as fh:  # the same size, other words
        fh.write(b"x" * size)
    assert caption.stat().st_size == size
    res = pid_shard(tmp_path, "task", "task", "--index", "0", "--of", "1", *_io(raw_root, str(out)), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{caption}: the source changed after the plan" in res.stderr and "run the plan again" in res.stderr
    assert not list(out.rglob("caption/**/*.tar"))


def test_a_tar_deleted_from_the_served_version_is_sent_again_by_the_tasks(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client, bucket, url = _bucket(s3_env, "repair")

    def tasked(name: str) -> list[str]:
        plan = pid_shard(tmp_path, f"{name}-plan", "plan", *_io(raw_root, url), *SETTINGS)
        outs = write_tasks(tmp_path, 2, *_io(raw_root, url))
        commit = pid_shard(tmp_path, f"{name}-commit", "commit", *_io(raw_root, url, source=False))
        return [plan.stdout, *outs, commit.stdout]

    tasked("first")
    served = pointer(client, bucket, "photos")
    tars = sorted(k for k in keys(client, bucket, f"photos/versions/{served['version']}") if k.endswith(".tar"))
    client.delete_object(Bucket=bucket, Key=f"photos/versions/{served['version']}/{tars[0]}")

    plan, *tasks, _commit = tasked("second")  # each step on a machine of its own
    assert "already serves" not in plan and f"staged as version {served['version']}" in plan
    assert sum(int(o.split("shards written: ")[1].split()[0].rstrip(";")) for o in tasks) == 1  # that shard only
    assert pointer(client, bucket, "photos")["version"] == served["version"]
    assert len(read_keys(url)) == 32
    assert not [k for k in keys(client, bucket, "photos") if k.startswith(STAGED)]
