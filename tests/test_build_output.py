"""What a build writes can be read by plain tools, and agrees with its manifests and indexes."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from loader.formats.twin_tar import BUCKET_NAMES, split_member_name, tar_path
from loader.formats.wdinfo import WDINFO_NAME
from pid_platform.sharding.pipeline import BuildSummary
from tests.support.build_data import (
    CLEAN_SAMPLES,
    MODALITIES,
    SOURCE,
    add_sample,
    all_problems,
    build,
    index_rows,
    jpeg_bytes,
    manifests,
    output_files,
    photo,
    plans_of,
    source_file,
)


@pytest.fixture(scope="module")
def built(photo_drop_template: Path, tmp_path_factory: pytest.TempPathFactory) -> BuildSummary:
    """One bucketed, size-bounded build of the clean drop, shared by the read-only checks here."""
    return build(photo_drop_template, tmp_path_factory.mktemp("built") / "out")


def _tars(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*.tar") if ".pid-build" not in p.parts)


def test_every_tar_reads_with_plain_tarfile(built: BuildSummary) -> None:
    tars = _tars(built.out)
    assert len(tars) == built.shards * len(MODALITIES)
    members = 0
    for p in tars:
        with tarfile.open(p) as tf:
            for info in tf:
                assert info.isfile() and "/" not in info.name
                assert info.mtime == 0 and info.uid == 0 and info.gid == 0 and info.mode == 0o644
                assert len(tf.extractfile(info).read()) == info.size
                members += 1
    assert members == CLEAN_SAMPLES * len(MODALITIES)


def test_webdataset_reads_each_modality_with_the_index_keys(built: BuildSummary) -> None:
    rows = index_rows(built.out)
    for modality in MODALITIES:
        keys, exts = [], []
        for man in manifests(built.out):
            urls = [str(Path(man.root_path()) / modality / t) for t in man.data_list]
            for sample in wds.WebDataset(urls, shardshuffle=False):
                fields = [k for k in sample if not k.startswith("__")]
                assert len(fields) == 1, sample.keys()  # one member per key: no dot split a name
                keys.append(sample["__key__"])
                exts.append(fields[0])
        assert keys == [r["key"] for r in rows]
        assert all("." not in k for k in keys)
        assert exts == [split_member_name(r[f"member.{modality}"])[1] for r in rows]


def test_twin_tars_hold_identical_key_sequences(built: BuildSummary) -> None:
    for man in manifests(built.out):
        for rel in man.data_list:
            seqs = []
            for m in man.data_keys:
                with tarfile.open(Path(man.root_path()) / m / rel) as tf:
                    seqs.append([split_member_name(n)[0] for n in tf.getnames()])
            assert all(s == seqs[0] for s in seqs) and seqs[0]


def test_manifests_validate_against_the_tars(built: BuildSummary) -> None:
    assert all_problems(built.out) == []
    largest = max(t.count for man in manifests(built.out) for t in man.tars)
    for man in manifests(built.out):
        doc = json.loads((Path(man.manifest_dir) / WDINFO_NAME).read_bytes())
        # PiD's readers need these keys; root is relative so the folder can move.
        for key in ("data_keys", "data_list", "data_list_key_count", "total_key_count", "root", "chunk_size"):
            assert key in doc
        assert doc["root"] == "."
        assert doc["total_key_count"] == sum(doc["data_list_key_count"])
        # One chunk_size per build, its largest tar: PiD uses the first manifest's for all of them.
        assert doc["chunk_size"] == largest
    assert sum(m.total_key_count for m in manifests(built.out)) == CLEAN_SAMPLES


def test_verify_reports_a_tampered_tar(built: BuildSummary, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    shutil.copytree(built.out, out)
    victim = _tars(out)[0]
    data = bytearray(victim.read_bytes())
    data[600] ^= 0xFF  # inside the first member's data: sizes and headers stay valid
    victim.write_bytes(bytes(data))
    problems = all_problems(out)
    assert len(problems) == 1 and "sha256" in problems[0] and str(victim) in problems[0]


def test_key_index_offsets_seek_straight_to_member_data(built: BuildSummary, photo_drop_template: Path) -> None:
    for row in index_rows(built.out):
        man = row["manifest"]
        for m in MODALITIES:
            want = source_file(photo_drop_template, m, row["basename"]).read_bytes()
            assert row[f"size.{m}"] == len(want)
            with open(Path(man.root_path()) / m / row["tar"], "rb") as fh:
                fh.seek(row[f"offset.{m}"] + 512)
                assert fh.read(len(want)) == want


def test_crops_land_in_their_aspect_bucket(built: BuildSummary) -> None:
    rows = index_rows(built.out)
    assert {r["bucket"] for r in rows} == set(BUCKET_NAMES)
    for r in rows:
        w, h = r["basename"].rsplit("-", 1)[1].split("x")  # stems are <photo>-<W>x<H>
        assert r["bucket"] == f"aspect_ratio_{w}_{h}"
        assert r["manifest"].bucket == r["bucket"]
        assert Path(r["manifest"].manifest_dir).name == r["bucket"]


def test_exif_rotated_image_lands_in_the_rotated_bucket(raw_root: Path, tmp_path: Path) -> None:
    # A 16:9 picture stored as 9:16 pixels with EXIF orientation 6 ("rotate 90 on display").
    landscape = photo("astronaut", (320, 180))
    add_sample(raw_root, "sideways", image=jpeg_bytes(landscape.transpose(Image.Transpose.ROTATE_90), exif_orientation=6))
    # The same pixels without the EXIF tag really are portrait.
    add_sample(raw_root, "upright", image=jpeg_bytes(landscape.transpose(Image.Transpose.ROTATE_90)))
    s = build(raw_root, tmp_path / "out")
    rows = {r["basename"]: r for r in index_rows(s.out)}
    assert (rows["sideways"]["width"], rows["sideways"]["height"]) == (320, 180)
    assert rows["sideways"]["bucket"] == "aspect_ratio_16_9"
    assert rows["upright"]["bucket"] == "aspect_ratio_9_16"


def test_flat_mode_has_one_manifest_and_no_buckets(photo_drop_template: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    s = build(photo_drop_template, out, classify_aspect_ratio=False)
    files = output_files(out)
    assert [p for p in files if p.endswith(WDINFO_NAME)] == [WDINFO_NAME]
    for m in MODALITIES:
        assert f"{m}/part_000000/000000.tar" in files
    assert not any(p.startswith("aspect_ratio_") for p in files)
    (man,) = manifests(out)
    assert man.bucket is None and man.total_key_count == CLEAN_SAMPLES == s.samples
    assert {r["bucket"] for r in index_rows(out)} == {None}
    assert all(tar_path(out, None, m, rel).is_file() for rel in man.data_list for m in man.data_keys)
    assert all_problems(out, classify_aspect_ratio=False) == []
    assert len(plans_of(out, classify_aspect_ratio=False)) == len(man.data_list)
    assert man.source == SOURCE
