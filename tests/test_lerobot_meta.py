"""LeRobot v3 metadata and the file-system layer under it, over every kind of root.

Local folders, ``s3://`` on a real SeaweedFS server, ``http://`` on a real range-capable HTTP
server, and ``hf://datasets/<org>/<name>@<rev>`` against that HTTP server acting as a STAND-IN
for the Hub's ``resolve`` endpoint (``<endpoint>/datasets/<repo>/resolve/<rev>/<path>``); no
real Hub is reachable offline.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants  # noqa: F401  (see below)
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loader.io import roots as fs
from loader.lerobot.meta import (
    EpisodeInfo,
    LeRobotMeta,
    LeRobotMetaError,
    MetaFileMissingError,
    VideoSpan,
)
from tests.support.lerobot_data import CAMERAS, LEROBOT_V3_EPISODES, write_v3_dataset
from tests.support.seaweedfs import upload_to_new_bucket

# Fixtures from tests/support, bound here so this module works whether or not conftest lists them.

# huggingface_hub bakes HF_ENDPOINT into its URL template when first imported; importing it
# here, before any test sets HF_ENDPOINT, keeps a stand-in's address out of that global state.
FPS = 10
HF_REPO = "pid-test/robot-arm"
HF_REV = "0123456789abcdef0123456789abcdef01234567"  # a pinned commit
HF_TOKEN = "hf_standin_token_not_a_secret"
FRONT, WRIST = CAMERAS
STARTS = [sum(LEROBOT_V3_EPISODES[:e]) for e in range(len(LEROBOT_V3_EPISODES) + 1)]


def expected_episode(e: int) -> EpisodeInfo:
    """What the lerobot_v3_root fixture holds: 3 episodes per MP4, 2 per data file, 2 files per chunk."""
    first_in_file = 0 if e < 3 else 3
    t0 = (STARTS[e] - STARTS[first_in_file]) / FPS
    span = VideoSpan(chunk=0, file=e // 3, from_timestamp=t0, to_timestamp=t0 + LEROBOT_V3_EPISODES[e] / FPS)
    data_slot = [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0)][e]
    return EpisodeInfo(
        episode_index=e, length=LEROBOT_V3_EPISODES[e], dataset_from_index=STARTS[e],
        dataset_to_index=STARTS[e + 1], data_chunk=data_slot[0], data_file=data_slot[1],
        tasks=(("pick up the cube", "open the drawer")[e % 2],),
        videos={FRONT: span, WRIST: span},
    )


EXPECTED_VIDEO_FILES = sorted(f"videos/{cam}/chunk-000/file-00{f}.mp4" for cam in CAMERAS for f in (0, 1))
EXPECTED_EPISODE_FILES = ["meta/episodes/chunk-000/file-000.parquet",
                          "meta/episodes/chunk-000/file-001.parquet",
                          "meta/episodes/chunk-001/file-000.parquet"]


def assert_fixture_meta(meta: LeRobotMeta) -> None:
    assert meta.codebase_version == "v3.0" and meta.fps == FPS
    assert meta.video_keys == sorted(CAMERAS)
    assert meta.video_shape(FRONT) == (48, 64, 3)
    assert meta.data_path == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert meta.video_path == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert meta.tasks == {0: "pick up the cube", 1: "open the drawer"}
    assert meta.episode_files == EXPECTED_EPISODE_FILES
    assert meta.episode_indices.tolist() == [0, 1, 2, 3, 4] and len(meta) == 5
    for e in range(5):
        assert meta.episode(e) == expected_episode(e)
    assert meta.video_files() == EXPECTED_VIDEO_FILES
    assert meta.data_files() == ["data/chunk-000/file-000.parquet", "data/chunk-000/file-001.parquet",
                                 "data/chunk-001/file-000.parquet"]


# -- local ----------------------------------------------------------------------------------------

def test_local_root_reads_every_episode_file(lerobot_v3_root: Path) -> None:
    meta = LeRobotMeta.load(str(lerobot_v3_root))
    assert_fixture_meta(meta)
    assert meta.video_rel(WRIST, 0, 1) == f"videos/{WRIST}/chunk-000/file-001.mp4"
    assert meta.data_rel(1, 0) == "data/chunk-001/file-000.parquet"
    for rel in meta.video_files() + meta.data_files():
        assert (lerobot_v3_root / rel).is_file()
    # The per-episode stats columns are left out unless asked for.
    assert not any(c.startswith("stats/") for c in meta.episodes.column_names)
    with_stats = LeRobotMeta.load(lerobot_v3_root.as_uri(), with_stats=True)  # file:// too
    assert f"stats/{FRONT}/mean" in with_stats.episodes.column_names
    with pytest.raises(KeyError, match="no episode 9"):
        meta.episode(9)


def test_episode_spans_match_the_data_files(lerobot_v3_root: Path) -> None:
    """dataset_from/to_index, data/chunk_index and data/file_index point at the right rows."""
    meta = LeRobotMeta.load(str(lerobot_v3_root))
    for e in meta.episode_indices.tolist():
        ep = meta.episode(e)
        table = pq.read_table(lerobot_v3_root / meta.data_rel(ep.data_chunk, ep.data_file))
        rows = table.filter(pa.compute.equal(table["episode_index"], e))
        assert rows["index"].to_pylist() == list(range(ep.dataset_from_index, ep.dataset_to_index))
        assert {meta.tasks[i] for i in rows["task_index"].to_pylist()} == set(ep.tasks)
        assert [s[0] for s in rows["observation.state"].to_pylist()] == rows["index"].to_pylist()


def test_legacy_task_index_column(lerobot_v3_h264_root: Path) -> None:
    assert "__index_level_0__" in pq.read_schema(lerobot_v3_h264_root / "meta/tasks.parquet").names
    meta = LeRobotMeta.load(str(lerobot_v3_h264_root))
    assert meta.tasks == {0: "pick up the cube", 1: "open the drawer"}
    # One episode per MP4: three files per camera, each episode from 0.
    assert meta.video_files() == sorted(f"videos/{c}/chunk-000/file-00{i}.mp4" for c in CAMERAS for i in range(3))
    assert {meta.episode(e).videos[FRONT].from_timestamp for e in range(3)} == {0.0}


# -- malformed datasets: errors name the file and say what to do -----------------------------------

@pytest.fixture
def dataset_copy(tmp_path: Path, lerobot_v3_root: Path) -> Path:
    dst = tmp_path / "ds"
    shutil.copytree(lerobot_v3_root / "meta", dst / "meta")
    return dst


def edit_info(root: Path, **changes: object) -> None:
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))


def test_wrong_codebase_version(dataset_copy: Path) -> None:
    edit_info(dataset_copy, codebase_version="v2.1")
    with pytest.raises(LeRobotMetaError, match=r"info\.json: codebase_version 'v2\.1'.*v3.*convert") as exc:
        LeRobotMeta.load(str(dataset_copy))
    assert str(dataset_copy / "meta/info.json") in str(exc.value)
    edit_info(dataset_copy, codebase_version="v3.1")  # a later v3 minor is still read
    assert LeRobotMeta.load(str(dataset_copy)).codebase_version == "v3.1"


def test_v2_template_and_bad_video_shape(dataset_copy: Path) -> None:
    edit_info(dataset_copy, data_path="data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet")
    with pytest.raises(LeRobotMetaError, match="data_path template .* v2-style"):
        LeRobotMeta.load(str(dataset_copy))
    edit_info(dataset_copy, data_path="data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
              video_path="../{video_key}/{chunk_index}/{file_index}.mp4")
    with pytest.raises(LeRobotMetaError, match="video_path template"):
        LeRobotMeta.load(str(dataset_copy))
    info = json.loads((dataset_copy / "meta/info.json").read_text())
    info["video_path"] = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    info["features"][FRONT]["shape"] = [48, 64]
    (dataset_copy / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(LeRobotMetaError, match="expected \\(height, width, channels\\)"):
        LeRobotMeta.load(str(dataset_copy))


def test_missing_files_are_named(dataset_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(MetaFileMissingError, match="meta/info.json: not found. Is .* the root") as exc:
        LeRobotMeta.load(str(tmp_path / "nowhere"))
    assert isinstance(exc.value, FileNotFoundError)
    (dataset_copy / "meta/tasks.parquet").unlink()
    with pytest.raises(MetaFileMissingError, match="tasks.parquet: not found"):
        LeRobotMeta.load(str(dataset_copy))
    shutil.rmtree(dataset_copy / "meta/episodes")
    pq.write_table(pa.table({"task_index": [0], "task": ["t"]}), dataset_copy / "meta/tasks.parquet")
    with pytest.raises(MetaFileMissingError, match="meta/episodes/: no chunk-XXX/file-YYY.parquet"):
        LeRobotMeta.load(str(dataset_copy))


def test_bad_episode_and_task_files(dataset_copy: Path) -> None:
    bad = dataset_copy / "meta/episodes/chunk-000/file-001.parquet"
    table = pq.read_table(bad)
    pq.write_table(table.drop_columns([f"videos/{WRIST}/from_timestamp"]), bad)
    with pytest.raises(LeRobotMetaError, match=f"chunk-000/file-001.parquet: missing episode columns .*{WRIST}"):
        LeRobotMeta.load(str(dataset_copy))
    pq.write_table(table, bad)
    # A stale copy of an episode in a second file would make the index ambiguous.
    pq.write_table(table, dataset_copy / "meta/episodes/chunk-001/file-001.parquet")
    with pytest.raises(LeRobotMetaError, match=r"episode_index \[2, 3\] appear in more than one row"):
        LeRobotMeta.load(str(dataset_copy))
    (dataset_copy / "meta/episodes/chunk-001/file-001.parquet").unlink()
    pq.write_table(pa.table({"task_index": [0], "name": ["t"]}), dataset_copy / "meta/tasks.parquet")
    with pytest.raises(LeRobotMetaError, match="tasks.parquet: expected columns 'task_index' and 'task'"):
        LeRobotMeta.load(str(dataset_copy))
    (dataset_copy / "meta/info.json").write_text("{not json")
    with pytest.raises(LeRobotMetaError, match="info.json: not valid JSON"):
        LeRobotMeta.load(str(dataset_copy))


def test_episode_files_with_mixed_widths_are_unified(dataset_copy: Path) -> None:
    """An older writer's float32 timestamps next to float64 ones still load as one table."""
    path = dataset_copy / "meta/episodes/chunk-001/file-000.parquet"
    table = pq.read_table(path)
    for name in (f"videos/{FRONT}/from_timestamp", f"videos/{FRONT}/to_timestamp"):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, table.column(name).cast(pa.float32()))
    pq.write_table(table, path)
    meta = LeRobotMeta.load(str(dataset_copy))
    assert meta.episode(4).videos[FRONT].to_timestamp == pytest.approx(expected_episode(4).videos[FRONT].to_timestamp)


# -- fs: paths, identities, listings ---------------------------------------------------------------

def test_paths_stay_inside_the_root(tmp_path: Path) -> None:
    for rel in ("../x", "a/../b", "/etc/passwd", "a//b", "a\\b", ""):
        with pytest.raises(ValueError, match="bad path inside a dataset root"):
            fs.url(str(tmp_path), rel)
    for root in ("https://user:pw@host/ds", "http://host/ds?sig=secret", "s3://bucket/ds?x=1"):
        with pytest.raises(ValueError, match="credentials") as exc:
            fs.url(root, "meta/info.json")
        assert "pw" not in str(exc.value) and "secret" not in str(exc.value)
    with pytest.raises(ValueError, match="unsupported dataset root"):
        fs.url("ftp://host/ds", "a")
    assert fs.url("s3://b/p/", "meta/info.json") == "s3://b/p/meta/info.json"
    assert fs.url("hf://datasets/o/n@rev", "meta/info.json") == "hf://datasets/o/n@rev/meta/info.json"


def test_local_identity_sees_a_same_size_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "v.mp4"
    path.write_bytes(b"A" * 1000)
    before = fs.file_identity(str(tmp_path), "v.mp4")
    assert before.size == 1000 and before.stable and before.fingerprint.startswith("local:")
    assert fs.file_identity(str(tmp_path), "v.mp4") == before
    st = path.stat()
    time.sleep(0.02)  # past the kernel's coarse timestamp tick
    with open(path, "r+b") as f:  # in place: same inode, same size, different bytes
        f.write(b"B" * 1000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with mtime put back...
    after = fs.file_identity(str(tmp_path), "v.mp4")
    assert after.size == before.size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert after != before  # ...ctime moved
    # An atomic replace (new inode) changes it too.
    (tmp_path / "tmp").write_bytes(b"C" * 1000)
    os.replace(tmp_path / "tmp", path)
    assert fs.file_identity(str(tmp_path), "v.mp4") not in (before, after)
    with pytest.raises(FileNotFoundError):
        fs.file_identity(str(tmp_path), "missing.mp4")
    assert fs.exists(str(tmp_path), "v.mp4") and not fs.exists(str(tmp_path), "missing.mp4")
    assert fs.list_dir(str(tmp_path)) == ["v.mp4"] and fs.list_dir(str(tmp_path), "nope") == []


# -- s3:// on a real SeaweedFS server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_dataset(seaweedfs, lerobot_v3_root: Path) -> str:
    return upload_to_new_bucket(seaweedfs, lerobot_v3_root, "lerobot-meta", "datasets/arm")


def test_s3_root(s3_env, s3_dataset: str, lerobot_v3_root: Path) -> None:
    meta = LeRobotMeta.load(s3_dataset)
    assert_fixture_meta(meta)
    assert meta.episodes.equals(LeRobotMeta.load(str(lerobot_v3_root)).episodes)
    assert fs.list_dir(s3_dataset, "meta/episodes") == ["chunk-000", "chunk-001"]
    assert fs.list_dir(s3_dataset, "meta") == fs.list_dir(str(lerobot_v3_root), "meta")
    assert fs.list_dir(s3_dataset, "nope") == []
    rel = meta.video_files()[0]
    assert fs.read_bytes(s3_dataset, rel) == (lerobot_v3_root / rel).read_bytes()
    ident = fs.file_identity(s3_dataset, rel)
    assert ident.size == (lerobot_v3_root / rel).stat().st_size and ident.stable
    assert ident.fingerprint.startswith('s3:etag="')
    assert fs.exists(s3_dataset, rel) and not fs.exists(s3_dataset, "videos/none.mp4")
    with pytest.raises(FileNotFoundError, match="none.mp4"):
        fs.file_identity(s3_dataset, "videos/none.mp4")
    for text in (ident.fingerprint, fs.url(s3_dataset, rel)):
        assert s3_env.secret_key not in text and s3_env.access_key not in text


def test_s3_identity_sees_a_same_size_replacement(s3_env) -> None:
    client = s3_env.client()
    bucket = s3_env.make_bucket("lerobot-replace")
    client.put_object(Bucket=bucket, Key="ds/v.mp4", Body=b"A" * 4096)
    before = fs.file_identity(f"s3://{bucket}/ds", "v.mp4")
    client.put_object(Bucket=bucket, Key="ds/v.mp4", Body=b"B" * 4096)
    after = fs.file_identity(f"s3://{bucket}/ds", "v.mp4")
    assert before.size == after.size == 4096 and before.fingerprint != after.fingerprint
    # A versioned bucket adds the VersionId, so even a byte-identical re-upload is a new identity.
    versioned = s3_env.make_bucket("lerobot-versioned")
    client.put_bucket_versioning(Bucket=versioned, VersioningConfiguration={"Status": "Enabled"})
    client.put_object(Bucket=versioned, Key="v.mp4", Body=b"A" * 4096)
    v1 = fs.file_identity(f"s3://{versioned}", "v.mp4")
    client.put_object(Bucket=versioned, Key="v.mp4", Body=b"A" * 4096)
    v2 = fs.file_identity(f"s3://{versioned}", "v.mp4")
    assert ";version=" in v1.fingerprint and v1 != v2


# -- http(s):// -------------------------------------------------------------------------------------

def test_http_root_probes_episode_files_in_order(lerobot_v3_root: Path, http_server) -> None:
    server = http_server(lerobot_v3_root)
    meta = LeRobotMeta.load(server.url + "/")
    assert_fixture_meta(meta)
    # No listing over plain HTTP: files are probed in LeRobot's writing order until one is missing.
    probed = [r.path for r in server.gets() if r.path.startswith("meta/episodes/")]
    assert probed == EXPECTED_EPISODE_FILES[:2] + ["meta/episodes/chunk-000/file-002.parquet"] + \
        EXPECTED_EPISODE_FILES[2:] + ["meta/episodes/chunk-001/file-001.parquet",
                                      "meta/episodes/chunk-002/file-000.parquet"]
    with pytest.raises(NotImplementedError):
        fs.list_dir(server.url, "meta")
    rel = meta.video_files()[0]
    ident = fs.file_identity(server.url, rel)
    assert ident.stable and ident.fingerprint.startswith('etag:"')
    assert ident.size == (lerobot_v3_root / rel).stat().st_size
    assert not any(r.method == "GET" and r.path == rel for r in server.requests)  # a HEAD, no body
    assert not fs.exists(server.url, "videos/none.mp4")


def test_http_identity_changes_with_content(tmp_path: Path, http_server) -> None:
    (tmp_path / "v.mp4").write_bytes(b"A" * 1000)
    server = http_server(tmp_path)
    before = fs.file_identity(server.url, "v.mp4")
    (tmp_path / "v.mp4").write_bytes(b"B" * 1000)
    assert fs.file_identity(server.url, "v.mp4") != before


@pytest.fixture
def plain_http(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The standard library's file server: no ETag, so no stable identity."""
    folder = tmp_path / "plain"
    folder.mkdir()
    handler = functools.partial(_QuietFiles, directory=str(folder))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", folder
    httpd.shutdown()
    httpd.server_close()


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_http_without_etag_is_not_stable(plain_http: tuple[str, Path]) -> None:
    url, folder = plain_http
    (folder / "v.mp4").write_bytes(b"A" * 777)
    ident = fs.file_identity(url, "v.mp4")
    assert ident == fs.FileIdentity(size=777, fingerprint=None, stable=False)


# -- hf:// against a STAND-IN for the Hub's resolve endpoint -----------------------------------------

@pytest.fixture
def hub_resolve_tree(tmp_path: Path, lerobot_v3_root: Path) -> Path:
    """``<tree>/datasets/<repo>/resolve/<rev>/...``: the path form of the Hub's resolve URLs."""
    tree = tmp_path / "hub"
    shutil.copytree(lerobot_v3_root, tree / "datasets" / HF_REPO / "resolve" / HF_REV)
    return tree


def test_hf_root_against_a_resolve_standin(hub_resolve_tree: Path, http_server,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    hub_standin = http_server(hub_resolve_tree, require_bearer=HF_TOKEN)  # STAND-IN, not the Hub
    monkeypatch.setenv("HF_ENDPOINT", hub_standin.url)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    root = f"hf://datasets/{HF_REPO}@{HF_REV}"
    meta = LeRobotMeta.load(root)
    assert_fixture_meta(meta)
    assert {r.path.split("/resolve/")[0] for r in hub_standin.requests} == {f"datasets/{HF_REPO}"}
    assert all(f"/resolve/{HF_REV}/" in r.path for r in hub_standin.requests)
    rel = meta.video_files()[-1]
    ident = fs.file_identity(root, rel)
    assert ident.stable and ident.size == (hub_resolve_tree / "datasets" / HF_REPO / "resolve" / HF_REV / rel).stat().st_size
    assert HF_TOKEN not in repr(ident) and HF_TOKEN not in fs.url(root, rel)
    with pytest.raises(NotImplementedError):
        fs.list_dir(root, "meta")
    # Same size, different bytes at the same path: a new identity.
    path = hub_resolve_tree / "datasets" / HF_REPO / "resolve" / HF_REV / rel
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert fs.file_identity(root, rel).fingerprint != ident.fingerprint
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token")
    with pytest.raises(PermissionError, match=f"hf://datasets/{HF_REPO}@{HF_REV}/meta/info.json") as exc:
        fs.file_identity(root, "meta/info.json")
    assert "hf_wrong_token" not in str(exc.value)


def test_hf_branch_is_pinned_to_one_commit(hub_standin, lerobot_v3_root: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the Hub STAND-IN of tests/support/hub_standin.py (it names X-Repo-Commit)."""
    import huggingface_hub.constants as hf_constants

    # The fixture patches constants.ENDPOINT but not the URL template built from it at import;
    # hf_hub_url(endpoint=...) then no longer recognises the default prefix and keeps
    # huggingface.co. Keep the two consistent here.
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub_standin.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    files = {p.relative_to(lerobot_v3_root).as_posix(): p.read_bytes()
             for p in sorted(lerobot_v3_root.rglob("*")) if p.is_file()}
    first = hub_standin.add_dataset(HF_REPO, files)
    meta = LeRobotMeta.load(f"hf://datasets/{HF_REPO}", pin_revision=True)
    assert meta.root == f"hf://datasets/{HF_REPO}@{first}" and meta.revision == first
    assert_fixture_meta(meta)
    rel = meta.video_files()[0]
    pinned = fs.file_identity(meta.root, rel)
    # The branch moves on: the same video path, same size, other bytes.
    changed = bytearray(files[rel])
    changed[-1] ^= 0xFF
    hub_standin.commit_files(HF_REPO, "main", {rel: bytes(changed)}, "re-encode")
    assert fs.file_identity(meta.root, rel) == pinned
    assert fs.read_bytes(meta.root, rel) == files[rel]
    moved = fs.file_identity(f"hf://datasets/{HF_REPO}@main", rel)
    assert moved.size == pinned.size and moved.fingerprint != pinned.fingerprint
    assert fs.pin_revision(meta.root) == meta.root  # a commit stays as it is
    assert fs.pin_revision("s3://b/p") == "s3://b/p"


class _LfsResolve(BaseHTTPRequestHandler):
    """STAND-IN for the Hub answering resolve for an LFS file: 302 to a CDN, with X-Linked-*."""

    cdn: str = ""
    seen: list[dict[str, str]] = []

    def do_HEAD(self) -> None:
        self._redirect()

    def do_GET(self) -> None:
        self._redirect()

    def _redirect(self) -> None:
        type(self).seen.append(dict(self.headers.items()))
        rel = self.path.split("/resolve/", 1)[1].split("/", 1)[1]
        self.send_response(302)
        self.send_header("Location", f"{self.cdn}/{rel}")
        self.send_header("X-Linked-Etag", '"sha256-of-the-lfs-object"')
        self.send_header("X-Linked-Size", "1234")
        self.send_header("ETag", '"git-pointer-etag"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_hf_lfs_identity_from_the_redirect(tmp_path: Path, http_server, monkeypatch) -> None:
    (tmp_path / "v.mp4").write_bytes(b"L" * 1234)
    cdn = http_server(tmp_path)
    handler = type("Handler", (_LfsResolve,), {"cdn": cdn.url, "seen": []})
    hub = ThreadingHTTPServer(("localhost", 0), handler)
    threading.Thread(target=hub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://localhost:{hub.server_address[1]}")
        monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
        root = f"hf://datasets/{HF_REPO}@{HF_REV}"
        ident = fs.file_identity(root, "v.mp4")
        assert ident == fs.FileIdentity(size=1234, fingerprint='etag:"sha256-of-the-lfs-object"', stable=True)
        assert cdn.requests == []  # the redirect's X-Linked-* headers were enough
        assert fs.read_bytes(root, "v.mp4") == b"L" * 1234  # bytes come from the CDN
        assert handler.seen[0].get("Authorization") == f"Bearer {HF_TOKEN}"
        assert all("Authorization" not in r.headers for r in cdn.requests)  # not sent to another host
    finally:
        hub.shutdown()
        hub.server_close()


def test_writer_options_roundtrip(tmp_path: Path) -> None:
    """Many small files: 1 episode per meta file, 2 files per chunk -> chunks 0..2 all read."""
    root = write_v3_dataset(tmp_path / "ds", cameras=(FRONT,), episodes_per_file=2,
                            episode_lengths=[3, 4, 5, 3, 4], files_per_chunk=2, meta_episodes_per_file=1,
                            data_episodes_per_file=5)
    meta = LeRobotMeta.load(str(root))
    assert meta.episode_files == [f"meta/episodes/chunk-00{c}/file-00{f}.parquet"
                                  for c, f in ((0, 0), (0, 1), (1, 0), (1, 1), (2, 0))]
    assert meta.video_files() == [f"videos/{FRONT}/chunk-000/file-000.mp4", f"videos/{FRONT}/chunk-000/file-001.mp4",
                                  f"videos/{FRONT}/chunk-001/file-000.mp4"]
    assert meta.episode(4).videos[FRONT] == VideoSpan(chunk=1, file=0, from_timestamp=0.0, to_timestamp=0.4)
    assert meta.data_files() == ["data/chunk-000/file-000.parquet"]
    assert pq.ParquetFile(root / "data/chunk-000/file-000.parquet").metadata.num_row_groups == 5
