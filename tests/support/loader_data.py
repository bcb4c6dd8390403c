"""Data for the loader tests: twin tars built by the real build side, and hand-written tars.

* :func:`build_photos` runs ``build_source`` over a copy of the session's raw photo drop (32 real
  photographs in 8 aspect buckets, modalities ``caption``, ``image``, ``umt5``), optionally
  without some samples (29 samples make padding visible for 2 and 4 ranks), and writes
  ``catalog.json``. :func:`shared_build` memoises it per session, so several test modules
  share one build per parameter set (read-only use).
* :func:`write_hand_shards` writes twin tars member by member (wrong keys, short tars,
  duplicates, multi-dot names...), with a real key index and ``wdinfo.json`` from
  ``loader.formats``: the bad inputs that the build side never writes.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from loader.formats.key_index import KeyIndexRow, key_index_table, write_key_index
from loader.formats.twin_tar import key_index_relpath
from loader.formats.wdinfo import TarEntry, WdinfoManifest, write_wdinfo
from loader.wds.consumed import make_sid

SOURCE = "photos"
# Three samples (of three different buckets) left out: 29 samples, odd, so both 2 and 4 ranks pad.
DROP_FOR_29 = ("astronaut-21x9", "chelsea-1x1", "rocket-9x16")
_BUILDS: dict[tuple, Path] = {}


def build_photos(raw_template: Path, out_root: Path, *, shard_size: int = 3, drop: Iterable[str] = (),
                 source: str = SOURCE) -> Path:
    """Build ``source`` from a private copy of ``raw_template`` into ``out_root/<source>``
    (minus the samples whose stem is in ``drop``) and write ``out_root/catalog.json``."""
    from pid_platform.sharding.catalog import build_catalog
    from pid_platform.sharding.pipeline import build_source
    from pid_platform.sharding.plan.shard_plan import ShardingConfig
    from pid_platform.sharding.storage import open_source_store

    raw = raw_root_of(out_root)
    shutil.copytree(raw_template / SOURCE, raw / source)
    drop = set(drop)
    for f in sorted((raw / source).rglob("*")):
        if f.is_file() and f.stem in drop:
            f.unlink()
    build_source(open_source_store(str(raw)), source, out_root / source,
                 ShardingConfig(shard_size=shard_size), num_workers=1)
    build_catalog(out_root)
    return out_root


def raw_root_of(out_root: Path) -> Path:
    """The raw root :func:`build_photos` built ``out_root`` from (``<raw>/<source>/<modality>/``)."""
    return out_root.parent / f"{out_root.name}-raw"


def shared_build(tmp_path_factory: pytest.TempPathFactory, raw_template: Path, *, shard_size: int = 3,
                 drop: Sequence[str] = ()) -> Path:
    """One build per (shard_size, drop) per session; callers must not modify it."""
    key = (shard_size, tuple(drop))
    if key not in _BUILDS:
        out = tmp_path_factory.mktemp(f"built-size{shard_size}-drop{len(drop)}-")
        _BUILDS[key] = build_photos(raw_template, out, shard_size=shard_size, drop=drop)
    return _BUILDS[key]


def all_sids(counts: Sequence[int] | np.ndarray) -> set[int]:
    """Every sample id of a shard table with these per-shard counts."""
    return {make_sid(s, m) for s, n in enumerate(np.asarray(counts).tolist()) for m in range(n)}


def raw_file(out_root: Path, modality: str, key: str, source: str = SOURCE) -> Path:
    """The raw file a sample of a :func:`build_photos` build came from (keys are raw stems)."""
    hits = sorted((raw_root_of(out_root) / source / modality).glob(f"{key}.*"))
    assert len(hits) == 1, (out_root, modality, key, hits)
    return hits[0]


# --------------------------------------------------------------------------- hand-written tars


def tar_bytes(members: Sequence[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar of ``(name, data)`` members in the given order (normalised headers)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def member_offsets(data: bytes) -> dict[str, int]:
    """Header offset of each member (first occurrence) of a tar."""
    out: dict[str, int] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for info in tf.getmembers():
            out.setdefault(info.name, info.offset)
    return out


def write_hand_shards(
    bucket_dir: Path, shards: Sequence[Mapping[str, Sequence[tuple[str, bytes]]]], *,
    index_keys: Sequence[Sequence[str]] | None = None, with_index: bool = True, key_modality: str = "image",
) -> Path:
    """Write shards ``part_000000/<i>.tar`` under ``bucket_dir/<modality>/`` from
    ``{modality: [(member name, bytes), ...]}`` each, plus key indexes and ``wdinfo.json``.

    The key index of shard i lists ``index_keys[i]`` (default: the keys of ``key_modality``'s
    members, split at the first dot), and the manifest promises that many samples; a key a
    modality lacks gets offset 0 (read that tar from its start).
    Returns the manifest path.
    """
    modalities = sorted(shards[0])
    entries = []
    for i, members in enumerate(shards):
        rel = f"part_000000/{i:06d}.tar"
        keys = list(index_keys[i]) if index_keys else [_first_dot_key(n) for n, _ in members[key_modality]]
        wanted = set(keys)
        located: dict[str, dict[str, tuple[str, int]]] = {}
        for m in modalities:
            data = tar_bytes(members[m])
            path = bucket_dir / m / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            offs = member_offsets(data)
            located[m] = {}
            for name, _ in members[m]:
                stem = name.rsplit(".", 1)[0]
                k = stem if stem in wanted else _first_dot_key(name)
                located[m].setdefault(k, (name, offs[name]))
            for k in keys:  # a key this modality lacks: "read from the start"
                located[m].setdefault(k, ("", 0))
        ki = None
        if with_index:
            rows = [KeyIndexRow(k, k, None, None, None, {m: (*located[m][k], 0) for m in modalities}) for k in keys]
            ki = key_index_relpath(rel)
            (bucket_dir / ki).parent.mkdir(parents=True, exist_ok=True)
            write_key_index(bucket_dir / ki, key_index_table(rows, modalities))
        entries.append(TarEntry(rel, len(keys), key_index=ki))
    return write_wdinfo(bucket_dir, WdinfoManifest(data_keys=modalities, tars=entries, chunk_size=0))


def _first_dot_key(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(base) + base.index(".")] if "." in base else name


def jpeg_bytes(seed: int, size: tuple[int, int] = (24, 16)) -> bytes:
    """A small real JPEG (a crop of a scikit-image photograph, shifted by ``seed``)."""
    from PIL import Image

    from pid_platform.demo.sample_data import load_photo

    im = load_photo("astronaut")
    x = (seed * 37) % (im.width - size[0])
    buf = io.BytesIO()
    Image.Image.crop(im, (x, 0, x + size[0], size[1])).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def caption_bytes(key: str) -> bytes:
    return json.dumps({"prompt": f"caption of {key}"}).encode()


def pid_style_manifest(built_manifest: Path, dest_dir: Path) -> Path:
    """Rewrite a built manifest the way PiD writes one: absolute ``root`` and only PiD's keys
    (no ``chunk_size``, ``format_version``, key index, sizes or checksums)."""
    doc = json.loads(built_manifest.read_text())
    pid = {
        "root": str(built_manifest.parent.resolve()),
        "data_keys": doc["data_keys"],
        "data_list": doc["data_list"],
        "data_list_key_count": doc["data_list_key_count"],
        "total_key_count": doc["total_key_count"],
    }
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / "wdinfo.json"
    out.write_text(json.dumps(pid, indent=2))
    return out


# --------------------------------------------------------------------------- mixtures

# Three sources of one output root for the mixture tests: all 32 photographs, 20 of them
# (no rocket, four coffee left), and the 8 of chelsea.
MIXTURE_SOURCES = {"photos": 32, "web": 20, "hq": 8}
WEIGHTED = {"sources": {"photos": {"weight": 0.6}, "web": {"weight": 0.3}, "hq": {"weight": 0.1}},
            "samples_per_epoch": 40}
COUNTED = {"sources": {"photos": {"choose": 12}, "web": {"repeat": 0.5}, "hq": {"repeat": 2}}}
_MIXTURE_BUILD: dict[str, Path] = {}


def _stems(raw_template: Path) -> list[str]:
    return sorted(p.stem for p in (raw_template / SOURCE / "image").iterdir())


def mixture_build(tmp_path_factory: pytest.TempPathFactory, raw_template: Path) -> Path:
    """An output root with the sources of :data:`MIXTURE_SOURCES` (shards of at most 3) and a
    catalog with the logical datasets ``weighted`` (:data:`WEIGHTED`), ``counted``
    (:data:`COUNTED`) and ``union`` (a list); once per session, read-only."""
    if "root" not in _MIXTURE_BUILD:
        from pid_platform.sharding.catalog import build_catalog

        out = tmp_path_factory.mktemp("built-mixture-")
        stems = _stems(raw_template)
        web_drop = [s for s in stems if s.startswith("rocket")] + [s for s in stems if s.startswith("coffee")][:4]
        drops = {"photos": [], "web": web_drop, "hq": [s for s in stems if not s.startswith("chelsea")]}
        for source, drop in drops.items():
            build_photos(raw_template, out, shard_size=3, drop=drop, source=source)
        build_catalog(out, {"weighted": WEIGHTED, "counted": COUNTED, "union": ["web", "hq"]})
        _MIXTURE_BUILD["root"] = out
    return _MIXTURE_BUILD["root"]
