"""Races on one S3 output between real processes, against a real SeaweedFS: a cleanup beside a
build republishing a retired version, two builds from two machines, a bucket emptied or deleted
during a build. Each interleaving is forced by holding one process at a named pause point
(``pid_platform/sharding/pause_points.py``) while the other runs; after each, a reader of the
output gets a complete version (every sample read with ``verify="sha256"``) or a clear error,
never an empty or partial one."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

from loader.formats.errors import FormatError
from loader.formats.version_pointer import POINTER_NAME, VersionPointer, parse_pointer
from loader.wds.errors import ManifestError
from loader.wds.pipeline import build_dataset
from pid_platform.cli import shard_main
from tests.conftest import SOURCE
from tests.support.paused_procs import pid_shard
from tests.support.s3_objects import keys, pointer
from tests.support.seaweedfs import SeaweedS3

SAMPLES = 32

CLEANUP = """
import json, sys
from pid_platform.sharding.commit.s3_output import S3Output, cleanup_versions
ttl = float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
report = cleanup_versions(S3Output(sys.argv[1]), grace_s=0, claim_ttl_s=ttl)
print(json.dumps({"removed": report.removed, "kept": report.kept, "claimed": report.claimed}))
"""

# Publishes a version built in a local folder, without a build (so without the build lease).
PUBLISH = "from tests.support.lease_free_publish import main; main()"


def shard_args(raw_root: Path, url: str, work: Path, *extra: str) -> list[str]:
    return ["--input-dir", str(raw_root / SOURCE), "--output-dir", url, "--work-dir", str(work),
            "--max-shard-size-mb", "0.25", "--num-workers", "1", *extra]


def _host() -> str:
    return socket.gethostname()[:100]


def read_verified(url: str) -> list[str]:
    """Every sample of the version the pointer names, each tar checked against its sha256."""
    dataset = build_dataset(url, modalities=["image", "caption", "umt5"], decode=None, shuffle=False,
                            verify="sha256")
    found = [s["__key__"] for s in dataset]
    assert len(found) == len(set(found))
    return sorted(found)


def version_objects(client, bucket: str, prefix: str, version: str) -> list[str]:
    return keys(client, bucket, f"{prefix}/versions/{version}")


def two_versions(raw_root: Path, url: str, work: Path, client, bucket: str) -> tuple[str, str]:
    """Publish V1 (aspect buckets), then V2 (flat): V2 current, V1 retired."""
    assert shard_main(shard_args(raw_root, url, work)) == 0
    v1 = pointer(client, bucket, "photos")["version"]
    assert shard_main(shard_args(raw_root, url, work, "--no-classify-aspect-ratio")) == 0
    p = pointer(client, bucket, "photos")
    assert list(p["retired"]) == [v1]
    return v1, p["version"]


def test_a_cleanup_that_listed_a_retired_version_spares_it_once_a_build_republished_it(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("race-cleanup-listed")
    url = f"s3://{bucket}/photos"
    v1, _v2 = two_versions(raw_root, url, tmp_path / "work", client, bucket)
    n_v1 = len(version_objects(client, bucket, "photos", v1))
    # The cleanup has read the pointer (V2 current, V1 retired past the grace) and listed the versions...
    cleanup = procs(["-c", CLEANUP, url], tmp_path / "cleanup", "cleanup:listed")
    cleanup.wait_reached("cleanup:listed")
    # ... when a build with V1's settings publishes V1 again: nothing to upload, the pointer moves back.
    build = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work")), tmp_path / "build")
    assert build.finish() == 0, build.stderr()
    assert pointer(client, bucket, "photos")["version"] == v1
    cleanup.release("cleanup:listed")
    assert cleanup.finish() == 0, cleanup.stderr()
    assert v1 not in json.loads(cleanup.stdout())["removed"]
    assert pointer(client, bucket, "photos")["version"] == v1
    assert len(version_objects(client, bucket, "photos", v1)) == n_v1
    assert len(read_verified(url)) == SAMPLES


def test_a_cleanup_leaves_a_version_a_build_has_claimed(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("race-cleanup-claimed")
    url = f"s3://{bucket}/photos"
    v1, v2 = two_versions(raw_root, url, tmp_path / "work", client, bucket)
    # The build republishing V1 has found every object there and is about to check and switch...
    build = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work")), tmp_path / "build",
                  "publish:before-verify")
    build.wait_reached("publish:before-verify")
    # ... when a whole cleanup runs: V1 is past its grace period, but claimed.
    cleanup = procs(["-c", CLEANUP, url], tmp_path / "cleanup")
    assert cleanup.finish() == 0, cleanup.stderr()
    assert json.loads(cleanup.stdout()) == {"removed": [], "kept": [], "claimed": [v1]}
    build.release("publish:before-verify")
    assert build.finish() == 0, build.stderr()
    assert pointer(client, bucket, "photos")["version"] == v1
    assert len(read_verified(url)) == SAMPLES
    # Claims go with their holders: a later cleanup removes what is retired, never the current version.
    cleanup = procs(["-c", CLEANUP, url], tmp_path / "cleanup-2")
    assert cleanup.finish() == 0, cleanup.stderr()
    assert json.loads(cleanup.stdout())["removed"] == [v2]
    assert keys(client, bucket, "photos/.pid-claims") == []
    assert len(read_verified(url)) == SAMPLES


def test_a_build_waits_for_a_cleanup_deleting_its_version_and_uploads_it_again(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("race-cleanup-deleting")
    url = f"s3://{bucket}/photos"
    v1, _v2 = two_versions(raw_root, url, tmp_path / "work", client, bucket)
    n_v1 = len(version_objects(client, bucket, "photos", v1))
    # The cleanup has claimed V1 for deletion and found no build using it...
    cleanup = procs(["-c", CLEANUP, url], tmp_path / "cleanup", "cleanup:deleting")
    cleanup.wait_reached("cleanup:deleting")
    # ... when a build republishing V1 starts: it claims V1, then waits for the deletion to end.
    build = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work")), tmp_path / "build",
                  "publish:claimed")
    deadline = time.monotonic() + 60
    while not any(k.startswith(f"{v1}/publish-") for k in keys(client, bucket, "photos/.pid-claims")):
        assert build.proc.poll() is None, build.stderr()
        assert time.monotonic() < deadline, "the build never claimed its version"
        time.sleep(0.05)
    time.sleep(1.0)  # time enough to go past the wait, were it not waiting
    assert not build.reached("publish:claimed")
    cleanup.release("cleanup:deleting")
    assert cleanup.finish() == 0, cleanup.stderr()
    assert v1 in json.loads(cleanup.stdout())["removed"]
    assert f"waiting for the delete claim of {_host()} pid {cleanup.proc.pid} on {v1}" in build.stderr()
    # The deletion is over: the build lists what is left (nothing) and uploads V1 whole.
    build.wait_reached("publish:claimed")
    build.release("publish:claimed")
    assert build.finish() == 0, build.stderr()
    assert pointer(client, bucket, "photos")["version"] == v1
    assert len(version_objects(client, bucket, "photos", v1)) == n_v1
    assert len(read_verified(url)) == SAMPLES


@pytest.mark.parametrize("start", ["first pointer", "existing pointer"])
def test_of_two_builds_from_two_machines_one_publishes_and_the_other_fails_naming_it(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs, start: str
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket(f"race-two-{start.split()[0]}")
    url = f"s3://{bucket}/photos"
    v0 = None
    if start == "existing pointer":
        assert shard_main(shard_args(raw_root, url, tmp_path / "work-0", "--shard-size", "8",
                                     "--no-classify-aspect-ratio")) == 0
        v0 = pointer(client, bucket, "photos")["version"]
    # Two machines, two settings, both read the same pointer and upload... A build takes the output's
    # lease (test_build_lease.py), so the second pid-shard would be refused at its start: A is a
    # publisher that ignores the lease (an older release, a script), which only the conditional
    # pointer switch can stop. A's version is staged by a local build.
    staged = tmp_path / "local-a"
    assert shard_main(["--input-dir", str(raw_root / SOURCE), "--output-dir", str(staged),
                       "--max-shard-size-mb", "0.25", "--num-workers", "1"]) == 0
    a = procs(["-c", PUBLISH, str(staged), url], tmp_path / "a", "publish:before-switch")
    b = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work-b", "--no-classify-aspect-ratio")),
              tmp_path / "b", "publish:before-switch")
    a.wait_reached("publish:before-switch")
    b.wait_reached("publish:before-switch")
    # ... A switches first; B's switch was conditional on the pointer both started from.
    a.release("publish:before-switch")
    assert a.finish() == 0, a.stderr()
    won = pointer(client, bucket, "photos")
    assert f"pid {a.proc.pid}" in won["built_by"]
    assert f"{url}/versions/{won['version']}" in a.stdout()
    b.release("publish:before-switch")
    assert b.finish() == 2
    err = b.stderr()
    assert "Traceback" not in err
    assert "another build (" in err and f"pid {a.proc.pid}" in err and f"to version {won['version']}" in err
    assert ("no version (a first publish)" if v0 is None else f"started from version {v0}") in err
    assert b.stdout() == ""  # no summary naming a version B did not publish
    assert pointer(client, bucket, "photos") == won
    assert list(won["retired"]) == ([v0] if v0 else [])
    assert len(won["manifests"]) > 1  # A's aspect buckets, not B's flat version
    assert len(read_verified(url)) == SAMPLES


@pytest.mark.parametrize("how", ["emptied", "deleted"])
def test_a_bucket_emptied_or_deleted_during_a_build_publishes_no_pointer(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs, how: str
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket(f"race-bucket-{how}")
    url = f"s3://{bucket}/photos"
    build = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work")), tmp_path / "build",
                  "publish:before-verify")
    build.wait_reached("publish:before-verify")  # every object is up; the switch comes next
    for key in keys(client, bucket):
        client.delete_object(Bucket=bucket, Key=key)
    if how == "deleted":
        client.delete_bucket(Bucket=bucket)
    build.release("publish:before-verify")
    assert build.finish() == 2
    err = build.stderr()
    assert "Traceback" not in err and "the pointer was not changed" in err
    assert ("are missing or of the wrong size" if how == "emptied" else f"bucket {bucket!r} does not exist") in err
    if how == "deleted":
        assert bucket not in [b["Name"] for b in client.list_buckets()["Buckets"]]
        s3_env.make_bucket(bucket)
    assert POINTER_NAME not in keys(client, bucket, "photos")
    with pytest.raises(ManifestError, match="wdinfo.json not found"):  # nothing published: said so
        read_verified(url)
    # The next build publishes the whole version again.
    assert shard_main(shard_args(raw_root, url, tmp_path / "work")) == 0
    assert len(read_verified(url)) == SAMPLES


def test_a_cleanup_forgetting_deleted_versions_in_the_pointer_does_not_fail_a_build_switching_meanwhile(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("race-cleanup-forget")
    url = f"s3://{bucket}/photos"
    v1, v2 = two_versions(raw_root, url, tmp_path / "work", client, bucket)
    # A third version is up and checked; its switch is conditional on the pointer read at the start...
    build = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work", "--shard-size", "8")), tmp_path / "build",
                  "publish:before-switch")
    build.wait_reached("publish:before-switch")
    # ... which the cleanup rewrites meanwhile (V1 deleted, so forgotten under "retired").
    cleanup = procs(["-c", CLEANUP, url], tmp_path / "cleanup")
    assert cleanup.finish() == 0, cleanup.stderr()
    assert json.loads(cleanup.stdout())["removed"] == [v1]
    assert pointer(client, bucket, "photos")["retired"] == {}
    # Still the version the build started from: the build switches from the rewritten pointer.
    build.release("publish:before-switch")
    assert build.finish() == 0, build.stderr()
    now = pointer(client, bucket, "photos")
    assert now["version"] not in (v1, v2) and list(now["retired"]) == [v2]
    assert len(read_verified(url)) == SAMPLES


def test_a_cleanup_killed_while_deleting_holds_a_republishing_build_only_until_its_claim_expires(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("race-cleanup-killed")
    url = f"s3://{bucket}/photos"
    v1, _v2 = two_versions(raw_root, url, tmp_path / "work", client, bucket)
    n_v1 = len(version_objects(client, bucket, "photos", v1))
    # A build republishing V1 is about to publish it...
    build = procs(pid_shard(*shard_args(raw_root, url, tmp_path / "work")), tmp_path / "build", "publish:start")
    build.wait_reached("publish:start")
    # ... when a cleanup with 8-second claims is killed with V1 claimed for deletion, part of it deleted.
    cleanup = procs(["-c", CLEANUP, url, "8"], tmp_path / "cleanup", "cleanup:deleting")
    cleanup.wait_reached("cleanup:deleting")
    some = sorted(version_objects(client, bucket, "photos", v1))[: n_v1 // 2]
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"photos/versions/{v1}/{k}"} for k in some]})
    cleanup.proc.send_signal(signal.SIGKILL)
    cleanup.proc.wait()
    assert any(k.startswith(f"{v1}/delete-") for k in keys(client, bucket, "photos/.pid-claims"))
    # The build waits out the dead claim, then sends what the deletion took.
    build.release("publish:start")
    assert build.finish() == 0, build.stderr()
    assert "waiting for the delete claim" in build.stderr()
    assert pointer(client, bucket, "photos")["version"] == v1
    assert len(version_objects(client, bucket, "photos", v1)) == n_v1
    assert len(read_verified(url)) == SAMPLES


def test_a_pointer_names_the_build_that_moved_it_and_older_pointers_still_parse() -> None:
    named = VersionPointer("ab" * 10, ["wdinfo.json"], {"cd" * 10: 1.5}, built_by="host-a pid 12")
    assert parse_pointer(named.to_bytes(), "p") == named
    plain = VersionPointer("ab" * 10, ["wdinfo.json"])
    assert b"built_by" not in plain.to_bytes() and parse_pointer(plain.to_bytes(), "p") == plain
    doc = json.loads(named.to_bytes()) | {"built_by": 5}
    with pytest.raises(FormatError, match="p: 'built_by' must be a string"):
        parse_pointer(json.dumps(doc).encode(), "p")
