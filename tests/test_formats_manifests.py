"""wdinfo.json, the parquet key index, the catalog and the atomic writer they all use."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from loader.formats.atomic import (
    TMP_MARKER,
    atomic_write_bytes,
    atomic_writer,
    remove_stale_temp_files,
    temp_name,
)
from loader.formats.catalog import (
    Catalog,
    SourceEntry,
    UnknownDatasetError,
    read_catalog,
    write_catalog,
)
from loader.formats.errors import FormatError
from loader.formats.key_index import (
    KeyIndexRow,
    index_modalities,
    key_index_table,
    read_key_columns,
    read_key_index,
    write_key_index,
)
from loader.formats.wdinfo import (
    TarEntry,
    WdinfoManifest,
    derive_chunk_size,
    read_wdinfo,
    write_wdinfo,
)
from pid_platform.sharding.catalog import build_catalog

PID_KEYS = ["data_keys", "data_list", "data_list_key_count", "total_key_count", "root"]


def _manifest() -> WdinfoManifest:
    tars = [
        TarEntry("part_000000/000000.tar", 3, {"image": 30720, "caption": 10240}, {"image": "ab", "caption": "cd"},
                 "_key_index/part_000000/000000.parquet"),
        TarEntry("part_000000/000001.tar", 1, {"image": 10240, "caption": 10240}, {}, None),
    ]
    return WdinfoManifest(["caption", "image"], tars, ".", derive_chunk_size([3, 1]), bucket="aspect_ratio_1_1",
                          source="photos")


def test_wdinfo_round_trip_keeps_pid_keys_and_a_relative_root(tmp_path: Path) -> None:
    path = write_wdinfo(tmp_path / "b", _manifest())
    doc = json.loads(path.read_bytes())
    assert all(k in doc for k in PID_KEYS)
    assert doc["data_list_key_count"] == [3, 1] and doc["total_key_count"] == 4 and doc["chunk_size"] == 3
    man = read_wdinfo(path)
    assert man.tars == _manifest().tars and man.bucket == "aspect_ratio_1_1"
    assert man.root_path() == str(tmp_path / "b")
    # Moved data keeps working: root is relative to the manifest's folder.
    shutil.move(tmp_path / "b", tmp_path / "moved")
    assert read_wdinfo(tmp_path / "moved" / "wdinfo.json").root_path() == str(tmp_path / "moved")


def test_wdinfo_written_by_pid_is_read(tmp_path: Path) -> None:
    # PiD: absolute root, no chunk_size, no format_version, no per-tar details.
    doc = {"data_keys": ["image", "caption"], "data_list": ["part_000000/000000.tar", "part_000000/000001.tar"],
           "data_list_key_count": [1000, 998], "total_key_count": 1998, "root": "/mnt/data/MultiAspect_4K_1M"}
    (tmp_path / "wdinfo.json").write_text(json.dumps(doc))
    man = read_wdinfo(tmp_path / "wdinfo.json")
    assert man.root_path() == "/mnt/data/MultiAspect_4K_1M"
    assert man.chunk_size == 1000 and man.format_version == 0 and man.total_key_count == 1998


@pytest.mark.parametrize(
    ("doc", "match"),
    [("{not json", "invalid JSON"),
     ({"data_keys": ["image"]}, "missing or malformed"),
     ({"data_keys": ["image"], "data_list": ["a.tar"], "data_list_key_count": [1, 2]}, "1 entries"),
     ({"data_keys": ["image"], "data_list": ["a.tar"], "data_list_key_count": [1], "total_key_count": 5}, "!= sum")],
)
def test_malformed_wdinfo_names_the_file(tmp_path: Path, doc, match: str) -> None:
    p = tmp_path / "wdinfo.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(FormatError, match=match) as err:
        read_wdinfo(p)
    assert str(p) in str(err.value)


def _rows() -> list[KeyIndexRow]:
    return [
        KeyIndexRow("a_b_0123456789", "a.b", "aspect_ratio_1_1", 64, 64,
                    {"image": ("a_b_0123456789.jpg", 0, 700), "caption": ("a_b_0123456789.json", 0, 30)}),
        KeyIndexRow("c", "c", None, None, None, {"image": ("c.png", 1536, 9), "caption": ("c.json", 1024, 2)}),
    ]


def test_key_index_round_trip_and_same_rows_same_bytes(tmp_path: Path) -> None:
    table = key_index_table(_rows(), ["caption", "image"])
    write_key_index(tmp_path / "a.parquet", table)
    write_key_index(tmp_path / "b.parquet", key_index_table(_rows(), ["caption", "image"]))
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    back = read_key_index(tmp_path / "a.parquet")
    assert index_modalities(back) == ["caption", "image"]
    d = back.to_pydict()
    assert d["key"] == ["a_b_0123456789", "c"] and d["basename"] == ["a.b", "c"]
    assert d["offset.image"] == [0, 1536] and d["size.caption"] == [30, 2] and d["width"] == [64, None]


def test_key_columns_read_from_a_path_or_bytes(tmp_path: Path) -> None:
    path = tmp_path / "k.parquet"
    write_key_index(path, key_index_table(_rows(), ["caption", "image"]))
    for source in (path, path.read_bytes()):
        cols = read_key_columns(source, ["image"])
        assert cols.keys == ["a_b_0123456789", "c"]
        assert cols.offsets == {"image": [0, 1536]} and cols.members == {} and cols.sizes == {}
    full = read_key_columns(path, members=True, sizes=True)  # every modality the index lists
    assert full.members == {"caption": ["a_b_0123456789.json", "c.json"], "image": ["a_b_0123456789.jpg", "c.png"]}
    assert full.sizes == {"caption": [30, 2], "image": [700, 9]} and full.offsets["caption"] == [0, 1024]
    # A modality the index has no column for is left out: the caller decides what that means.
    assert read_key_columns(path, ["image", "umt5"]).offsets == {"image": [0, 1536]}
    assert read_key_columns(path, ["image"], offsets=False).offsets == {}


def test_key_columns_are_read_on_the_system_allocator_without_pyarrow_fs(tmp_path: Path) -> None:
    """A reading process (a DataLoader worker) reads key indexes on the read-ahead's threads:
    through arrow's default pool (mimalloc, a heap per thread) they held ~10 MB more at the end
    than through malloc, and ``pyarrow.parquet`` loads ``pyarrow.fs``, whose S3 library's start-up
    touched 2.7 MB. In a fresh interpreter, as a worker reads them: the table goes through malloc
    (parquet's page buffers still take arrow's pool: 170 KB of 730 for 5,000 rows), and no
    ``pyarrow.fs`` is loaded."""
    import subprocess
    import sys

    path = tmp_path / "k.parquet"
    rows = [KeyIndexRow(f"k{i:06d}", f"k{i:06d}", None, None, None,
                        {"image": (f"k{i:06d}.jpg", 1024 * i, 700), "caption": (f"k{i:06d}.json", 512 * i, 30)})
            for i in range(5000)]
    write_key_index(path, key_index_table(rows, ["caption", "image"]))
    probe = (
        "import sys, pyarrow as pa\n"
        "import loader.wds.pipeline\n"
        "from loader.formats.key_index import read_key_columns\n"
        f"cols = read_key_columns(open({str(path)!r}, 'rb').read(), ['image'], members=True)\n"
        "assert cols.members['image'][4999] == 'k004999.jpg' and cols.offsets['image'][1] == 1024\n"
        "print(pa.system_memory_pool().max_memory() > 2 * pa.default_memory_pool().max_memory(),\n"
        "      sorted(m for m in sys.modules if m in ('pyarrow.fs', 'pyarrow.parquet', 'pyarrow._s3fs')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "[]"], out.stdout + out.stderr


def test_key_columns_name_a_file_that_is_no_key_index(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(FormatError, match=r"bad\.parquet: not a readable key index"):
        read_key_columns(bad)
    with pytest.raises(FormatError, match=r"s3://b/k\.parquet: not a readable key index"):
        read_key_columns(b"junk", origin="s3://b/k.parquet")
    write_key_index(tmp_path / "nokey.parquet", key_index_table(_rows(), ["image"]).drop_columns(["key"]))
    with pytest.raises(FormatError, match="needs a 'key' column"):
        read_key_columns(tmp_path / "nokey.parquet")
    with pytest.raises(FileNotFoundError):
        read_key_columns(tmp_path / "missing.parquet")


def test_catalog_resolves_datasets_to_manifest_paths(tmp_path: Path) -> None:
    for src in ("photos", "renders"):
        write_wdinfo(tmp_path / src / "aspect_ratio_1_1", _manifest())
    (tmp_path / ".pid-build").mkdir()
    path, cat = build_catalog(tmp_path, {"mixed": ["photos", "renders"]})
    back = read_catalog(path)
    assert back.sources["photos"].total_key_count == 4
    assert back.resolve("mixed") == [
        str(tmp_path / s / "aspect_ratio_1_1" / "wdinfo.json") for s in ("photos", "renders")
    ]
    assert back.resolve("all") == back.resolve("mixed") and back.resolve("photos")[0].endswith("wdinfo.json")
    with pytest.raises(UnknownDatasetError, match="known: "):
        back.resolve("nope")
    with pytest.raises(ValueError, match="missing_src"):
        build_catalog(tmp_path, {"bad": ["missing_src"]})
    broken = Catalog({"photos": SourceEntry("photos", [])}, {"d": ["photos", "gone"]}, str(tmp_path))
    write_catalog(tmp_path / "c2", broken)
    with pytest.raises(UnknownDatasetError, match="'gone'"):
        read_catalog(tmp_path / "c2").resolve("d")
    (tmp_path / "c3").mkdir()
    (tmp_path / "c3" / "catalog.json").write_text("{}")
    with pytest.raises(FormatError, match="unreadable catalog"):
        read_catalog(tmp_path / "c3")


def test_atomic_writer_commits_only_complete_files(tmp_path: Path) -> None:
    final = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(final, b"good")
    with pytest.raises(RuntimeError), atomic_writer(final) as fh:
        fh.write(b"half")
        raise RuntimeError("interrupted")
    assert final.read_bytes() == b"good"
    assert os.listdir(final.parent) == ["f.bin"]
    assert temp_name(final).name == f"f.bin{TMP_MARKER}{os.getpid()}"


def test_remove_stale_temp_files(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    left = tmp_path / "a" / f"000001.tar{TMP_MARKER}4242"
    left.write_bytes(b"partial")
    (tmp_path / "a" / "000000.tar").write_bytes(b"complete")
    assert remove_stale_temp_files(tmp_path) == [left]
    assert os.listdir(tmp_path / "a") == ["000000.tar"]
    assert remove_stale_temp_files(tmp_path / "missing") == []
