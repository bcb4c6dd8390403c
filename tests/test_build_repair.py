"""A rebuild repairs the damage it can see: a tar missing or of the wrong size (stamps locally,
one listing on S3) is written or sent again by any rebuild; ``--repair`` also reads every tar
back and replaces one changed in place. The reader's error names that command. After each
repair every sample reads with ``verify="sha256"``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loader.wds.errors import ChecksumError, ShardReadError
from loader.wds.pipeline import build_dataset
from pid_platform.cli import shard_main
from tests.conftest import SOURCE
from tests.support.s3_objects import keys, pointer
from tests.support.seaweedfs import SeaweedS3

SAMPLES = 32
TAR = "aspect_ratio_1_1/image/part_000000/000000.tar"


def shard(raw_root: Path, out: str, work: Path | None, *extra: str) -> int:
    args = ["--input-dir", str(raw_root / SOURCE), "--output-dir", out, "--max-shard-size-mb", "0.25",
            "--num-workers", "1", *extra]
    return shard_main([*args, "--work-dir", str(work)] if work is not None else args)


def read_verified(spec: str) -> int:
    dataset = build_dataset(spec, modalities=["image", "caption", "umt5"], decode=None, shuffle=False,
                            verify="sha256")
    return len({s["__key__"] for s in dataset})


def first_tar(client, bucket: str, prefix: str) -> str:
    version = pointer(client, bucket, prefix)["version"]
    tars = [k for k in keys(client, bucket, f"{prefix}/versions/{version}") if k.endswith(".tar")]
    return f"{prefix}/versions/{version}/{sorted(tars)[0]}"


@pytest.mark.parametrize("how", ["rebuild", "--revalidate", "another machine"])
def test_a_tar_deleted_from_the_current_s3_version_is_uploaded_again(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, capsys, how: str
) -> None:
    client = s3_env.client()
    bucket = s3_env.make_bucket(f"repair-gone-{how.strip('-').split()[0]}")
    url = f"s3://{bucket}/photos"
    assert shard(raw_root, url, tmp_path / "work") == 0
    before = pointer(client, bucket, "photos")
    capsys.readouterr()
    client.delete_object(Bucket=bucket, Key=first_tar(client, bucket, "photos"))
    with pytest.raises(ShardReadError, match="tar not found.*--repair"):
        read_verified(url)

    work = tmp_path / ("work-2" if how == "another machine" else "work")
    extra = ["--revalidate"] if how == "--revalidate" else []
    assert shard(raw_root, url, work, *extra) == 0
    out = capsys.readouterr().out
    assert "up to date" not in out.splitlines()[0]
    assert "repaired: 1 objects of the published version" in out
    assert pointer(client, bucket, "photos") == before  # the same version, whole again
    assert read_verified(url) == SAMPLES
    # Now nothing is missing: the next rebuild is up to date again.
    assert shard(raw_root, url, tmp_path / "work") == 0
    assert "up to date" in capsys.readouterr().out.splitlines()[0]


def test_repair_replaces_an_s3_tar_changed_in_place(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, capsys
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("repair-changed")
    url = f"s3://{bucket}/photos"
    assert shard(raw_root, url, tmp_path / "work") == 0
    key = first_tar(client, bucket, "photos")
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[2000] ^= 0xFF  # same size: no listing can see it
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumError, match="--repair"):
        read_verified(url)
    capsys.readouterr()
    assert shard(raw_root, url, tmp_path / "work") == 0
    assert "up to date" in capsys.readouterr().out.splitlines()[0]  # a listing cannot see it...
    assert shard(raw_root, url, tmp_path / "work", "--repair") == 0  # ... reading every object does
    assert "repaired: 1 objects of the published version" in capsys.readouterr().out
    assert read_verified(url) == SAMPLES


def test_a_tar_deleted_from_a_local_output_is_written_again(raw_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert shard(raw_root, str(out), None) == 0
    (out / TAR).unlink()
    with pytest.raises(ShardReadError, match="tar not found.*--repair"):
        read_verified(str(out))
    capsys.readouterr()
    assert shard(raw_root, str(out), None) == 0
    summary = capsys.readouterr().out
    assert "up to date" not in summary.splitlines()[0] and "shards written: 1 " in summary
    assert read_verified(str(out)) == SAMPLES


def test_repair_rewrites_a_local_tar_changed_in_place_behind_the_builds_back(
    raw_root: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    assert shard(raw_root, str(out), None) == 0
    tar = out / TAR
    st = tar.stat()
    data = bytearray(tar.read_bytes())
    data[2000] ^= 0xFF
    with open(tar, "r+b") as fh:  # in place, same size, same times: bit rot, not an edit
        fh.write(bytes(data))
    os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ChecksumError, match="--repair"):
        read_verified(str(out))
    capsys.readouterr()
    assert shard(raw_root, str(out), None) == 0
    assert "up to date" in capsys.readouterr().out.splitlines()[0]
    assert shard(raw_root, str(out), None, "--repair") == 0
    summary = capsys.readouterr().out
    assert "repaired: 1 shards had a missing or damaged tar" in summary and "shards written: 1 " in summary
    assert read_verified(str(out)) == SAMPLES


def test_a_new_version_uploads_a_tar_the_damaged_current_one_lost_instead_of_copying_it(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("repair-copy-source")
    url = f"s3://{bucket}/photos"
    assert shard(raw_root, url, tmp_path / "work") == 0
    before = pointer(client, bucket, "photos")["version"]
    client.delete_object(Bucket=bucket, Key=first_tar(client, bucket, "photos"))
    # Another seed without --shuffle: the same tars in a new version, each copied inside the bucket.
    assert shard(raw_root, url, tmp_path / "work", "--seed", "1") == 0
    assert pointer(client, bucket, "photos")["version"] != before
    assert read_verified(url) == SAMPLES
