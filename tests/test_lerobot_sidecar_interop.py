"""Sidecar interop: LeRobot's own NPZ layout is read (and ours is written in it, with our fields
added), and the ``__manifest__`` layout published before still reads.

LeRobot-layout files here come from tests/support/sidecar_layouts.py, written the way LeRobot's
writer writes them (``np.savez_compressed``, LeRobot's fields only) from the real fixture videos.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from loader.io import roots as fs
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.mp4 import index_mp4
from loader.lerobot.sidecar import (
    ARRAY_NAMES,
    LAYOUT_LEGACY,
    LAYOUT_LEROBOT,
    CompactIndex,
    SidecarSchemaError,
    build_sidecar,
    ensure_sidecar,
    fingerprints_match,
    read_sidecar,
    validate_sidecar,
)
from loader.lerobot.sidecar.validate import size_identifies
from tests.support.sidecar_layouts import (
    LEROBOT_MP4_KEYS,
    LEROBOT_SIDECAR_KEYS,
    write_legacy_sidecar,
    write_lerobot_only_sidecar,
)

REPO = "pid-test/robot-arm"
REV = "0123456789abcdef0123456789abcdef01234567"
DATASETS = ["lerobot_v3_root", "lerobot_v3_h264_root"]


@pytest.fixture
def ds(lerobot_v3_h264_root: Path, tmp_path: Path) -> Path:
    """A private copy of the H.264 (B-frames, edit list) dataset: tests change its files."""
    return Path(shutil.copytree(lerobot_v3_h264_root, tmp_path / "ds"))


def ours(root: Path, out: Path) -> Path:
    build_sidecar(LeRobotMeta.load(str(root)), out, repo_id=REPO, revision=REV, data_root=str(root))
    return out


def same_entries(a, b) -> None:
    """Every field both layouts carry is equal (identity fields aside)."""
    for name in ("path", "size", "ftyp", "stsd", "timescale", "track_id", "codec", "width",
                 "height", "sample_count", "moov_offset", "duration"):
        assert getattr(a, name) == getattr(b, name), name


# -- LeRobot's sidecars, read -------------------------------------------------------------------

@pytest.mark.parametrize("dataset", DATASETS)
def test_lerobot_sidecar_reads_validates_and_maps(dataset: str, request, tmp_path: Path) -> None:
    root: Path = request.getfixturevalue(dataset)
    theirs = tmp_path / "lerobot.npz"
    write_lerobot_only_sidecar(root, theirs, repo_id=REPO, revision=REV)
    meta = LeRobotMeta.load(str(root))
    with read_sidecar(ours(root, tmp_path / "ours.npz")) as mine, read_sidecar(theirs) as sc:
        assert sc.layout == LAYOUT_LEROBOT and sc.files == meta.video_files() == mine.files
        assert (sc.info.repo_id, sc.info.revision, sc.info.subset) == (REPO, REV, False)
        for rel in sc.files:
            f = sc.file(rel)
            same_entries(f, mine.file(rel))
            # No source fingerprint: the size is the identity, as LeRobot checks it.
            assert (f.identity, f.fingerprint, f.stable) == ("size", None, False)
            assert f.mdat == mine.file(rel).mdat and f.edit is None   # LeRobot keeps no edit
            got, want = sc.arrays(rel), mine.arrays(rel)
            for name in ARRAY_NAMES:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{rel} {name}")
    assert validate_sidecar(theirs, meta, repo_id=REPO, revision=REV, require_complete=True) == []
    idx = CompactIndex.open(theirs, cache_root=tmp_path / "idx")
    with read_sidecar(theirs) as sc:
        for rel in idx.files:
            view, arrays = idx.arrays(rel), sc.arrays(rel)
            for name in ARRAY_NAMES:
                np.testing.assert_array_equal(np.asarray(view[name], dtype=arrays[name].dtype), arrays[name])
    idx.close()


def test_published_lerobot_sidecar_is_installed_not_rebuilt(ds: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from loader.lerobot.sidecar import ensure as ensure_mod

    def no_build(*a, **kw):
        raise AssertionError("built locally although a valid published sidecar was offered")

    monkeypatch.setattr(ensure_mod, "build_sidecar", no_build)
    pub = tmp_path / "published.npz"
    write_lerobot_only_sidecar(ds, pub, repo_id=REPO, revision=REV)
    entry = ensure_sidecar(LeRobotMeta.load(str(ds)), repo_id=REPO, revision=REV,
                           cache_root=tmp_path / "cache", published=lambda: pub)
    assert entry.read_bytes() == pub.read_bytes()
    with read_sidecar(entry) as sc:
        assert sc.layout == LAYOUT_LEROBOT


def test_size_only_entries_catch_a_size_change_and_need_a_fixed_root(ds: Path, tmp_path: Path) -> None:
    theirs = tmp_path / "lerobot.npz"
    write_lerobot_only_sidecar(ds, theirs, repo_id=REPO, revision=REV)
    meta = LeRobotMeta.load(str(ds))
    rel = meta.video_files()[2]
    with open(ds / rel, "ab") as fh:
        fh.write(b"\0" * 16)   # trailing bytes: the size changes
    problems = validate_sidecar(theirs, meta)
    assert len(problems) == 1 and f"{rel} changed size" in problems[0]
    # Size identifies a file only where it cannot change at the same path and size.
    assert size_identifies(str(ds)) and size_identifies(f"file://{ds}")
    assert size_identifies(f"hf://datasets/{REPO}@{REV}")
    assert not size_identifies(f"hf://datasets/{REPO}@main") and not size_identifies(f"hf://datasets/{REPO}")
    assert not size_identifies("s3://bucket/ds") and not size_identifies("https://host/ds")


def test_lerobot_source_fingerprints_are_checked(ds: Path, tmp_path: Path) -> None:
    meta = LeRobotMeta.load(str(ds))
    fps = {rel: fs.file_identity(str(ds), rel).fingerprint for rel in meta.video_files()}
    theirs = tmp_path / "lerobot.npz"
    write_lerobot_only_sidecar(ds, theirs, repo_id=REPO, revision=REV, fingerprints=fps)
    with read_sidecar(theirs) as sc:
        assert all((f.identity, f.stable) == ("fingerprint", True) for f in sc.info.files)
        assert [f.fingerprint for f in sc.info.files] == [fps[r] for r in sc.files]
    assert validate_sidecar(theirs, meta) == []
    rel = meta.video_files()[0]
    data = (ds / rel).read_bytes()
    (ds / rel).unlink()
    (ds / rel).write_bytes(data)   # same bytes and size, a new file: a new identity
    problems = validate_sidecar(theirs, meta)
    assert len(problems) == 1 and f"{rel} was replaced" in problems[0]
    # Bare ETags (LeRobot's) match our self-describing ones.
    assert fingerprints_match('"abc"', 'etag:"abc"') and fingerprints_match("abc", 's3:etag="abc";version=7')
    assert not fingerprints_match("abc", 'etag:"abd"')


@pytest.mark.parametrize("change", ["version", "schema_version", "no_composition_offsets", "no_file_array"])
def test_bad_lerobot_sidecar_is_a_clear_schema_error(change: str, ds: Path, tmp_path: Path) -> None:
    out = tmp_path / "bad.npz"
    kw = {"version": {"version": 2}, "schema_version": {"schema_version": 2},
          "no_composition_offsets": {"drop_arrays": ["sample_composition_offsets"]},
          "no_file_array": {"drop_arrays": ["sync_samples"]}}[change]
    write_lerobot_only_sidecar(ds, out, repo_id=REPO, revision=REV, **kw)
    match = {"version": r"manifest_json has version 2, this loader reads version 3.*rebuild",
             "schema_version": r"sidecar.schema_version 2, this loader reads 3; rebuild",
             "no_composition_offsets": r"arrays named by the manifest are missing \(0/sample_composition_offsets"
                                       r".*no sample_composition_offsets\); rebuild",
             "no_file_array": r"missing \(0/sync_samples, 1/sync_samples.*; rebuild"}[change]
    with pytest.raises(SidecarSchemaError, match=match):
        read_sidecar(out)
    problems = validate_sidecar(out, LeRobotMeta.load(str(ds)))
    assert len(problems) == 1 and str(out) in problems[0]


# -- ours, in LeRobot's layout ------------------------------------------------------------------

def test_ours_is_lerobot_layout_with_our_fields_added(ds: Path, tmp_path: Path) -> None:
    out = ours(ds, tmp_path / "ours.npz")
    meta = LeRobotMeta.load(str(ds))
    rels = meta.video_files()
    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
    assert sorted(names) == sorted(["manifest_json.npy"] + [f"{i}/{a}.npy" for i in range(len(rels))
                                                            for a in ARRAY_NAMES])
    assert names[-1] == "manifest_json.npy"   # written last
    # Read it the way LeRobot's reader does: np.load, bytes(...), then per-file members by position.
    with np.load(out, allow_pickle=False) as z:
        raw = z["manifest_json"]
        assert raw.dtype.kind == "S" and raw.shape == ()   # as np.savez stores a bytes object
        payload = json.loads(bytes(raw).decode("utf-8"))
        assert payload["version"] == 3 and isinstance(payload["sidecar"], dict)
        assert set(LEROBOT_SIDECAR_KEYS) <= set(payload["sidecar"])
        assert {"subset", "created_by"} <= set(payload["sidecar"])   # ours, added
        assert payload["sidecar"]["source_files"] == [[r, (ds / r).stat().st_size] for r in rels]
        assert payload["sidecar"]["source_fingerprints"] == {
            r: fs.file_identity(str(ds), r).fingerprint for r in rels}
        assert [item["file_path"] for item in payload["files"]] == rels
        for i, (rel, item) in enumerate(zip(rels, payload["files"], strict=True)):
            idx = index_mp4(fs.url(str(ds), rel))
            mp4 = item["mp4"]
            assert set(LEROBOT_MP4_KEYS) <= set(mp4) and item["file_size"] == mp4["file_size"] == idx.file_size
            assert {"edit", "mdat", "sample_count", "stable"} <= set(mp4)   # ours, added
            assert bytes.fromhex(mp4["ftyp"]) == idx.ftyp and bytes.fromhex(mp4["stsd_body"]) == idx.stsd[8:]
            assert (mp4["moov_offset"], mp4["timescale"], mp4["track_id"]) == (idx.moov[0], idx.timescale, idx.track_id)
            assert mp4["duration"] == int(idx.sample_durations.sum())
            assert mp4["mdat_offset"] + 8 == mp4["mdat_payload_offset"] == idx.mdat[0][0] + 8
            assert mp4["faststart"] == (idx.moov[0] < idx.mdat[0][0])
            for name in ARRAY_NAMES:
                a = z[f"{i}/{name}"]
                assert a.ndim == 1 and a.dtype.kind in "iuf"
                np.testing.assert_array_equal(a, getattr(idx, name))
    # Our own reader round-trips every field, and the identity is ours (fingerprint).
    with read_sidecar(out) as sc:
        assert sc.layout == LAYOUT_LEROBOT
        for rel in rels:
            idx = index_mp4(fs.url(str(ds), rel))
            f = sc.file(rel)
            assert (f.identity, f.stable, f.edit, f.stsd) == ("fingerprint", True, idx.edit, idx.stsd)
    assert validate_sidecar(out, meta) == []


# -- the layout published before ----------------------------------------------------------------

def test_legacy_manifest_sidecar_still_reads(ds: Path, tmp_path: Path) -> None:
    meta = LeRobotMeta.load(str(ds))
    with read_sidecar(ours(ds, tmp_path / "ours.npz")) as mine:
        arrays = {rel: mine.arrays(rel) for rel in mine.files}
        legacy = tmp_path / "legacy.npz"
        write_legacy_sidecar(legacy, mine.info, arrays)
        with read_sidecar(legacy) as sc:
            assert sc.layout == LAYOUT_LEGACY and sc.files == mine.files
            assert [f.id for f in sc.info.files] == [f"f{i:05d}" for i in range(len(sc.files))]
            for rel in sc.files:
                f = sc.file(rel)
                assert (f.fingerprint, f.stable, f.edit, f.mdat) == (
                    mine.file(rel).fingerprint, True, mine.file(rel).edit, mine.file(rel).mdat)
                for name in ARRAY_NAMES:
                    np.testing.assert_array_equal(sc.arrays(rel)[name], arrays[rel][name])
    assert validate_sidecar(legacy, meta, require_complete=True) == []
    idx = CompactIndex.open(legacy, cache_root=tmp_path / "idx")
    assert sorted(p.name for p in idx.directory.glob("*.cidx")) == [f"f{i:05d}.cidx" for i in range(len(idx.files))]
    np.testing.assert_array_equal(idx.arrays(idx.files[0])["sample_pts"], arrays[idx.files[0]]["sample_pts"])
    idx.close()
