"""Bad raw input: each kind has one clear outcome, and nothing is lost silently.

Every test checks the accounting: each basename on disk is either in the key index or named
in the intake report under a reason.
"""

from __future__ import annotations

import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from loader.formats.twin_tar import sanitize_key, tar_path
from pid_platform.sharding.errors import NoSamplesError, OutputNotWritableError, UnsafeInputError
from pid_platform.sharding.layout import STATE_DIR
from tests.support.build_data import (
    CLEAN_SAMPLES,
    SOURCE,
    add_sample,
    assert_nothing_lost,
    index_rows,
    jpeg_bytes,
    manifests,
    output_files,
    photo,
    source_file,
)
from tests.support.build_data import build as support_build


def build(raw_root: Path, out: Path, **kw):
    # One flat shard: these tests are about intake, and every tar written costs an fsync.
    return support_build(raw_root, out, **({"classify_aspect_ratio": False, "max_shard_size_mb": 500} | kw))


def _dropped_once(summary, reason: str, stem: str) -> None:
    assert summary.report.dropped[reason] == 1, dict(summary.report.dropped)
    assert summary.report.examples[reason] == [stem]
    assert summary.samples == CLEAN_SAMPLES
    assert stem not in {r["basename"] for r in index_rows(summary.out)}


def test_unreadable_image_is_dropped_and_named(raw_root: Path, tmp_path: Path) -> None:
    add_sample(raw_root, "noise", image=os.urandom(4096))
    s = build(raw_root, tmp_path / "out")
    _dropped_once(s, "unreadable_image: image", "noise")
    assert_nothing_lost(raw_root, s)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image_is_dropped(raw_root: Path, tmp_path: Path, fmt: str) -> None:
    # A download cut short: the header parses, the pixel data ends early.
    whole = source_file(raw_root, "image", "astronaut-1x1" if fmt == "JPEG" else "astronaut-21x9").read_bytes()
    add_sample(raw_root, "cut", image=whole[: len(whole) * 2 // 3], image_ext=fmt.lower().replace("jpeg", "jpg"))
    s = build(raw_root, tmp_path / "out")
    _dropped_once(s, "unreadable_image: image", "cut")
    assert_nothing_lost(raw_root, s)


def test_caption_not_json_is_dropped(raw_root: Path, tmp_path: Path) -> None:
    add_sample(raw_root, "notjson", caption=b"prompt: a cat, but YAML-ish\n")
    s = build(raw_root, tmp_path / "out")
    _dropped_once(s, "bad_caption: caption", "notjson")
    assert_nothing_lost(raw_root, s)


@pytest.mark.parametrize("doc", [{"text": "wrong field"}, {"prompt": ""}, {"prompt": 3}, ["prompt"]])
def test_caption_without_prompt_is_dropped(raw_root: Path, tmp_path: Path, doc) -> None:
    add_sample(raw_root, "noprompt", caption=json.dumps(doc).encode())
    s = build(raw_root, tmp_path / "out")
    _dropped_once(s, "bad_caption: caption", "noprompt")
    assert_nothing_lost(raw_root, s)


@pytest.mark.parametrize("modality", ["image", "caption", "umt5"])
def test_zero_byte_file_is_dropped(raw_root: Path, tmp_path: Path, modality: str) -> None:
    add_sample(raw_root, "empty")
    source_file(raw_root, modality, "empty").write_bytes(b"")
    s = build(raw_root, tmp_path / "out")
    _dropped_once(s, f"zero_byte: {modality}", "empty")
    assert_nothing_lost(raw_root, s)


def test_partial_keys_are_orphans_counted_per_modality(raw_root: Path, tmp_path: Path) -> None:
    add_sample(raw_root, "only-image", modalities=("image",))
    add_sample(raw_root, "image-and-umt5", modalities=("image", "umt5"))
    add_sample(raw_root, "only-caption", modalities=("caption",))
    s = build(raw_root, tmp_path / "out")
    r = s.report
    assert r.orphans == {"caption": 1, "image": 2, "umt5": 1}
    assert r.examples["missing_modality: caption,umt5"] == ["only-image"]
    assert r.examples["missing_modality: caption"] == ["image-and-umt5"]
    assert r.examples["missing_modality: image,umt5"] == ["only-caption"]
    assert r.dropped_total == 3
    assert s.samples == CLEAN_SAMPLES
    assert_nothing_lost(raw_root, s)


def test_keys_colliding_after_sanitising_are_both_kept(raw_root: Path, tmp_path: Path) -> None:
    a = jpeg_bytes(photo("chelsea", (120, 80)))
    b = jpeg_bytes(photo("coffee", (120, 80)))
    add_sample(raw_root, "a.b", image=a, caption={"prompt": "dotted"})
    add_sample(raw_root, "a_b", image=b, caption={"prompt": "underscored"})
    s = build(raw_root, tmp_path / "out")
    assert s.report.key_collisions == 2
    assert len(s.report.examples["key_collision_renamed"]) == 2
    rows = {r["basename"]: r for r in index_rows(s.out)}
    ka, kb = rows["a.b"]["key"], rows["a_b"]["key"]
    assert ka != kb
    assert sanitize_key("a.b") == sanitize_key("a_b") == "a_b"
    for k in (ka, kb):
        assert k.startswith("a_b_") and "." not in k
    # Each key still carries its own bytes, through the tar, not only through the index.
    for basename, want in (("a.b", a), ("a_b", b)):
        row = rows[basename]
        man = row["manifest"]
        with tarfile.open(tar_path(man.manifest_dir, None, "image", row["tar"])) as tf:
            assert tf.extractfile(row["member.image"]).read() == want
    assert s.samples == CLEAN_SAMPLES + 2
    assert_nothing_lost(raw_root, s)


def test_empty_modality_folder_is_ignored_and_reported(raw_root: Path, tmp_path: Path) -> None:
    (raw_root / SOURCE / "t5xxl").mkdir()
    s = build(raw_root, tmp_path / "out")
    assert s.report.empty_modalities == ["t5xxl"]
    assert s.report.modalities == ["caption", "image", "umt5"]
    for man in manifests(s.out):
        assert man.data_keys == ["caption", "image", "umt5"]
    assert not any("t5xxl" in p for p in output_files(s.out))
    assert s.samples == CLEAN_SAMPLES


def test_symlink_outside_the_source_is_ignored_and_reported(raw_root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg_bytes(photo("rocket", (64, 64))))
    add_sample(raw_root, "linked", modalities=("caption", "umt5"))
    (raw_root / SOURCE / "image" / "linked.jpg").symlink_to(secret)
    # A link that stays inside the source is an ordinary file.
    (raw_root / SOURCE / "image" / "inside.jpg").symlink_to(source_file(raw_root, "image", "chelsea-1x1"))
    add_sample(raw_root, "inside", modalities=("caption", "umt5"))
    s = build(raw_root, tmp_path / "out")
    assert s.report.skipped_files == {"symlink_outside_root": 1}
    assert s.report.examples["symlink_outside_root"] == ["image/linked.jpg"]
    assert s.report.examples["missing_modality: image"] == ["linked"]
    assert "inside" in {r["basename"] for r in index_rows(s.out)}
    assert_nothing_lost(raw_root, s)


def test_modality_folder_linked_outside_the_source_is_not_read(raw_root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for n in os.listdir(raw_root / SOURCE / "umt5"):
        (elsewhere / n).write_bytes(b"private")
    (raw_root / SOURCE / "leak").symlink_to(elsewhere)
    s = build(raw_root, tmp_path / "out")
    assert s.report.skipped_files == {"symlink_outside_root": 1}
    assert "leak" not in s.report.modalities
    assert not any("/leak/" in p or p.startswith("leak/") for p in output_files(s.out))
    assert s.samples == CLEAN_SAMPLES


def test_hidden_files_and_ambiguous_basenames_are_reported(raw_root: Path, tmp_path: Path) -> None:
    (raw_root / SOURCE / "image" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    src = source_file(raw_root, "image", "chelsea-3x2")
    (src.parent / "chelsea-3x2.png").write_bytes(b"not the same picture")  # x.jpg and x.png
    s = build(raw_root, tmp_path / "out")
    assert s.report.skipped_files == {"hidden_file": 1}
    assert s.report.examples["hidden_file"] == ["image/.DS_Store"]
    assert s.report.examples["ambiguous_basename"] == ["chelsea-3x2"]
    assert s.samples == CLEAN_SAMPLES - 1
    assert_nothing_lost(raw_root, s)


def test_file_names_that_are_not_utf8_are_skipped_and_reported(raw_root: Path, tmp_path: Path) -> None:
    # A Latin-1 name from an old archive: keys, indexes and manifests are UTF-8 text.
    for m in ("image", "caption", "umt5"):
        good = source_file(raw_root, m, "rocket-1x1")
        (good.parent / os.fsdecode(b"caf\xe9" + good.suffix.encode())).write_bytes(good.read_bytes())
    s = build(raw_root, tmp_path / "out")
    assert s.report.skipped_files == {"name_not_utf8": 3}
    assert s.report.examples["name_not_utf8"] == ["caption/caf\\xe9.json", "image/caf\\xe9.jpg", "umt5/caf\\xe9.npy"]
    assert s.samples == CLEAN_SAMPLES


def test_pickle_embedding_is_refused_unless_trusted(raw_root: Path, tmp_path: Path) -> None:
    payload = pickle.dumps({"emb": [0.5] * 16})
    add_sample(raw_root, "pickled", modalities=("image", "caption"))
    (raw_root / SOURCE / "umt5" / "pickled.pkl").write_bytes(payload)
    with pytest.raises(UnsafeInputError) as err:
        build(raw_root, tmp_path / "refused")
    msg = str(err.value)
    assert "umt5/pickled.pkl" in msg and "--trust-pickle" in msg
    assert not manifests(tmp_path / "refused")

    s = build(raw_root, tmp_path / "trusted", trust_pickle=True)
    row = {r["basename"]: r for r in index_rows(s.out)}["pickled"]
    assert row["member.umt5"] == "pickled.pkl"
    with tarfile.open(tar_path(row["manifest"].manifest_dir, None, "umt5", row["tar"])) as tf:
        assert tf.extractfile("pickled.pkl").read() == payload


def test_object_npy_is_pickle_in_disguise(raw_root: Path, tmp_path: Path) -> None:
    add_sample(raw_root, "objarr", modalities=("image", "caption"))
    np.save(raw_root / SOURCE / "umt5" / "objarr.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UnsafeInputError, match="objarr.npy"):
        build(raw_root, tmp_path / "out")


def test_unwritable_output_fails_before_any_work(raw_root: Path, tmp_path: Path) -> None:
    # Root ignores permission bits, but nobody can create a folder inside a regular file.
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    # A pickle in the input proves the order: intake would raise UnsafeInputError first.
    (raw_root / SOURCE / "umt5" / "astronaut-1x1.npy").write_bytes(pickle.dumps([1]))
    with pytest.raises(OutputNotWritableError) as err:
        build(raw_root, blocker / "out")
    assert str(blocker / "out") in str(err.value) and "--output-dir" in str(err.value)
    assert blocker.read_bytes() == b""


def test_no_valid_sample_keeps_the_previous_output(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(raw_root, out)
    before = output_files(out)
    for n in os.listdir(raw_root / SOURCE / "caption"):
        (raw_root / SOURCE / "caption" / n).write_text("{broken")
    with pytest.raises(NoSamplesError, match="bad_caption"):
        build(raw_root, out)
    assert output_files(out) == before
    assert (out / STATE_DIR).is_dir()
