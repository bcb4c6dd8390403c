"""ensure_sidecar: cache, published sidecar, locked local build; races, timeouts and kills with
real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from loader.io import roots as fs
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import (
    SidecarLockTimeout,
    build_sidecar,
    ensure_sidecar,
    read_sidecar,
    sidecar_cache_path,
    validate_sidecar,
)
from loader.lerobot.sidecar import ensure as ensure_mod
from loader.lerobot.sidecar.ensure import lock_path
from loader.lerobot.sidecar.process_lock import process_lock
from loader.lerobot.sidecar.schema import LEGACY_MANIFEST_MEMBER

REPO = "pid-test/robot-arm"
REV = "0123456789abcdef0123456789abcdef01234567"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ds(lerobot_v3_root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(lerobot_v3_root, tmp_path / "ds"))


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every local build ensure_sidecar starts, in this process."""
    seen: list[Path] = []
    real = ensure_mod.build_sidecar

    def counting(meta, output, **kw):
        seen.append(Path(output))
        return real(meta, output, **kw)

    monkeypatch.setattr(ensure_mod, "build_sidecar", counting)
    return seen


def ensure(root: Path, cache: Path, **kw) -> Path:
    return ensure_sidecar(LeRobotMeta.load(str(root)), repo_id=REPO, revision=REV, cache_root=cache, **kw)


def touch_later(path: Path) -> None:
    """Give ``path`` a new identity (mtime/ctime) without changing its bytes."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


# -- the three sources, in order ---------------------------------------------------------------

def test_builds_once_then_reuses_then_rebuilds_a_replaced_video(ds: Path, tmp_path: Path,
                                                                builds: list[Path]) -> None:
    cache = tmp_path / "cache"
    path = ensure(ds, cache)
    assert path == sidecar_cache_path(cache, repo_id=REPO, revision=REV, data_root=str(ds))
    assert path.name == "mp4-sidecar.v3.npz" and len(builds) == 1
    assert ensure(ds, cache) == path and len(builds) == 1          # cache hit
    rel = LeRobotMeta.load(str(ds)).video_files()[0]
    data = bytearray((ds / rel).read_bytes())
    data[-4:] = b"\0\1\2\3"
    time.sleep(0.05)   # local identity uses file times: let the (coarse) kernel clock tick
    (ds / rel).write_bytes(bytes(data))                              # same size, other bytes
    assert ensure(ds, cache) == path and len(builds) == 2
    assert validate_sidecar(path, LeRobotMeta.load(str(ds))) == []


def test_published_sidecar_is_installed_instead_of_building(ds: Path, tmp_path: Path,
                                                            builds: list[Path]) -> None:
    meta = LeRobotMeta.load(str(ds))
    pub = tmp_path / "published.npz"
    build_sidecar(meta, pub, repo_id=REPO, revision=REV, data_root=str(ds))
    asked = []
    path = ensure(ds, tmp_path / "cache", published=lambda: asked.append(1) or pub)
    assert builds == [] and asked == [1]
    assert path.read_bytes() == pub.read_bytes() and path != pub


@pytest.mark.parametrize("bad", ["other-revision", "subset", "none"])
def test_unusable_published_sidecar_means_a_local_build(bad: str, ds: Path, tmp_path: Path,
                                                        builds: list[Path]) -> None:
    meta = LeRobotMeta.load(str(ds))
    pub = tmp_path / "published.npz"
    if bad == "other-revision":
        build_sidecar(meta, pub, repo_id=REPO, revision="f" * 40, data_root=str(ds))
    elif bad == "subset":
        build_sidecar(meta, pub, repo_id=REPO, revision=REV, data_root=str(ds), episodes=[0])
    path = ensure(ds, tmp_path / "cache", published=lambda: None if bad == "none" else pub)
    assert len(builds) == 1
    with read_sidecar(path) as sc:
        assert sc.manifest["revision"] == REV and sc.manifest["subset"] is False


def test_old_schema_cache_entry_is_rebuilt(ds: Path, tmp_path: Path, builds: list[Path]) -> None:
    cache = tmp_path / "cache"
    entry = sidecar_cache_path(cache, repo_id=REPO, revision=REV, data_root=str(ds))
    entry.parent.mkdir(parents=True)
    manifest = b'{"schema_version": 2, "files": []}'
    np.savez(entry.with_suffix(""), **{LEGACY_MANIFEST_MEMBER: np.frombuffer(manifest, np.uint8)})
    assert entry.exists()
    assert ensure(ds, cache) == entry and len(builds) == 1
    with read_sidecar(entry) as sc:
        assert sc.manifest["schema_version"] == 3


def test_unstable_identities_rebuild_on_each_open(ds: Path, tmp_path: Path, builds: list[Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = fs.file_identity

    def unstable(root, rel, **kw):
        return fs.FileIdentity(size=real(root, rel, **kw).size, fingerprint=None, stable=False)

    monkeypatch.setattr(fs, "file_identity", unstable)
    monkeypatch.setattr(fs, "file_identities",
                        lambda root, rels, **kw: {r: unstable(root, r) for r in rels})
    cache = tmp_path / "cache"
    ensure(ds, cache)
    ensure(ds, cache)
    assert len(builds) == 2


# -- real processes: race, timeout, kill -------------------------------------------------------

def _ensure_in_process(root: str, cache: str, counter: str, barrier, queue) -> None:
    from loader.lerobot.sidecar import ensure as ensure_mod

    real = ensure_mod.build_sidecar

    def slow_counting_build(meta, output, **kw):
        with open(counter, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(0.5)   # the other process arrives while this one holds the lock
        return real(meta, output, **kw)

    ensure_mod.build_sidecar = slow_counting_build
    meta = LeRobotMeta.load(root)
    barrier.wait()
    path = ensure_mod.ensure_sidecar(meta, repo_id=REPO, revision=REV, cache_root=cache,
                                     lock_timeout_s=60)
    queue.put((os.getpid(), str(path)))


def test_two_processes_racing_build_once(ds: Path, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    counter = tmp_path / "builds.txt"
    procs = [ctx.Process(target=_ensure_in_process,
                         args=(str(ds), str(tmp_path / "cache"), str(counter), barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len({path for _, path in results}) == 1
    assert len(counter.read_text().split()) == 1          # one built, the other waited and reused
    assert validate_sidecar(results[0][1], LeRobotMeta.load(str(ds))) == []


def _hold_lock(path: str, held, release) -> None:
    with process_lock(path, timeout_s=5, purpose="build the MP4 sidecar of a test"):
        held.set()
        release.wait(60)


def test_lock_timeout_is_a_clear_error(ds: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    lock = lock_path(sidecar_cache_path(cache, repo_id=REPO, revision=REV, data_root=str(ds)))
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(lock), held, release))
    holder.start()
    try:
        assert held.wait(30)
        t0 = time.monotonic()
        with pytest.raises(SidecarLockTimeout) as exc:
            ensure(ds, cache, lock_timeout_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 5
    finally:
        release.set()
        holder.join(timeout=30)
    msg = str(exc.value)
    assert f"pid {holder.pid}" in msg and str(lock) in msg
    assert "Another process may still be indexing the same revision" in msg
    assert f"ps -p {holder.pid}" in msg and f"remove {lock}" in msg
    assert "streaming_sidecar_lock_timeout_s" in msg
    assert not lock.with_name(lock.name.removesuffix(".lock")).exists()   # nothing installed


_SLOW_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from loader.lerobot.meta import LeRobotMeta
    from loader.lerobot.sidecar import build as build_mod, build_sidecar, ensure_sidecar

    mode, root, target, marker = sys.argv[1:5]
    real = build_mod.index_mp4
    def slow(source, **kw):
        Path(marker).touch()      # the build has started: the parent may kill us now
        time.sleep(0.3)
        return real(source, **kw)
    build_mod.index_mp4 = slow
    meta = LeRobotMeta.load(root)
    if mode == "build":
        build_sidecar(meta, target, repo_id="pid-test/robot-arm", revision="r", data_root=root)
    else:
        ensure_sidecar(meta, repo_id="pid-test/robot-arm", revision=%r, cache_root=target)
    print("finished")
""") % REV


def _start_and_kill(args: list[str], marker: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _SLOW_CHILD, *args, str(marker)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert child.poll() is None, child.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.4)   # a file or two into the temporary archive
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert b"finished" not in child.stdout.read()
    return child.pid


def test_killed_build_leaves_the_previous_file_valid(ds: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "sidecar.npz"
    meta = LeRobotMeta.load(str(ds))
    build_sidecar(meta, out, repo_id=REPO, revision="r", data_root=str(ds))
    before = out.read_bytes()
    pid = _start_and_kill(["build", str(ds), str(out)], tmp_path / "started")
    assert out.read_bytes() == before
    assert validate_sidecar(out, meta) == []
    assert [p.name for p in out.parent.iterdir() if p != out] == [f"sidecar.npz.tmp-{pid}"]


def test_killed_ensure_releases_the_lock_and_keeps_the_cache_entry(ds: Path, tmp_path: Path,
                                                                   builds: list[Path]) -> None:
    cache = tmp_path / "cache"
    entry = ensure(ds, cache)
    before = entry.read_bytes()
    touch_later(ds / LeRobotMeta.load(str(ds)).video_files()[0])   # stale: a rebuild is due
    pid = _start_and_kill(["ensure", str(ds), str(cache)], tmp_path / "started")
    assert entry.read_bytes() == before
    with read_sidecar(entry) as sc:                      # still a whole, readable sidecar
        assert all(len(sc.arrays(rel)["sample_pts"]) for rel in sc.files)
    leftover = entry.with_name(f"{entry.name}.tmp-{pid}")
    assert leftover.exists()
    t0 = time.monotonic()
    assert ensure(ds, cache, lock_timeout_s=5) == entry      # the kernel released the dead lock
    assert time.monotonic() - t0 < 5 and len(builds) == 2
    assert not leftover.exists()
    assert validate_sidecar(entry, LeRobotMeta.load(str(ds))) == []
