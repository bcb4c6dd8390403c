"""MP4 sidecar schema v3: build from real encoded video, NPZ round trip, validation, credentials.

Videos are real AV1 (libsvtav1, g=2) and H.264 with B-frames (ctts + an encoder-delay edit) from
``write_v3_dataset``; S3 is a real SeaweedFS server; ``hf://`` goes to the real range-capable
HTTP server acting as a STAND-IN for the Hub's ``resolve`` endpoint (no Hub offline).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from loader.io import roots as fs
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.mp4 import index_mp4
from loader.lerobot.sidecar import (
    ARRAY_NAMES,
    SIDECAR_SCHEMA_VERSION,
    SidecarBuildError,
    SidecarError,
    SidecarManifest,
    SidecarSchemaError,
    build_sidecar,
    public_root,
    read_sidecar,
    validate_sidecar,
    write_sidecar,
)
from loader.lerobot.sidecar import build as build_mod
from loader.lerobot.sidecar.schema import MANIFEST_MEMBER, SidecarWriter
from tests.support import lerobot_data as _lerobot_data
from tests.support.seaweedfs import upload_tree

# Fixtures from tests/support, bound here so this module works whether or not conftest lists them.

REPO = "pid-test/robot-arm"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def av1_root(lerobot_v3_root: Path, tmp_path: Path) -> Path:
    """A private copy of the AV1 dataset (tests change its files)."""
    return Path(shutil.copytree(lerobot_v3_root, tmp_path / "ds"))


def build(root: Path | str, out: Path, **kw) -> SidecarManifest:
    meta = LeRobotMeta.load(str(root))
    kw.setdefault("repo_id", REPO)
    kw.setdefault("revision", REV)
    return build_sidecar(meta, out, data_root=str(root), **kw)


def npz_texts(path: Path) -> list[bytes]:
    """The NPZ's raw bytes and every member decompressed: where a secret could hide."""
    out = [path.read_bytes()]
    with zipfile.ZipFile(path) as zf:
        out += [zf.read(name) for name in zf.namelist()]
    return out


# -- build and round trip ---------------------------------------------------------------------

@pytest.mark.parametrize("dataset", ["lerobot_v3_root", "lerobot_v3_h264_root"])
def test_round_trip_equals_the_box_index(dataset: str, request, tmp_path: Path) -> None:
    root: Path = request.getfixturevalue(dataset)
    calls = []
    manifest = build(root, tmp_path / "sc.npz", workers=2,
                     progress=lambda done, total, rel, read: calls.append((done, total, rel)))
    meta = LeRobotMeta.load(str(root))
    assert manifest.paths == meta.video_files()
    assert [c[:2] for c in calls] == [(i + 1, len(manifest.files)) for i in range(len(manifest.files))]

    with read_sidecar(tmp_path / "sc.npz") as sc:
        assert sc.files == meta.video_files()
        m = sc.manifest
        assert m["schema_version"] == SIDECAR_SCHEMA_VERSION == 3
        assert (m["repo_id"], m["revision"], m["data_root"], m["subset"]) == (REPO, REV, str(root), False)
        assert "episodes" not in m and m["created_by"]
        for i, rel in enumerate(sc.files):
            idx = index_mp4(fs.url(str(root), rel))
            entry = m["files"][i]
            assert entry["id"] == str(i) and entry["path"] == rel
            ident = fs.file_identity(str(root), rel)
            assert (entry["size"], entry["fingerprint"], entry["stable"]) == (ident.size, ident.fingerprint, True)
            f = sc.file(rel)
            assert (f.ftyp, f.stsd, f.codec, f.width, f.height) == (idx.ftyp, idx.stsd, idx.codec, idx.width, idx.height)
            assert (f.timescale, f.track_id, f.edit) == (idx.timescale, idx.track_id, idx.edit)
            assert [list(x) for x in f.mdat] == [list(x) for x in idx.mdat]
            arrays = sc.arrays(rel)
            assert f.sample_count == len(arrays["sample_pts"]) == len(idx.sample_pts)
            for name in ARRAY_NAMES:
                want = np.float64 if name == "sample_pts" else np.int64
                assert arrays[name].dtype == want, name
                np.testing.assert_array_equal(arrays[name], getattr(idx, name), err_msg=name)
    # np.load reads it too: it is an ordinary NPZ (no pickles), in LeRobot's layout.
    with np.load(tmp_path / "sc.npz", allow_pickle=False) as z:
        assert "0/sample_sizes" in z.files and MANIFEST_MEMBER == "manifest_json" in z.files
        payload = json.loads(bytes(z[MANIFEST_MEMBER]).decode("utf-8"))
        assert payload["version"] == payload["sidecar"]["schema_version"] == 3


def test_h264_b_frames_keep_composition_offsets(lerobot_v3_h264_root: Path, tmp_path: Path) -> None:
    build(lerobot_v3_h264_root, tmp_path / "sc.npz")
    with read_sidecar(tmp_path / "sc.npz") as sc:
        f = sc.file(sc.files[0])
        a = sc.arrays(sc.files[0])
    assert f.codec == "avc1" and f.edit is not None and f.edit["media_time"] > 0
    assert len(np.unique(a["sample_composition_offsets"])) > 1      # real B-frames
    assert np.all(np.diff(a["sample_pts"]) != 0)


def test_same_input_gives_the_same_bytes_whatever_the_workers(av1_root: Path, tmp_path: Path) -> None:
    build(av1_root, tmp_path / "a.npz", workers=1)
    build(av1_root, tmp_path / "b.npz", workers=3)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()


def test_subset_sidecar(av1_root: Path, tmp_path: Path) -> None:
    manifest = build(av1_root, tmp_path / "sub.npz", episodes=[4, 3])
    assert manifest.subset and manifest.episodes == (3, 4)
    assert manifest.paths == sorted(
        f"videos/{cam}/chunk-000/file-001.mp4" for cam in _lerobot_data.CAMERAS)
    with read_sidecar(tmp_path / "sub.npz") as sc:
        assert sc.manifest["subset"] is True and sc.manifest["episodes"] == [3, 4]
    meta = LeRobotMeta.load(str(av1_root))
    assert validate_sidecar(tmp_path / "sub.npz", meta) == []
    assert any("subset" in p for p in validate_sidecar(tmp_path / "sub.npz", meta, require_complete=True))


def test_memory_holds_at_most_workers_indexes(lerobot_v3_h264_root: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each finished index goes to the archive before another file is started."""
    state = {"returned": 0, "written": 0, "max_unwritten": 0}
    real_index, real_add = build_mod.index_mp4, SidecarWriter.add

    def index(source, **kw):
        out = real_index(source, **kw)
        state["returned"] += 1
        state["max_unwritten"] = max(state["max_unwritten"], state["returned"] - state["written"])
        return out

    def add(self, fid, arrays):
        state["written"] += 1
        return real_add(self, fid, arrays)

    monkeypatch.setattr(build_mod, "index_mp4", index)
    monkeypatch.setattr(SidecarWriter, "add", add)
    manifest = build(lerobot_v3_h264_root, tmp_path / "sc.npz", workers=2)
    assert state["written"] == len(manifest.files) == 6
    assert 1 <= state["max_unwritten"] <= 2


def test_failed_build_keeps_the_previous_file(av1_root: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "sc.npz"
    build(av1_root, out)
    before = out.read_bytes()
    real = build_mod.index_mp4

    def failing(source, **kw):
        if "wrist/chunk-000/file-000" in source:
            raise OSError("simulated read failure")
        return real(source, **kw)

    monkeypatch.setattr(build_mod, "index_mp4", failing)
    with pytest.raises(SidecarBuildError, match=r"wrist/chunk-000/file-000\.mp4.*simulated read failure"):
        build(av1_root, out, workers=2)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "sc.npz"]   # no temp left
    assert validate_sidecar(out, LeRobotMeta.load(str(av1_root))) == []


# -- reading errors ---------------------------------------------------------------------------

def test_wrong_schema_version_and_missing_arrays_are_clear(av1_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "sc.npz"
    build(av1_root, out)
    with zipfile.ZipFile(out) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    payload = json.loads(np.lib.format.read_array(
        __import__("io").BytesIO(members[f"{MANIFEST_MEMBER}.npy"])).tobytes())

    def rewrite(path: Path, drop: str | None = None, version: int | None = None) -> Path:
        p = dict(payload, version=version or payload["version"])
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in members.items():
                if name == drop:
                    continue
                if name == f"{MANIFEST_MEMBER}.npy":
                    with zf.open(name, "w") as fh:
                        np.lib.format.write_array(fh, np.array(json.dumps(p).encode()))
                else:
                    zf.writestr(name, data)
        return path

    old = rewrite(tmp_path / "v2.npz", version=2)
    with pytest.raises(SidecarSchemaError, match="manifest_json has version 2.*reads version 3.*rebuild"):
        read_sidecar(old)
    gone = rewrite(tmp_path / "gone.npz", drop="1/sample_offsets.npy")
    with pytest.raises(SidecarSchemaError, match=r"missing \(1/sample_offsets\).*rebuild"):
        read_sidecar(gone)
    np.savez(tmp_path / "legacy.npz", sample_pts=np.zeros(3))   # no manifest: an older layout
    with pytest.raises(SidecarSchemaError, match="neither a manifest_json.*nor a __manifest__"):
        read_sidecar(tmp_path / "legacy.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(SidecarError, match="not a sidecar NPZ"):
        read_sidecar(tmp_path / "junk.npz")
    meta = LeRobotMeta.load(str(av1_root))
    assert any("version 2" in p for p in validate_sidecar(old, meta))
    assert validate_sidecar(tmp_path / "absent.npz", meta) == [f"{tmp_path / 'absent.npz'}: no sidecar file"]


def test_writer_rejects_inconsistent_arrays(tmp_path: Path) -> None:
    good = {n: np.arange(4) for n in ARRAY_NAMES} | {"sample_pts": np.arange(4) / 10}
    with open(tmp_path / "x.npz", "wb") as fh:
        w = SidecarWriter(fh)
        with pytest.raises(SidecarError, match="sample_sizes has 3 values for 4 samples"):
            w.add("f00000", good | {"sample_sizes": np.arange(3)})
        with pytest.raises(SidecarError, match="sync_samples must be strictly increasing"):
            w.add("f00000", good | {"sync_samples": np.array([0, 4])})
        with pytest.raises(SidecarError, match="dtype float64, expected int64"):
            w.add("f00000", good | {"sample_offsets": np.arange(4) * 1.5})
        w.abort()


# -- validation -------------------------------------------------------------------------------

def test_replaced_video_with_the_same_size_is_stale(av1_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "sc.npz"
    build(av1_root, out)
    meta = LeRobotMeta.load(str(av1_root))
    assert validate_sidecar(out, meta) == []
    rel = meta.video_files()[1]
    path = av1_root / rel
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])   # other media bytes, same size
    time.sleep(0.05)   # local identity uses file times: let the (coarse) kernel clock tick
    with open(path, "r+b") as fh:   # in place: same inode, and mtime put back as it was
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    problems = validate_sidecar(out, meta)
    assert len(problems) == 1 and f"{rel} was replaced" in problems[0]


def test_missing_extra_and_unstable_files(av1_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "sc.npz"
    build(av1_root, out)
    meta = LeRobotMeta.load(str(av1_root))
    with read_sidecar(out) as sc:
        info, arrays = sc.info, {rel: sc.arrays(rel) for rel in sc.files}
    first = info.files[0]
    bogus = type(first)(**{**first.__dict__, "id": "f09999", "path": "videos/other/chunk-000/file-000.mp4"})
    unstable = type(first)(**{**first.__dict__, "stable": False, "fingerprint": None})
    variants = {
        "missing": (info.files[1:], {}),
        "extra": ((*info.files, bogus), {bogus.path: arrays[first.path]}),
        "unstable": ((unstable, *info.files[1:]), {}),
    }
    found = {}
    for name, (files, more) in variants.items():
        m = SidecarManifest(repo_id=REPO, revision=REV, data_root=str(av1_root), files=tuple(files))
        write_sidecar(tmp_path / f"{name}.npz", m, {**arrays, **more})
        found[name] = validate_sidecar(tmp_path / f"{name}.npz", meta)
    assert len(found["missing"]) == 1 and f"not indexed: {first.path}" in found["missing"][0]
    assert len(found["extra"]) == 1 and f"does not list: {bogus.path}" in found["extra"][0]
    assert len(found["unstable"]) == 1 and "no stable identity" in found["unstable"][0]
    assert validate_sidecar(tmp_path / "unstable.npz", meta, allow_unstable=True) == []
    assert validate_sidecar(out, meta, revision="other") == [f"{out}: built for revision {REV!r}, not 'other'"]


# -- credentials ------------------------------------------------------------------------------

def test_public_root_strips_credentials() -> None:
    assert public_root("https://user:pw@host:8443/ds?X-Amz-Signature=abc#frag") == "https://host:8443/ds"
    assert public_root("s3://bucket/prefix") == "s3://bucket/prefix"
    assert public_root("hf://datasets/o/n@rev") == "hf://datasets/o/n@rev"
    assert public_root("/data/ds") == "/data/ds"
    with pytest.raises(ValueError, match="credentials"):
        SidecarManifest(repo_id=REPO, revision=None, data_root="http://u:p@h/x", files=())


def test_s3_root_on_seaweedfs_keeps_keys_out(lerobot_v3_root: Path, s3_env, tmp_path: Path) -> None:
    client = s3_env.client()
    bucket = s3_env.make_bucket("sidecar-creds")
    upload_tree(client, lerobot_v3_root, bucket, "robot/arm")
    root = f"s3://{bucket}/robot/arm"
    manifest = build(root, tmp_path / "sc.npz")
    assert manifest.data_root == root
    assert all(f.stable and f.fingerprint.startswith("s3:etag=") for f in manifest.files)
    for blob in npz_texts(tmp_path / "sc.npz"):
        assert s3_env.secret_key.encode() not in blob and s3_env.access_key.encode() not in blob
    meta = LeRobotMeta.load(root)
    assert validate_sidecar(tmp_path / "sc.npz", meta) == []
    # Replace one object with same-size, different bytes: its ETag changes.
    rel = manifest.paths[0]
    data = bytearray((lerobot_v3_root / rel).read_bytes())
    data[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=f"robot/arm/{rel}", Body=bytes(data))
    problems = validate_sidecar(tmp_path / "sc.npz", meta)
    assert len(problems) == 1 and f"{rel} was replaced" in problems[0]


def test_hf_root_with_a_token_keeps_the_token_out(lerobot_v3_root: Path, http_server, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    token = "hf_sidecar_secret_token_4711"
    tree = tmp_path / "hub"
    shutil.copytree(lerobot_v3_root, tree / "datasets" / REPO / "resolve" / REV)
    hub_standin = http_server(tree, require_bearer=token)   # STAND-IN for the Hub's resolve endpoint
    monkeypatch.setenv("HF_ENDPOINT", hub_standin.url)
    monkeypatch.setenv("HF_TOKEN", token)
    root = f"hf://datasets/{REPO}@{REV}"
    manifest = build(root, tmp_path / "sc.npz")
    assert manifest.data_root == root and all(f.stable for f in manifest.files)
    # The stand-in answers 401 without the token: every video HEAD and ranged GET carried it.
    assert not [r for r in hub_standin.requests if r.status in (401, 403)]
    assert {r.method for r in hub_standin.requests if "/videos/" in r.path} == {"HEAD", "GET"}
    for blob in npz_texts(tmp_path / "sc.npz"):
        assert token.encode() not in blob and hub_standin.url.encode() not in blob


def test_url_with_userinfo_is_refused_without_leaking(lerobot_v3_root: Path, http_server,
                                                      tmp_path: Path) -> None:
    server = http_server(lerobot_v3_root)
    secret = "pw-in-url-0815"
    root = server.url.replace("http://", f"http://user:{secret}@")
    meta = LeRobotMeta.load(server.url)
    with pytest.raises(ValueError) as exc:
        build_sidecar(meta, tmp_path / "sc.npz", repo_id=REPO, revision=REV, data_root=root)
    assert secret not in str(exc.value)
    assert not (tmp_path / "sc.npz").exists() and list(tmp_path.iterdir()) == []
