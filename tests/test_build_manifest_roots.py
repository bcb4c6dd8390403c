"""Manifests a PiD training job reads unchanged, and PiD-written data read as PiD reads it.

* ``manifest_root``: relative roots (default), absolute ones (the output folder, for PiD's reader,
  which joins ``root`` to its working directory) or a URL the output is published at;
* ``pid-rewrite-roots`` changes the roots of an existing build, nothing else;
* one ``chunk_size`` per build (the largest tar of any bucket), safe under PiD's rule that the
  first manifest's ``chunk_size`` holds for the whole dataset;
* a PiD-written tar's ``photos__rotated.exif6.jpg`` is key ``photos__rotated-exif6`` with field
  ``image.jpg``, as in PiD's reader (not ``photos__rotated`` with ``image.exif6.jpg``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from loader.formats.errors import FormatError
from loader.formats.layout import STATE_DIR, WDINFO_NAME
from loader.formats.pid_names import split_pid_member_name
from loader.formats.wdinfo import read_wdinfo
from loader.wds.discovery import load_wdinfo
from loader.wds.pipeline import build_dataset
from pid_platform.cli import rewrite_roots_main, shard_main
from pid_platform.sharding.pipeline import build_source
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import LocalSourceStore
from tests.support.build_data import SMALL_BOUND_MB, SOURCE, all_problems, build, manifests
from tests.support.pid_data import write_pid_output


def _docs(out: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_bytes()) for p in sorted(out.rglob(WDINFO_NAME))
            if STATE_DIR not in p.parts}


def _samples(spec: str) -> dict[str, dict[str, bytes]]:
    return {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")}
            for s in build_dataset(spec, decode=None, shuffle=False)}


def test_absolute_roots_name_the_published_folder(raw_root: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    build_source(LocalSourceStore(raw_root), SOURCE, out, ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB),
                 manifest_root="absolute")
    docs = _docs(out)
    assert docs and all(d["root"] == str(out.absolute() / bucket) for bucket, d in docs.items())
    assert all_problems(out) == []
    monkeypatch.chdir(tmp_path)  # PiD joins root to the working directory: absolute roots do not care
    assert len(_samples(str(out))) == 32


def test_one_chunk_size_per_build_is_its_largest_tar(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    mans = manifests(out)
    largest = max(t.count for m in mans for t in m.tars)
    per_bucket = {max(t.count for t in m.tars) for m in mans}
    assert len(per_bucket) > 1, "the test wants buckets whose largest tars differ"
    # Whichever manifest PiD reads first, its chunk_size is the build's largest tar: PiD's resume
    # (WDS_START_INDEX // chunk_size shards skipped) can then skip too few shards, never too many.
    assert {m.chunk_size for m in mans} == {largest}
    assert load_wdinfo(str(out), broadcast=False).chunk_size == largest


def test_a_url_root_and_a_bad_mode(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build_source(LocalSourceStore(raw_root), SOURCE, out, ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB),
                 manifest_root="s3://bucket/datasets/photos/")
    docs = _docs(out)
    assert all(d["root"] == f"s3://bucket/datasets/photos/{bucket}" for bucket, d in docs.items())
    table = load_wdinfo(str(out), broadcast=False).tar_files
    assert table[0].url("image").startswith("s3://bucket/datasets/photos/aspect_ratio_")
    for bad in ("somewhere", "s3://", "file:///x", "s3://key:secret@bucket/p", "relative/"):
        with pytest.raises(FormatError, match="manifest root"):
            build_source(LocalSourceStore(raw_root), SOURCE, tmp_path / "never", ShardingConfig(),
                         manifest_root=bad)
        assert not (tmp_path / "never").exists(), "refused before any work"


def test_pid_shard_manifest_root_option(raw_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(out), "--num-workers", "1",
            "--max-shard-size-mb", str(SMALL_BOUND_MB)]
    assert shard_main([*argv, "--manifest-root", "absolute"]) == 0
    assert all(os.path.isabs(d["root"]) for d in _docs(out).values())
    with pytest.raises(SystemExit) as exc:  # an argument error now: refused before any work
        shard_main([*argv, "--manifest-root", "elsewhere"])
    assert exc.value.code == 2
    assert "manifest root 'elsewhere'" in capsys.readouterr().err


def test_rewrite_roots_of_an_existing_build(raw_root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = {p: p.read_bytes() for p in out.rglob("*")
              if p.is_file() and p.name != WDINFO_NAME and STATE_DIR not in p.parts}
    want = _samples(str(out))
    assert rewrite_roots_main([str(out), "--absolute"]) == 0
    assert f"{len(_docs(out))} manifest(s)" in capsys.readouterr().out
    for bucket, doc in _docs(out).items():
        assert doc["root"] == str(out.absolute() / bucket) and doc["format_version"] == 1
    assert {p: p.read_bytes() for p in before} == before  # tars, key indexes: untouched
    monkeypatch.chdir(tmp_path)
    assert _samples(str(out)) == want and all_problems(out) == []
    # A copy elsewhere: its absolute roots still name the original; rewriting fixes them.
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    assert any("does not name the manifest's folder" in p for p in all_problems(moved))
    assert rewrite_roots_main([str(moved), "--absolute"]) == 0
    assert all(d["root"].startswith(str(moved.absolute())) for d in _docs(moved).values())
    assert rewrite_roots_main([str(moved), "--relative"]) == 0
    assert {d["root"] for d in _docs(moved).values()} == {"."}
    assert rewrite_roots_main([str(moved), "--url", "s3://b/p"]) == 0
    assert {d["root"] for d in _docs(moved).values()} == {f"s3://b/p/{b}" for b in _docs(moved)}
    assert rewrite_roots_main([str(tmp_path / "raw"), "--absolute"]) == 2
    assert "no wdinfo.json under" in capsys.readouterr().err


def test_rewrite_refuses_a_manifest_whose_tars_are_elsewhere(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data"
    write_pid_output(data, "photos", {"a": {"image": (".jpg", b"x")}, "b": {"image": (".jpg", b"y")}})
    apart = tmp_path / "manifests" / "aspect_ratio_1_1"
    apart.mkdir(parents=True)
    shutil.copy(data / "aspect_ratio_1_1" / WDINFO_NAME, apart / WDINFO_NAME)
    before = (apart / WDINFO_NAME).read_bytes()
    assert rewrite_roots_main([str(tmp_path / "manifests"), "--relative"]) == 2
    assert "its tars are not beside it" in capsys.readouterr().err
    assert (apart / WDINFO_NAME).read_bytes() == before


def test_pid_written_keys_are_derived_as_pid_derives_them(tmp_path: Path) -> None:
    samples = {
        "rotated.exif6": {"image": (".jpg", b"jpeg bytes"), "caption": (".json", b'{"prompt": "sideways"}')},
        "plain": {"image": (".jpg", b"other"), "caption": (".json", b'{"prompt": "plain"}')},
        "a.b.c": {"image": (".png", b"png"), "caption": (".json", b'{"prompt": "dots"}')},
    }
    manifest = write_pid_output(tmp_path / "pid", "photos", samples)
    assert read_wdinfo(manifest).format_version == 0  # PiD writes none
    got = _samples(str(tmp_path / "pid"))
    assert got == {
        "photos__rotated-exif6": {"image.jpg": b"jpeg bytes", "caption.json": b'{"prompt": "sideways"}'},
        "photos__plain": {"image.jpg": b"other", "caption.json": b'{"prompt": "plain"}'},
        "photos__a-b-c": {"image.png": b"png", "caption.json": b'{"prompt": "dots"}'},
    }
    # Our own manifests keep the WebDataset rule: with format_version 1 the same tars give the
    # first-dot keys (our builds never write a dot into a key, so there both rules agree).
    doc = json.loads(manifest.read_bytes()) | {"format_version": 1}
    ours = tmp_path / "ours" / "aspect_ratio_1_1"
    shutil.copytree(manifest.parent, ours)
    (ours / WDINFO_NAME).write_text(json.dumps(doc))
    assert set(_samples(str(tmp_path / "ours"))) == {"photos__rotated", "photos__plain", "photos__a"}


@pytest.mark.parametrize(("name", "want"), [
    ("photos__rotated.exif6.jpg", ("photos__rotated-exif6", "jpg")),
    ("k.jpg", ("k", "jpg")),
    ("a.b.c.tar.gz", ("a-b-c-tar", "gz")),
    ("no_dot", ("no_dot", "")),
    ("d.x/a.jpg", ("d-x/a", "jpg")),
])
def test_pid_name_rule(name: str, want: tuple[str, str]) -> None:
    assert split_pid_member_name(name) == want


def test_dagster_manifest_root_names_each_source_below_a_url() -> None:
    from pid_platform.defs.resources import ShardingResource

    assert ShardingResource().manifest_root_of("photos") == "relative"
    assert ShardingResource(manifest_root="absolute").manifest_root_of("photos") == "absolute"
    assert ShardingResource(manifest_root="s3://b/out/").manifest_root_of("photos") == "s3://b/out/photos"


def test_an_up_to_date_rebuild_still_writes_the_roots_it_is_asked_for(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    store, config = LocalSourceStore(raw_root), ShardingConfig(max_shard_size_mb=SMALL_BOUND_MB)
    assert not build_source(store, SOURCE, out, config).up_to_date
    tars = {p: p.stat().st_ino for p in out.rglob("*.tar")}
    again = build_source(store, SOURCE, out, config, manifest_root="absolute")
    assert again.up_to_date, "only the roots differ: no tar is staged again"
    assert all(d["root"] == str(out.absolute() / b) for b, d in _docs(out).items())
    assert {p: p.stat().st_ino for p in out.rglob("*.tar")} == tars and all_problems(out) == []
    # The build state follows the rewrite: the same request again is a no-op that changes nothing.
    before = {p: p.read_bytes() for p in out.rglob(WDINFO_NAME)}
    assert build_source(store, SOURCE, out, config, manifest_root="absolute").up_to_date
    assert {p: p.read_bytes() for p in out.rglob(WDINFO_NAME)} == before
    # pid-rewrite-roots keeps it too; a build asking for relative roots writes them back.
    assert rewrite_roots_main([str(out), "--url", "s3://b/p"]) == 0
    assert build_source(store, SOURCE, out, config, manifest_root="s3://b/p").up_to_date
    assert build_source(store, SOURCE, out, config).up_to_date
    assert {d["root"] for d in _docs(out).values()} == {"."}
