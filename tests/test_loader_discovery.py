"""Manifest discovery: by dataset name (catalog.json), folder, glob or file; aspect-ratio filter;
modality selection; an output tree that moved still loads (manifest roots are relative)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loader.wds.discovery import CATALOG_ENV, find_manifests, load_wdinfo
from loader.wds.errors import ManifestError
from loader.wds.pipeline import build_dataset
from pid_platform.sharding.catalog import build_catalog
from tests.support.loader_data import build_photos

ALL_BUCKETS = ("aspect_ratio_16_9", "aspect_ratio_1_1", "aspect_ratio_21_9", "aspect_ratio_2_3",
               "aspect_ratio_3_2", "aspect_ratio_3_4", "aspect_ratio_4_3", "aspect_ratio_9_16")


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, photo_drop_template) -> Path:
    """``photos`` (32 samples) and ``portraits`` (the 3:4, 2:3 and 9:16 crops only, 12 samples)
    under one output root, with a logical dataset ``mix`` of both."""
    out = tmp_path_factory.mktemp("catalog") / "out"
    build_photos(photo_drop_template, out, shard_size=3)
    landscape = [f"{p}-{r}" for p in ("astronaut", "chelsea", "coffee", "rocket")
                 for r in ("21x9", "16x9", "3x2", "4x3", "1x1")]
    build_photos(photo_drop_template, out, shard_size=4, drop=landscape, source="portraits")
    build_catalog(out, datasets={"mix": ["photos", "portraits"]})
    return out


def _manifests(out: Path, source: str) -> list[str]:
    return sorted(str(p) for p in (out / source).glob("aspect_ratio_*/wdinfo.json"))


def test_find_by_dataset_name_through_the_catalog(two_sources: Path, monkeypatch) -> None:
    photos, portraits = _manifests(two_sources, "photos"), _manifests(two_sources, "portraits")
    assert (len(photos), len(portraits)) == (8, 3)
    assert find_manifests("mix", catalog=str(two_sources)) == sorted(photos + portraits)
    assert find_manifests("all", catalog=str(two_sources / "catalog.json")) == sorted(photos + portraits)
    assert find_manifests("portraits", catalog=str(two_sources)) == portraits  # a source name works too
    with pytest.raises(ManifestError, match=r"'nope' is not in the catalog .*known: \['all', 'mix', 'photos', 'portraits'\]"):
        find_manifests("nope", catalog=str(two_sources))
    with pytest.raises(ManifestError, match=CATALOG_ENV):
        find_manifests("mix")
    monkeypatch.setenv(CATALOG_ENV, str(two_sources))
    assert find_manifests("mix") == sorted(photos + portraits)
    ds = build_dataset("mix", decode=None)
    assert ds.shards.total_samples == 44 and sum(1 for _ in ds) == 44


def test_find_by_folder_glob_and_file(two_sources: Path) -> None:
    photos = _manifests(two_sources, "photos")
    assert find_manifests(str(two_sources / "photos")) == photos
    # The build's state folder is never taken for data, even if a manifest lands in it.
    state = two_sources / "photos" / ".pid-build"
    assert state.is_dir()
    shutil.copy(photos[0], state / "wdinfo.json")
    try:
        assert find_manifests(str(two_sources / "photos")) == photos
    finally:
        (state / "wdinfo.json").unlink()
    one_one = str(two_sources / "photos" / "aspect_ratio_1_1" / "wdinfo.json")
    assert find_manifests(one_one) == [one_one]
    assert find_manifests(f"file://{one_one}") == [one_one]
    assert find_manifests(str(two_sources / "photos" / "aspect_ratio_1*" / "wdinfo.json")) == [
        str(two_sources / "photos" / "aspect_ratio_16_9" / "wdinfo.json"), one_one]
    # A glob of folders is searched like folders; several specs are merged without duplicates.
    assert find_manifests(str(two_sources / "p*")) == sorted(photos + _manifests(two_sources, "portraits"))
    assert find_manifests([one_one, str(two_sources / "photos")]) == photos
    with pytest.raises(ManifestError, match="matched no manifest"):
        find_manifests(str(two_sources / "nothing*"))
    empty = two_sources.parent / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(ManifestError, match=rf"no wdinfo.json under folder {empty}"):
        find_manifests(str(empty))


def test_aspect_ratio_filter(two_sources: Path) -> None:
    wanted = ["aspect_ratio_1_1", "aspect_ratio_9_16"]
    info = load_wdinfo(str(two_sources / "photos"), aspect_ratios=wanted)
    assert sorted({t.bucket for t in info.tar_files}) == wanted
    assert info.total_key_count == 8
    samples = list(build_dataset(str(two_sources), aspect_ratios=wanted, decode=None))
    assert sorted({s["__bucket__"] for s in samples}) == wanted and len(samples) == 8 + 4  # + portraits 9:16
    assert {t.bucket for t in load_wdinfo(str(two_sources)).tar_files} == set(ALL_BUCKETS)
    with pytest.raises(ManifestError, match=r"after the aspect-ratio filter \['aspect_ratio_5_4'\]"):
        load_wdinfo(str(two_sources), aspect_ratios=["aspect_ratio_5_4"])


def test_modality_selection(two_sources: Path) -> None:
    samples = list(build_dataset(str(two_sources / "portraits"), modalities=["image", "caption"], decode="pil"))
    assert len(samples) == 12
    assert all({k for k in s if not k.startswith("__")} == {"image", "caption"} for s in samples)
    info = load_wdinfo(str(two_sources / "portraits"), modalities=["umt5"])
    assert {t.keys for t in info.tar_files} == {("umt5",)}
    with pytest.raises(ManifestError) as err:
        load_wdinfo(str(two_sources / "portraits"), modalities=["image", "depth"])
    msg = str(err.value)
    assert "['depth']" in msg and str(two_sources / "portraits" / "aspect_ratio_2_3" / "wdinfo.json") in msg


def test_a_moved_output_tree_still_loads(two_sources: Path, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere" / "portraits"
    shutil.copytree(two_sources / "portraits", moved)
    doc = json.loads((moved / "aspect_ratio_3_4" / "wdinfo.json").read_text())
    assert doc["root"] == "."  # relative: no absolute path baked in
    here = {s["__key__"]: s["image.jpg" if "image.jpg" in s else "image.png"]
            for s in build_dataset(str(moved), decode=None, mode="index")}
    there = {s["__key__"]: s["image.jpg" if "image.jpg" in s else "image.png"]
             for s in build_dataset(str(two_sources / "portraits"), decode=None)}
    assert here == there and len(here) == 12


def test_a_folder_named_like_a_pattern_is_searched_by_its_name(two_sources: Path, tmp_path: Path) -> None:
    """``runs[2024]`` given as a folder, or matched by a glob, is searched as that folder: its
    brackets are not a character class that matches no manifest under it."""
    folder = tmp_path / "runs[2024]" / "portraits"
    shutil.copytree(two_sources / "portraits", folder)
    found = sorted(str(p) for p in folder.glob("aspect_ratio_*/wdinfo.json"))
    assert len(found) == 3
    assert find_manifests(str(folder)) == found
    assert find_manifests(str(tmp_path / "runs?2024?")) == found
    assert sum(1 for _ in build_dataset(str(folder), decode=None)) == 12


def _same_tables(a, b) -> None:
    assert len(a) == len(b) and a.fingerprint() == b.fingerprint()
    assert list(a) == list(b)  # every TarSample: root, path, keys, count, key index, source, bucket, sha256


def test_what_rank0_broadcasts_is_compact_and_exact(two_sources: Path, tmp_path: Path) -> None:
    """A ShardTable pickles (what broadcast_object_list sends) to its compact wire form and back
    to the same shards, checksums, nulls and fingerprint included."""
    import pickle

    from loader.formats.layout import key_index_relpath, shard_relpath
    from loader.formats.wdinfo import TarEntry, WdinfoManifest, write_wdinfo
    from loader.wds.discovery import parse_manifests

    for keep in (False, True):
        table = load_wdinfo(str(two_sources), broadcast=False, keep_sha256=keep).tar_files
        _same_tables(pickle.loads(pickle.dumps(table)), table)
    # Many tars of the build's layout: the paths repeat a prefix and a counter pattern.
    for j in range(8):
        tars = [TarEntry(shard_relpath(i), 1000 + (i * 7919) % 400, key_index=key_index_relpath(shard_relpath(i))
                         if i % 3 else None) for i in range(j * 2500, (j + 1) * 2500)]
        leaf = tmp_path / "many" / f"aspect_ratio_{j}_1"
        leaf.mkdir(parents=True)
        write_wdinfo(leaf, WdinfoManifest(["image", "caption"], tars, bucket=leaf.name))
    table = parse_manifests(find_manifests(str(tmp_path / "many"))).tar_files
    blob = pickle.dumps(table)
    back = pickle.loads(blob)
    _same_tables(back, table)
    assert back.key_indexes.null_count == table.key_indexes.null_count > 0
    assert len(blob) * 20 < table.nbytes(), (len(blob), table.nbytes())
