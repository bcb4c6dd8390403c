"""The twin-tar contract: safe keys, buckets, paths and the deterministic USTAR writer."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from loader.formats.atomic import TMP_MARKER
from loader.formats.errors import FormatError
from loader.formats.twin_tar import (
    ASPECT_BUCKETS,
    BUCKET_NAMES,
    MAX_KEY_LEN,
    RECORD,
    USTAR_NAME_MAX,
    SourceChangedError,
    TarMember,
    disambiguate_key,
    iter_member_headers,
    key_index_relpath,
    member_name,
    nearest_bucket,
    sanitize_ext,
    sanitize_key,
    shard_relpath,
    split_member_name,
    tar_path,
    tar_size,
    write_tar,
)


@pytest.mark.parametrize(
    ("basename", "key"),
    [("id_0", "id_0"), ("a.b", "a_b"), ("x.tar.gz", "x_tar_gz"), ("../../etc/passwd", "______etc_passwd"),
     ("café au lait", "caf__au_lait"), ("", "_"), ("UPPER-case_9", "UPPER-case_9")],
)
def test_sanitize_key_leaves_no_dot_or_path_character(basename: str, key: str) -> None:
    assert sanitize_key(basename) == key


def test_long_names_stay_distinct_and_fit_a_ustar_header() -> None:
    a, b = "x" * 300 + "a", "x" * 300 + "b"
    ka, kb = sanitize_key(a), sanitize_key(b)
    assert ka != kb and len(ka) == len(kb) == MAX_KEY_LEN
    name = member_name(ka, sanitize_ext(".SafeTensors" + "x" * 40))
    assert len(name.encode()) <= USTAR_NAME_MAX
    d1, d2 = disambiguate_key("a_b", "a.b"), disambiguate_key("a_b", "a_b")
    assert d1 != d2 and d1 == disambiguate_key("a_b", "a.b") and "." not in d1


def test_sanitize_ext() -> None:
    assert sanitize_ext(".JPG") == "jpg"
    assert sanitize_ext("") == "bin"
    assert sanitize_ext("t5.npy") == "t5npy"  # the ext becomes one WebDataset field name


def test_every_bucket_ratio_maps_to_itself_and_log_space_is_symmetric() -> None:
    for name, w, h in ASPECT_BUCKETS:
        assert nearest_bucket(w * 100, h * 100) == name
        mirror = f"aspect_ratio_{h}_{w}"
        if mirror in BUCKET_NAMES:  # 21:9 has no portrait twin
            assert nearest_bucket(h * 100, w * 100) == mirror
    assert nearest_bucket(1920, 1080) == "aspect_ratio_16_9"
    assert nearest_bucket(4000, 10) == "aspect_ratio_21_9"
    # Log space: 2:1 and 1:2 are equally far from 1:1, so each lands on its own side.
    assert (nearest_bucket(2, 1), nearest_bucket(1, 2)) == ("aspect_ratio_16_9", "aspect_ratio_9_16")
    assert nearest_bucket(1000, 10) == "aspect_ratio_21_9"
    for bad in ((0, 5), (5, 0), (-1, 1)):
        with pytest.raises(ValueError):
            nearest_bucket(*bad)


def test_paths() -> None:
    assert shard_relpath(0) == "part_000000/000000.tar"
    assert shard_relpath(1234, part_size=1000) == "part_000001/001234.tar"
    assert shard_relpath(5, part_size=2) == "part_000002/000005.tar"
    assert key_index_relpath("part_000001/001234.tar") == "_key_index/part_000001/001234.parquet"
    assert tar_path("/o", "aspect_ratio_1_1", "image", "part_000000/000000.tar") == Path(
        "/o/aspect_ratio_1_1/image/part_000000/000000.tar"
    )
    assert tar_path("/o", None, "image", "p/x.tar") == Path("/o/image/p/x.tar")
    assert split_member_name("dir/id_0.caption.json") == ("dir/id_0", "caption.json")
    assert split_member_name("noext") == ("noext", "")
    with pytest.raises(ValueError):
        shard_relpath(-1)


SIZES = [0, 1, 511, 512, 513, 10240, 70000]


def _members(tmp_path: Path) -> tuple[list[TarMember], dict[str, bytes]]:
    members, want = [], {}
    for i, n in enumerate(SIZES):
        data = os.urandom(n)
        name = member_name(f"k{i}", "bin")
        want[name] = data
        if i % 2:  # both sources: a file (sendfile) and bytes in memory
            f = tmp_path / f"src{i}"
            f.write_bytes(data)
            members.append(TarMember(name, n, path=str(f)))
        else:
            members.append(TarMember(name, n, data=data))
    return members, want


def test_write_tar_size_offsets_and_bytes(tmp_path: Path) -> None:
    members, want = _members(tmp_path)
    out = tmp_path / "a.tar"
    offsets = write_tar(out, members)
    assert out.stat().st_size == tar_size(SIZES) and out.stat().st_size % RECORD == 0
    with tarfile.open(out) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf}
    assert got == want
    assert [(n, o) for n, o, _ in iter_member_headers(out)] == list(zip(want, offsets, strict=True))
    raw = out.read_bytes()
    for (name, data), off in zip(want.items(), offsets, strict=True):
        assert raw[off + 512 : off + 512 + len(data)] == data, name
    # Same members, same bytes: no time, owner or pid leaks into the archive.
    write_tar(tmp_path / "b.tar", members)
    assert (tmp_path / "b.tar").read_bytes() == raw
    assert [s["__key__"] for s in wds.WebDataset(str(out), shardshuffle=False)] == [f"k{i}" for i in range(len(SIZES))]


def test_empty_tar_is_valid(tmp_path: Path) -> None:
    write_tar(tmp_path / "e.tar", [])
    assert (tmp_path / "e.tar").stat().st_size == tar_size([]) == RECORD
    with tarfile.open(tmp_path / "e.tar") as tf:
        assert tf.getmembers() == []


def test_a_changed_source_leaves_neither_tar_nor_temp_file(tmp_path: Path) -> None:
    members, _ = _members(tmp_path)
    Path(members[1].path).write_bytes(b"grown" * 10)
    out = tmp_path / "x.tar"
    with pytest.raises(SourceChangedError, match="src1"):
        write_tar(out, members)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]


def test_a_changed_source_never_replaces_a_good_tar(tmp_path: Path) -> None:
    members, _ = _members(tmp_path)
    out = tmp_path / "x.tar"
    write_tar(out, members)
    good = out.read_bytes()
    bad = [TarMember("k.bin", 10, data=b"short")]
    with pytest.raises(SourceChangedError):
        write_tar(out, bad)
    assert out.read_bytes() == good


def test_names_longer_than_ustar_allows_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="longer than"):
        write_tar(tmp_path / "x.tar", [TarMember("k" * 101, 1, data=b"x")])


def test_loader_imports_neither_dagster_nor_the_build_side() -> None:
    """Training jobs import loader alone: the arrows run pid_platform -> loader, never back."""
    import subprocess
    import sys

    code = (
        "import sys, loader.wds.pipeline, loader.io, loader.lerobot.meta, loader.lerobot.mp4, "
        "loader.lerobot.sidecar, loader.lerobot.sidecar.published; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'pid_platform')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
