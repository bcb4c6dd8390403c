"""The sample reader (``loader/wds/twin_reader.py``): tars stay open from one batch of a shard to
the next, files stay bounded, skipped members are read by their headers only and still checked,
and the process's heap keeps what a batch frees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from loader.wds.epoch_plan import Task
from loader.wds.errors import ShardReadError
from loader.wds.expand import (
    ExpandOptions,
    ExpandStats,
    group_by_keys,
    process_sample,
    tar_file_expander,
    url_opener,
)
from loader.wds.pipeline import build_dataset
from loader.wds.twin_reader import KEEP_OPEN
from tests.support.loader_data import caption_bytes, jpeg_bytes, write_hand_shards

_OPENED: Counter | None = None


def _audit(event: str, args: tuple) -> None:
    # A real count of the files the process opens (sys.audit "open"), active only inside `opens`.
    if _OPENED is not None and event == "open" and isinstance(args[0], str) and args[0].endswith(".tar"):
        _OPENED[args[0]] += 1


sys.addaudithook(_audit)


class opens:  # noqa: N801 - used as a context manager, like a function
    """Counts the .tar files opened inside the block, by path."""

    def __enter__(self) -> Counter:
        global _OPENED
        _OPENED = Counter()
        return _OPENED

    def __exit__(self, *exc) -> None:
        global _OPENED
        _OPENED = None


def _open_tars() -> list[str]:
    fds = Path("/proc/self/fd")
    out = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.endswith(".tar"):
            out.append(target)
    return out


def _shards(root: Path, n_shards: int, per_shard: int, *, with_index: bool = True) -> Path:
    shards = []
    for s in range(n_shards):
        keys = [f"s{s}_k{i:03d}" for i in range(per_shard)]
        shards.append({
            "image": [(f"{k}.jpg", jpeg_bytes(s * per_shard + i)) for i, k in enumerate(keys)],
            "caption": [(f"{k}.json", caption_bytes(k)) for k in keys],
        })
    return write_hand_shards(root / "aspect_ratio_1_1", shards, with_index=with_index)


def _truth(manifest: Path) -> dict[str, dict[str, bytes]]:
    """Every member's bytes, read with tarfile: key -> {"image.jpg": ..., "caption.json": ...}."""
    out: dict[str, dict[str, bytes]] = {}
    for tar in sorted(manifest.parent.rglob("*.tar")):
        modality = tar.relative_to(manifest.parent).parts[0]
        with tarfile.open(tar) as tf:
            for info in tf:
                key, ext = info.name.split(".", 1)
                out.setdefault(key, {})[f"{modality}.{ext}"] = tf.extractfile(info).read()
    return out


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_consecutive_batches_of_a_shard_open_each_tar_once(tmp_path: Path, mode: str) -> None:
    manifest = _shards(tmp_path, 2, 30)
    ds = build_dataset(str(manifest), mode=mode, shuffle=False, decode=None, batch_size=4)
    with opens() as opened:
        blocks = list(ds.blocks())
    assert sum(len(b.slots) for b in blocks) == 60 and len(blocks) == 15  # batches cross shards
    assert len(opened) == 4 and set(opened.values()) == {1}, opened  # 2 shards x 2 modalities, once each
    assert not _open_tars()


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_a_shuffle_window_reads_exact_bytes_with_bounded_files(tmp_path: Path, mode: str) -> None:
    manifest = _shards(tmp_path, 9, 12)
    truth = _truth(manifest)
    ds = build_dataset(str(manifest), mode=mode, shuffle=True, shuffle_buffer=40, seed=3, decode=None, batch_size=5)
    most = 0
    for _ in ds.blocks():
        most = max(most, len(_open_tars()))
    assert 2 <= most <= KEEP_OPEN * 2  # KEEP_OPEN shards x 2 modalities at most
    assert not _open_tars()
    samples = list(build_dataset(str(manifest), mode=mode, shuffle=True, shuffle_buffer=40, seed=3, decode=None))
    assert sorted(s["__key__"] for s in samples) == sorted(truth)
    for s in samples:
        assert {f: s[f] for f in ("image.jpg", "caption.json")} == truth[s["__key__"]], s["__key__"]
    assert not _open_tars()


def test_a_tar_cut_inside_a_skipped_member_is_named(tmp_path: Path) -> None:
    manifest = _shards(tmp_path, 1, 6, with_index=False)  # no offsets: members 0-3 are skipped by header
    tar = manifest.parent / "image" / "part_000000" / "000000.tar"
    with tarfile.open(tar) as tf:
        offsets = sorted(m.offset_data + m.size // 2 for m in tf.getmembers())
    tar.write_bytes(tar.read_bytes()[: offsets[2]])  # inside member 2's data
    ds = build_dataset(str(manifest), shuffle=False, decode=None)
    reader = ds.reader()
    try:
        with pytest.raises(ShardReadError, match=rf"{tar}: unreadable tar \(it ends at byte {offsets[2]}, inside"):
            list(reader.samples(0, Task(0, ((4, 6),))))
    finally:
        reader.close()
    assert not _open_tars()


def test_the_webdataset_style_stages_give_the_datasets_samples(tmp_path: Path) -> None:
    manifest = _shards(tmp_path, 3, 7)
    ds = build_dataset(str(manifest), shuffle=False, decode=None)
    tasks = [(0, Task(i, ((0, 7),))) for i in range(3)]
    stats = ExpandStats()
    members = map(process_sample, tar_file_expander(url_opener(tasks, ds.shards), None, ExpandOptions(), stats))
    staged = [{k: v for k, v in s.items() if k != "__sid__"} for s in group_by_keys(members, stats)]
    direct = [{k: v for k, v in s.items() if k != "__sid__"} for s in ds]
    assert staged == direct and len(direct) == 21
    assert (stats.samples, stats.shards) == (21, 3)  # each counted once


_HEAP_PROBE = """
import gc, sys
from loader.io.heap import keep_heap_for_batches
applied = keep_heap_for_batches()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
batch = [b"x" * (300_000 + i) for i in range(100)]  # a batch of large members: 30 MB, touched
del batch
gc.collect()
print(applied, keep_heap_for_batches(), (rss() - before) // 2**20)
"""


def _probe(**env: str) -> tuple[str, str, int]:
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[1]).stdout.split()
    return out[0], out[1], int(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_heap_keeps_a_freed_batch_unless_told_otherwise() -> None:
    applied, again, kept_mb = _probe()
    assert (applied, again) == ("True", "True") and kept_mb >= 20  # ready for the next batch
    applied, _, kept_mb = _probe(PID_LOADER_HEAP="default")
    assert applied == "False" and kept_mb < 10  # glibc handed it back
    applied, _, _ = _probe(MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False"  # the user's own allocator settings win
