"""Builds published to a real S3 server (SeaweedFS on 127.0.0.1): a new version prefix, the
manifests last, a pointer switched at the commit; the loader reads them by the same spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loader.wds.pipeline import build_dataset
from pid_platform.cli import shard_main
from pid_platform.sharding.commit.lease import LEASE_REL
from pid_platform.sharding.commit.s3_output import S3Output, cleanup_versions, read_pointer
from tests.conftest import SOURCE
from tests.support.build_data import build, output_files
from tests.support.s3_objects import current_version, keys, objects, pointer
from tests.support.seaweedfs import SeaweedS3, upload_tree

REPO = Path(__file__).resolve().parents[1]


def shard(input_dir: str, output_dir: str, work: Path, *extra: str) -> int:
    return shard_main(["--input-dir", input_dir, "--output-dir", output_dir, "--work-dir", str(work),
                       "--max-shard-size-mb", "0.25", "--num-workers", "1", *extra])


def sample_keys(spec: str) -> list[str]:
    dataset = build_dataset(spec, modalities=["image", "caption"], decode=None, shuffle=False)
    return sorted(s["__key__"] for s in dataset)


def published(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if not k.startswith(".pid-build/")}


def test_pid_shard_publishes_to_s3_byte_identical_to_a_local_build(
    s3_env: SeaweedS3, photo_drop_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    client = s3_env.client()
    s3_env.make_bucket("s3out-raw")
    s3_env.make_bucket("s3out-builds")
    upload_tree(client, photo_drop_template, "s3out-raw", "drops")
    monkeypatch.chdir(tmp_path)  # a URL taken for a path would show up here as a folder "s3:"
    url = "s3://s3out-builds/out/photos"
    assert shard(f"s3://s3out-raw/drops/{SOURCE}", url, tmp_path / "work") == 0
    assert f"-> {url}/versions/" in capsys.readouterr().out
    assert not (tmp_path / "s3:").exists()

    local = build(photo_drop_template, tmp_path / "local")
    assert published(current_version(client, "s3out-builds", "out/photos")) == output_files(local.out)
    first = pointer(client, "s3out-builds", "out/photos")
    assert sorted(first["manifests"]) == sorted(
        p.relative_to(local.out).as_posix() for p in local.out.rglob("wdinfo.json") if ".pid-build" not in p.parts)

    # The loader reads the build by its prefix (the pointer) or by its manifests' URLs.
    assert sample_keys(url) == sample_keys(str(local.out)) and len(sample_keys(url)) == 32

    # Same input, same settings: same version, nothing sent again.
    assert shard(f"s3://s3out-raw/drops/{SOURCE}", url, tmp_path / "work") == 0
    assert pointer(client, "s3out-builds", "out/photos") == first


def test_a_rebuild_is_a_new_version_and_the_old_one_stays_until_cleanup(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client = s3_env.client()
    s3_env.make_bucket("s3out-versions")
    url = "s3://s3out-versions/photos"
    assert shard(str(raw_root / SOURCE), url, tmp_path / "work") == 0
    v1 = pointer(client, "s3out-versions", "photos")
    v1_files = current_version(client, "s3out-versions", "photos")
    assert shard(str(raw_root / SOURCE), url, tmp_path / "work", "--no-classify-aspect-ratio") == 0
    v2 = pointer(client, "s3out-versions", "photos")
    assert v2["version"] != v1["version"] and list(v2["retired"]) == [v1["version"]]
    assert v2["manifests"] == ["wdinfo.json"]
    # The previous version is whole: a reader that resolved it before the switch finishes it.
    assert objects(client, "s3out-versions", f"photos/versions/{v1['version']}") == v1_files

    output = S3Output(url)
    kept = cleanup_versions(output, grace_s=3600)
    assert kept.removed == [] and kept.kept == [v1["version"]]
    gone = cleanup_versions(output, grace_s=0)
    assert gone.removed == [v1["version"]] and gone.objects_deleted == len(v1_files)
    assert not any(k.startswith(f"versions/{v1['version']}/") for k in keys(client, "s3out-versions", "photos"))
    assert read_pointer(output).retired == {}
    assert len(sample_keys(url)) == 32  # the current version is never touched


KILL_BEFORE_SWITCH = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from pid_platform.sharding.plan.shard_plan import ShardingConfig
    from pid_platform.sharding.commit.s3_output import S3Output
    from pid_platform.sharding.storage import LocalSourceStore
    from pid_platform.sharding.tasks.run import run_build

    raw, work, url = sys.argv[1:4]
    # Every tar, key index and manifest of the new version is up; the process dies at the pause
    # point right before the pointer would move.
    os.environ.update(PID_PAUSE_AT="publish:before-switch", PID_PAUSE_DIR=work)
    reached = Path(work) / "publish-before-switch.reached"

    def die() -> None:
        while not reached.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die, daemon=True).start()
    run_build(LocalSourceStore(raw), "photos", S3Output(url),
              ShardingConfig(max_shard_size_mb=0.25, classify_aspect_ratio=False), work_root=work)
""")


def test_a_build_killed_before_the_pointer_switch_leaves_the_previous_version_served(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client = s3_env.client()
    s3_env.make_bucket("s3out-kill")
    url = "s3://s3out-kill/photos"
    assert shard(str(raw_root / SOURCE), url, tmp_path / "work") == 0
    before = pointer(client, "s3out-kill", "photos")
    served = sample_keys(url)

    # The default lease (600 s): the killed build ran on this machine, so the next build takes
    # its lease over at once (lease.py: its process is gone).
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KILL_BEFORE_SWITCH, str(raw_root), str(tmp_path / "work"), url],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    stale = json.loads(client.get_object(Bucket="s3out-kill", Key=f"photos/{LEASE_REL}")["Body"].read())
    # The new version's objects are there, manifests included, and nobody is pointed at them.
    new = [k for k in keys(client, "s3out-kill", "photos/versions") if not k.startswith(before["version"])]
    assert any(k.endswith("/wdinfo.json") for k in new) and any(k.endswith(".tar") for k in new)
    assert pointer(client, "s3out-kill", "photos") == before
    assert sample_keys(url) == served
    assert len(list(build_dataset(url, decode=None, verify="sha256"))) == 32  # whole, checksums included
    assert sorted(build_dataset(url, decode=None).shardlist.counts.tolist()) != []  # still readable

    # The next build, at once, finishes the same version, keeping what the killed one sent.
    assert time.time() < stale["expires"] - 60
    assert shard(str(raw_root / SOURCE), url, tmp_path / "work", "--no-classify-aspect-ratio") == 0
    after = pointer(client, "s3out-kill", "photos")
    assert after["version"] != before["version"] and after["manifests"] == ["wdinfo.json"]
    assert new[0].split("/")[0] == after["version"]
    assert len(list(build_dataset(url, decode=None, verify="sha256"))) == 32


@pytest.mark.parametrize("case", ["unreachable endpoint", "missing bucket", "wrong credentials"])
def test_bad_s3_outputs_say_what_to_fix_and_publish_nothing(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, case: str
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a refused connection is not worth retrying here
    bucket = s3_env.make_bucket(f"s3out-bad-{case.split()[0]}")
    url, expected = {
        "unreachable endpoint": (f"s3://{bucket}/photos", "cannot connect to S3 at http://127.0.0.1:1"),
        "missing bucket": ("s3://s3out-nobucket/photos", "bucket 's3out-nobucket' does not exist"),
        "wrong credentials": (f"s3://{bucket}/photos", "refused the request (403: Forbidden"),
    }[case]
    if case == "unreachable endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    if case == "wrong credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.chdir(tmp_path)
    assert shard(str(raw_root / SOURCE), url, tmp_path / "work") == 2
    err = capsys.readouterr().err
    assert expected in err and "nothing was built or published" in err
    assert s3_env.secret_key not in err
    assert keys(s3_env.client(), bucket) == []
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "work").exists()


def test_an_output_url_of_another_scheme_is_refused(raw_root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        shard(str(raw_root / SOURCE), "gs://bucket/photos", tmp_path / "work")
    assert info.value.code == 2 and "gs:// is not a place builds are written to" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]


def test_an_s3_output_keeps_relative_manifest_roots(s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, capsys) -> None:
    bucket = s3_env.make_bucket("s3out-roots")
    assert shard(str(raw_root / SOURCE), f"s3://{bucket}/photos", tmp_path / "work", "--manifest-root", "absolute") == 2
    assert "the manifests of an s3:// output keep relative roots" in capsys.readouterr().err
    assert keys(s3_env.client(), bucket) == []
