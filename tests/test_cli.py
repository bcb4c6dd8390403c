"""``pid-shard``: PiD's sharding_wds.py options, the same build, a summary, clear errors."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from pid_platform.cli import shard_main, split_input_dir
from tests.support.build_data import (
    SOURCE,
    add_sample,
    build,
    index_rows,
    manifests,
    output_files,
    source_file,
)

PID_SHARD = str(Path(sys.executable).parent / "pid-shard")


def test_pid_shard_builds_and_summarises(raw_root: Path, tmp_path: Path) -> None:
    whole = source_file(raw_root, "image", "chelsea-1x1").read_bytes()
    add_sample(raw_root, "cut-short", image=whole[: len(whole) // 2], image_ext="png")
    add_sample(raw_root, "no-caption", modalities=("image", "umt5"))
    (raw_root / SOURCE / "t5xxl").mkdir()
    out = tmp_path / "out"
    res = subprocess.run(
        [PID_SHARD, "--input-dir", str(raw_root / SOURCE), "--output-dir", str(out),
         "--max-shard-size-mb", "0.25", "--num-workers", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert f"source 'photos' -> {out}" in text
    assert "buckets: 8 " in text and "samples: 32 " in text
    shards = sum(len(m.tars) for m in manifests(out))
    total = sum(sum(t.bytes.values()) for m in manifests(out) for t in m.tars)
    assert f"shards: {shards} " in text and f"bytes: {total} " in text
    assert "aspect_ratio_16_9" in text
    assert "dropped samples: 2" in text
    assert "unreadable_image: image" in text and "cut-short" in text
    assert "missing_modality: caption" in text and "no-caption" in text
    assert "orphans per modality: caption=0  image=1  umt5=1" in text
    assert "skipped files: 0" in text
    assert "empty modality folders (ignored): t5xxl" in text
    assert "manifests: 8 wdinfo.json" in text
    assert "twin tars" in res.stderr  # the tqdm bar goes to stderr, the summary to stdout
    assert len(manifests(out)) == 8 and len(index_rows(out)) == 32


def test_cli_and_library_write_the_same_bytes(raw_root: Path, tmp_path: Path, capsys) -> None:
    argv = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(tmp_path / "cli"),
            "--no-classify-aspect-ratio", "--shard-size", "5", "--part-size", "2",
            "--shuffle", "--seed", "7", "--num-workers", "1"]
    assert shard_main(argv) == 0
    assert "(flat)" in capsys.readouterr().out
    lib = build(raw_root, tmp_path / "lib", classify_aspect_ratio=False, shard_size=5, part_size=2,
                shuffle=True, seed=7)
    cli_files = output_files(tmp_path / "cli")
    assert cli_files == output_files(lib.out)
    assert "image/part_000003/000006.tar" in cli_files  # 32 samples / 5 = 7 shards, 2 per part


def _error_of(argv: list[str], capsys) -> str:
    assert shard_main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.startswith("pid-shard: error: ")
    return captured.err


def test_pickle_refusal_is_a_clear_error(raw_root: Path, tmp_path: Path, capsys) -> None:
    (raw_root / SOURCE / "umt5" / "astronaut-1x1.npy").unlink()
    (raw_root / SOURCE / "umt5" / "astronaut-1x1.pkl").write_bytes(pickle.dumps([0.1, 0.2]))
    argv = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(tmp_path / "out"), "--num-workers", "1"]
    err = _error_of(argv, capsys)
    assert "umt5/astronaut-1x1.pkl" in err and "--trust-pickle" in err
    assert shard_main([*argv, "--trust-pickle"]) == 0


def test_unwritable_output_is_a_clear_error(raw_root: Path, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _error_of(["--input-dir", str(raw_root / SOURCE), "--output-dir", str(blocker / "out")], capsys)
    assert "not writable" in err and "--output-dir" in err


def test_missing_source_is_a_clear_error(tmp_path: Path, capsys) -> None:
    err = _error_of(["--input-dir", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "out")], capsys)
    assert "nowhere" in err and "not found" in err


def test_output_inside_the_input_is_refused(raw_root: Path, capsys) -> None:
    before = sorted(os.listdir(raw_root / SOURCE))
    err = _error_of(["--input-dir", str(raw_root / SOURCE), "--output-dir", str(raw_root / SOURCE / "out")], capsys)
    assert "overlaps --input-dir" in err
    assert sorted(os.listdir(raw_root / SOURCE)) == before


def test_errors_in_a_subprocess_have_no_traceback(tmp_path: Path) -> None:
    res = subprocess.run([PID_SHARD, "--input-dir", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith("pid-shard: error: ") and "Traceback" not in res.stderr


@pytest.mark.parametrize("bad", [["--shard-size", "-1"], ["--max-shard-size-mb", "0"], ["--part-size", "0"],
                                 ["--num-workers", "0"]])
def test_bad_option_values_exit_2_with_usage(tmp_path: Path, bad: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        shard_main(["--input-dir", str(tmp_path), "--output-dir", str(tmp_path / "o"), *bad])
    assert exc.value.code == 2
    assert "usage: pid-shard" in capsys.readouterr().err


def test_input_dir_splits_into_store_root_and_source(tmp_path: Path) -> None:
    assert split_input_dir("s3://bucket/raw/drops/photos/") == ("s3://bucket/raw/drops", "photos")
    assert split_input_dir("s3://bucket/photos") == ("s3://bucket", "photos")
    assert split_input_dir(str(tmp_path / "raw" / "photos")) == (str(tmp_path / "raw"), "photos")
    assert split_input_dir(f"file://{tmp_path}/photos/") == (str(tmp_path), "photos")
    for bad in ("s3://bucket", "s3://bucket/", "gs://b/x/photos", "/"):
        with pytest.raises(ValueError):
            split_input_dir(bad)


def test_s3_input_with_endpoint_flag_matches_a_local_build(
    s3_env, photo_drop_template: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from tests.support.seaweedfs import upload_tree

    bucket = s3_env.make_bucket("cli-shard-drops")
    upload_tree(s3_env.client(), photo_drop_template, bucket, "raw/2024")
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only --s3-endpoint-url says where the server is
    argv = ["--input-dir", f"s3://{bucket}/raw/2024/{SOURCE}", "--output-dir", str(tmp_path / "s3"),
            "--s3-endpoint-url", s3_env.endpoint_url, "--max-shard-size-mb", "0.25", "--num-workers", "1"]
    assert shard_main(argv) == 0
    assert "samples: 32 " in capsys.readouterr().out
    local = build(photo_drop_template, tmp_path / "local")
    assert output_files(tmp_path / "s3") == output_files(local.out)


def test_pid_shard_says_up_to_date_and_shows_the_validation_level(raw_root: Path, tmp_path: Path, capsys) -> None:
    argv = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(tmp_path / "out"), "--num-workers", "1",
            "--validate", "header"]
    assert shard_main(argv) == 0
    first = capsys.readouterr().out
    assert "up to date" not in first.splitlines()[0]
    assert "intake (validate=header): files validated: 96  outcomes reused: 0" in first
    assert shard_main(argv) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[0].endswith(": up to date (nothing changed since the committed build; nothing written)")
    assert "intake (validate=header): files validated: 0  outcomes reused: 96" in again
    assert "shards written: 0" in again and "manifests: 8 wdinfo.json" in again
    assert shard_main([*argv, "--revalidate"]) == 0
    forced = capsys.readouterr().out
    assert "up to date" not in forced.splitlines()[0] and "files validated: 96  outcomes reused: 0" in forced
    with pytest.raises(SystemExit) as exit_:
        shard_main([*argv[:-1], "pixels"])
    assert exit_.value.code == 2 and "invalid choice: 'pixels'" in capsys.readouterr().err
