"""The compact memory-mapped index: exact equality with the NPZ, smallest dtypes, constants stored
once, per-source files shared by processes, generations that never disturb mapped readers."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import (
    ARRAY_NAMES,
    CompactIndex,
    build_sidecar,
    print_compact_report,
    read_sidecar,
)
from loader.lerobot.sidecar import compact as compact_mod
from loader.lerobot.sidecar.compact import as_range, smallest_int_dtype

REPO = "pid-test/robot-arm"


def make_sidecar(root: Path, out: Path, **kw) -> Path:
    build_sidecar(LeRobotMeta.load(str(root)), out, repo_id=REPO, revision="r1", data_root=str(root), **kw)
    return out


@pytest.fixture(scope="module")
def sidecars(lerobot_v3_root: Path, lerobot_v3_h264_root: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("sidecars")
    return {"av1": make_sidecar(lerobot_v3_root, d / "av1.npz"),
            "h264": make_sidecar(lerobot_v3_h264_root, d / "h264.npz")}


# -- encoding units ---------------------------------------------------------------------------

def test_smallest_int_dtype_and_ranges() -> None:
    assert smallest_int_dtype(np.array([0, 255])) == np.uint8
    assert smallest_int_dtype(np.array([-1, 127])) == np.int8
    assert smallest_int_dtype(np.array([0, 256])) == np.uint16
    assert smallest_int_dtype(np.array([-129, 5])) == np.int16
    assert smallest_int_dtype(np.array([0, 70000])) == np.uint32
    assert smallest_int_dtype(np.array([-1, 70000])) == np.int32
    assert smallest_int_dtype(np.array([0, 2**32])) == np.int64
    assert as_range(np.array([7, 7, 7])) == (7, 0)
    assert as_range(np.array([100, 116, 132, 148])) == (100, 16)
    assert as_range(np.array([1, 2, 4])) is None
    assert as_range(np.array([5])) == (5, 0)
    assert as_range(np.array([], dtype=np.int64)) is None


# -- equality with the NPZ --------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["av1", "h264"])
def test_compact_equals_npz_for_every_file(kind: str, sidecars: dict[str, Path], tmp_path: Path) -> None:
    idx = CompactIndex.open(sidecars[kind], cache_root=tmp_path)
    with read_sidecar(sidecars[kind]) as sc:
        assert idx.files == sc.files
        for rel in sc.files:
            want = sc.arrays(rel)
            got = idx.arrays(rel)
            assert got.sample_count == sc.file(rel).sample_count
            for name in ARRAY_NAMES:
                a = got[name]
                assert len(a) == len(want[name]) and not a.flags.writeable, name
                np.testing.assert_array_equal(a, want[name], err_msg=f"{rel} {name}")
                with pytest.raises(ValueError, match="read-only"):
                    a[...] = 0
                kind_ = got.kind(name)
                if name == "sample_pts":
                    assert a.dtype == np.float64 and kind_ == "dense:float64"   # exact, not rounded
                elif name == "sync_samples":
                    assert kind_ == f"dense:{smallest_int_dtype(want[name]).name}"
                elif as_range(want[name]) is not None:
                    # a constant (or progression) is stored once: no per-sample bytes
                    assert kind_ in ("constant", "range") and got.stored_nbytes(name) == 0
                    if kind_ == "constant":
                        assert a.strides == (0,)
                else:
                    assert a.dtype == smallest_int_dtype(want[name]) and a.dtype.itemsize < 8
            assert got.kind("sample_durations") == "constant"   # constant frame rate


def test_report_sizes(sidecars: dict[str, Path], tmp_path: Path, capsys) -> None:
    report = print_compact_report(sidecars["h264"], cache_root=tmp_path)
    out = capsys.readouterr().out
    assert "int64 arrays" in out and "compact files" in out
    with read_sidecar(sidecars["h264"]) as sc:
        n = sum(sc.file(r).sample_count for r in sc.files)
        sync = sum(len(sc.arrays(r)["sync_samples"]) for r in sc.files)
    assert report.samples == n and report.int64_bytes == 8 * (5 * n + sync)
    assert report.compact_array_bytes < report.int64_bytes / 2
    assert report.kinds["sample_durations"] == {"constant": report.files}


# -- the cache: location, subsets, generations -------------------------------------------------

def test_default_location_honours_hf_lerobot_home(sidecars: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "home"))
    idx = CompactIndex.open(sidecars["av1"])
    assert idx.directory.parent == tmp_path / "home" / "streaming-indexes"
    assert idx.directory.name == f"g{compact_mod.COMPACT_GENERATION}-{idx.digest}"


def test_only_needed_files_are_materialised(sidecars: dict[str, Path], tmp_path: Path) -> None:
    with read_sidecar(sidecars["h264"]) as sc:
        rels = sc.files
    a = CompactIndex.open(sidecars["h264"], cache_root=tmp_path, files=rels[:2])
    assert sorted(p.name for p in a.directory.glob("*.cidx")) == ["0.cidx", "1.cidx"]
    with pytest.raises(KeyError, match="was not opened"):
        a.arrays(rels[3])
    first = a.path_of(rels[1]).stat()
    b = CompactIndex.open(sidecars["h264"], cache_root=tmp_path, files=rels[1:4])
    assert len(list(b.directory.glob("*.cidx"))) == 4
    again = b.path_of(rels[1]).stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)   # not rewritten
    with pytest.raises(KeyError, match="not indexed"):
        CompactIndex.open(sidecars["h264"], cache_root=tmp_path, files=["videos/nope.mp4"])


def test_new_generation_and_new_sidecar_leave_mapped_readers_alone(
        lerobot_v3_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = Path(shutil.copytree(lerobot_v3_root, tmp_path / "ds"))
    npz = make_sidecar(ds, tmp_path / "sc.npz")
    cache = tmp_path / "cache"
    old = CompactIndex.open(npz, cache_root=cache)
    rel = old.files[0]
    view = old.arrays(rel)
    sizes = np.array(view["sample_sizes"])
    # A newer compact generation: a new directory, converted on first open; the old one untouched.
    monkeypatch.setattr(compact_mod, "COMPACT_GENERATION", compact_mod.COMPACT_GENERATION + 1)
    new = CompactIndex.open(npz, cache_root=cache)
    assert new.directory != old.directory and old.path_of(rel).exists()
    np.testing.assert_array_equal(new.arrays(rel)["sample_sizes"], sizes)
    # A rebuilt sidecar (other bytes -> other digest) gets its own directory too.
    (ds / rel).write_bytes((ds / rel).read_bytes())   # new identity: the fingerprint changes
    make_sidecar(ds, npz)
    rebuilt = CompactIndex.open(npz, cache_root=cache)
    assert rebuilt.digest != old.digest and rebuilt.directory not in (old.directory, new.directory)
    # Even with the old generation deleted, pages mapped by the old reader stay valid (POSIX).
    shutil.rmtree(old.directory)
    np.testing.assert_array_equal(view["sample_sizes"], sizes)


def test_damaged_file_is_replaced_by_rename(sidecars: dict[str, Path], tmp_path: Path) -> None:
    idx = CompactIndex.open(sidecars["av1"], cache_root=tmp_path)
    rel = idx.files[0]
    held = idx.arrays(rel)["sample_offsets"]
    want = np.array(held)
    path = idx.path_of(rel)
    inode = path.stat().st_ino
    bad = path.with_name("bad")
    bad.write_bytes(path.read_bytes()[:40])    # truncated, put in place by rename
    os.replace(bad, path)
    fresh = CompactIndex.open(sidecars["av1"], cache_root=tmp_path)
    np.testing.assert_array_equal(fresh.arrays(rel)["sample_offsets"], want)
    assert path.stat().st_ino != inode
    np.testing.assert_array_equal(held, want)    # the old mapping is still the old inode


# -- processes sharing a cache -----------------------------------------------------------------

def _open_in_process(npz: str, cache: str, rel: str, barrier, queue) -> None:
    barrier.wait()
    idx = CompactIndex.open(npz, cache_root=cache)
    total = int(np.asarray(idx.arrays(rel)["sample_sizes"], dtype=np.int64).sum())
    path = str(idx.path_of(rel))
    maps = Path("/proc/self/maps").read_text()
    st = os.stat(path)
    queue.put((os.getpid(), total, path in maps, (st.st_dev, st.st_ino)))


def test_two_processes_map_the_same_file(sidecars: dict[str, Path], tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    with read_sidecar(sidecars["h264"]) as sc:
        rel = sc.files[2]
        want = int(sc.arrays(rel)["sample_sizes"].sum())
    procs = [ctx.Process(target=_open_in_process, args=(str(sidecars["h264"]), str(tmp_path), rel, barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [r[1] for r in results] == [want, want]
    assert all(r[2] for r in results)                 # each has the .cidx file mapped
    assert results[0][3] == results[1][3]              # the same inode: the same page-cache pages
    assert len(list(tmp_path.glob("*/*.cidx"))) == 6 and not list(tmp_path.glob("*/*.tmp-*"))


def test_pickles_for_dataloader_workers_and_clears_dead_temps(sidecars: dict[str, Path],
                                                              tmp_path: Path) -> None:
    idx = CompactIndex.open(sidecars["av1"], cache_root=tmp_path, files=[])
    idx.directory.mkdir(parents=True)   # files=[]: nothing converted, no directory yet
    dead = idx.directory / "0.cidx.tmp-999999"   # what a killed conversion leaves
    dead.write_bytes(b"partial")
    with read_sidecar(sidecars["av1"]) as sc:
        rel = sc.files[0]
        want = sc.arrays(rel)
    idx = CompactIndex.open(sidecars["av1"], cache_root=tmp_path, files=[rel])
    assert not dead.exists()
    clone = pickle.loads(pickle.dumps(idx))
    assert clone.files == [rel] and clone.digest == idx.digest
    for name in ARRAY_NAMES:
        np.testing.assert_array_equal(clone.arrays(rel)[name], want[name])
