"""Twin-tar expansion on hand-written tars: the inputs the build side never writes.

Zip mode must notice twins that disagree (and may fall back to the key index); index mode must
pair members by key through missing, duplicate, out-of-order and multi-dot members; broken
tars and unsafe members fail with named errors that say which file and which key.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from loader.wds.decode import Decoder
from loader.wds.errors import (
    DecodeError,
    MissingKeyError,
    ShardReadError,
    TwinMismatchError,
    UnsafeDataError,
)
from loader.wds.pipeline import build_dataset
from tests.support.loader_data import caption_bytes, jpeg_bytes, write_hand_shards

KEYS = ("k0", "k1", "k2", "k3")


def images(keys, *, salt: int = 0) -> list[tuple[str, bytes]]:
    return [(f"{k}.jpg", jpeg_bytes(i + salt)) for i, k in enumerate(keys)]


def captions(keys) -> list[tuple[str, bytes]]:
    return [(f"{k}.json", caption_bytes(k)) for k in keys]


def read_all(manifest: Path, **kw) -> tuple[list[dict], object]:
    """Every sample (in shard order, no shuffling), and the dataset (for its stats)."""
    lookahead = kw.pop("lookahead", None)
    ds = build_dataset(str(manifest), shuffle=False, decode=kw.pop("decode", None), **kw)
    if lookahead is not None:
        ds.options = dataclasses.replace(ds.options, lookahead=lookahead)
    return list(ds), ds


def keys_of(samples: list[dict]) -> list[str]:
    return [s["__key__"] for s in samples]


def assert_paired(samples: list[dict]) -> None:
    """Each sample's caption is the one written for its key."""
    for s in samples:
        if "caption.json" in s:
            assert s["caption.json"] == caption_bytes(s["__key__"]), s["__key__"]


# ----------------------------------------------------------------------------- zip mode


@pytest.fixture
def wrong_key_at_2(tmp_path: Path) -> Path:
    # caption tar holds "kX" where the image tar holds "k2"; the key index lists the image keys.
    return write_hand_shards(tmp_path / "aspect_ratio_1_1", [
        {"image": images(KEYS), "caption": captions(("k0", "k1", "kX", "k3"))},
    ])


@pytest.fixture
def short_twin(tmp_path: Path) -> Path:
    return write_hand_shards(tmp_path / "bucket", [{"image": images(KEYS), "caption": captions(KEYS[:3])}])


def test_zip_mode_names_both_tars_and_keys_on_a_key_mismatch(wrong_key_at_2: Path) -> None:
    with pytest.raises(TwinMismatchError) as err:
        read_all(wrong_key_at_2)
    msg = str(err.value)
    bucket = wrong_key_at_2.parent
    assert str(bucket / "image" / "part_000000" / "000000.tar") in msg
    assert str(bucket / "caption" / "part_000000" / "000000.tar") in msg
    assert "'k2'" in msg and "'kX'" in msg and "member 2" in msg and "mode='index'" in msg


def test_zip_mode_names_both_tars_when_a_twin_is_short(short_twin: Path) -> None:
    with pytest.raises(TwinMismatchError) as err:
        read_all(short_twin)
    msg = str(err.value)
    assert "caption/part_000000/000000.tar" in msg and "image/part_000000/000000.tar" in msg
    assert "member 3" in msg


def test_zip_mode_falls_back_to_the_key_index(wrong_key_at_2: Path, short_twin: Path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    samples, ds = read_all(wrong_key_at_2, zip_fallback_to_index=True)
    # k0, k1 came from zip mode before the mismatch; index mode goes on from k2: k2 has no
    # caption (skipped and counted), k3 pairs up; nothing is read twice.
    assert keys_of(samples) == ["k0", "k1", "k3"]
    assert_paired(samples)
    stats = ds.stats.as_dict()
    assert stats["zip_fallbacks"] == 1 and stats["missing_keys"] == {"caption": 1}
    assert "falling back to index mode" in caplog.text

    samples, ds = read_all(short_twin, zip_fallback_to_index=True)
    assert keys_of(samples) == ["k0", "k1", "k2"] and ds.stats.missing_keys == {"caption": 1}


def test_zip_mode_mismatch_on_the_first_member_falls_back(tmp_path: Path) -> None:
    manifest = write_hand_shards(tmp_path / "b", [
        {"image": images(KEYS), "caption": captions(("k1", "k0", "k2", "k3"))},
    ])
    samples, ds = read_all(manifest, zip_fallback_to_index=True)
    assert keys_of(samples) == list(KEYS) and ds.stats.zip_fallbacks == 1
    assert_paired(samples)


# ----------------------------------------------------------------------------- index mode


@pytest.fixture
def caption_lacks_k2(tmp_path: Path) -> Path:
    return write_hand_shards(tmp_path / "b", [
        {"image": images(KEYS), "caption": captions(("k0", "k1", "k3"))},
    ], index_keys=[KEYS])


def test_index_mode_missing_key_skip(caption_lacks_k2: Path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    samples, ds = read_all(caption_lacks_k2, mode="index")
    assert keys_of(samples) == ["k0", "k1", "k3"]
    assert_paired(samples)
    assert ds.stats.missing_keys == {"caption": 1} and ds.stats.samples == 3
    assert "'k2'" in caplog.text and "caption" in caplog.text


def test_index_mode_missing_key_error(caption_lacks_k2: Path) -> None:
    with pytest.raises(MissingKeyError, match=r"key 'k2' missing from .*caption/part_000000/000000\.tar"):
        read_all(caption_lacks_k2, mode="index", missing_key_policy="error")


def test_index_mode_missing_key_partial(caption_lacks_k2: Path) -> None:
    samples, ds = read_all(caption_lacks_k2, mode="index", missing_key_policy="partial", decode="bytes")
    assert keys_of(samples) == list(KEYS)
    k2 = samples[2]
    assert k2["__missing__"] == ("caption",) and "caption" not in k2 and k2["image"][:2] == b"\xff\xd8"
    assert all("__missing__" not in s for i, s in enumerate(samples) if i != 2)
    assert ds.stats.missing_keys == {"caption": 1}


def test_index_mode_duplicate_and_out_of_order_members(tmp_path: Path) -> None:
    image_members = images(KEYS)
    manifest = write_hand_shards(tmp_path / "b", [{
        "image": [*image_members[:2], ("k1.jpg", jpeg_bytes(99)), *image_members[2:]],  # k1 twice
        "caption": captions(("k1", "k0", "k3", "k2")),  # pairwise swapped
    }], index_keys=[KEYS])
    samples, ds = read_all(manifest, mode="index")
    assert keys_of(samples) == list(KEYS)
    assert_paired(samples)
    assert samples[1]["image.jpg"] == image_members[1][1]  # the first copy wins
    assert ds.stats.duplicates == 1 and not ds.stats.missing_keys


def test_index_mode_beyond_the_lookahead_counts_instead_of_mispairing(tmp_path: Path) -> None:
    manifest = write_hand_shards(tmp_path / "b", [
        {"image": images(KEYS), "caption": captions(("k3", "k0", "k1", "k2"))},
    ], index_keys=[KEYS])
    samples, ds = read_all(manifest, mode="index", lookahead=4)
    assert keys_of(samples) == list(KEYS)  # within the look-ahead: all paired
    assert_paired(samples)
    samples, ds = read_all(manifest, mode="index", lookahead=1)
    assert_paired(samples)
    assert len(samples) + sum(ds.stats.missing_keys.values()) == len(KEYS)


# ----------------------------------------------------------------------------- broken tars


@pytest.fixture
def truncated_first_shard(tmp_path: Path) -> Path:
    manifest = write_hand_shards(tmp_path / "b", [
        {"image": images(KEYS), "caption": captions(KEYS)},
        {"image": images(("m0", "m1"), salt=10), "caption": captions(("m0", "m1"))},
    ])
    tar = tmp_path / "b" / "image" / "part_000000" / "000000.tar"
    data = tar.read_bytes()
    tar.write_bytes(data[: len(data) // 2 + 100])  # cut inside a member's data
    return manifest


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_truncated_tar_names_the_file(truncated_first_shard: Path, mode: str) -> None:
    tar = truncated_first_shard.parent / "image" / "part_000000" / "000000.tar"
    with pytest.raises(ShardReadError, match=rf"{tar}: unreadable tar .*truncated or corrupt"):
        read_all(truncated_first_shard, mode=mode)


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_truncated_tar_skip_policy_goes_on_with_the_next_shard(truncated_first_shard: Path, mode: str) -> None:
    samples, ds = read_all(truncated_first_shard, mode=mode, shard_error_policy="skip")
    keys = keys_of(samples)
    assert keys[-2:] == ["m0", "m1"] and set(keys[:-2]) < set(KEYS)
    assert_paired(samples)
    assert ds.stats.shard_errors == 1 and ds.stats.shards == 2


def test_missing_tar_is_a_shard_read_error(tmp_path: Path) -> None:
    manifest = write_hand_shards(tmp_path / "b", [{"image": images(KEYS), "caption": captions(KEYS)}])
    (tmp_path / "b" / "caption" / "part_000000" / "000000.tar").unlink()
    with pytest.raises(ShardReadError, match="tar not found"):
        read_all(manifest)


def test_corrupt_image_names_the_sample_and_member(tmp_path: Path) -> None:
    members = images(KEYS)
    members[1] = ("k1.jpg", b"\xff\xd8 this is not a jpeg")
    manifest = write_hand_shards(tmp_path / "b", [{"image": members, "caption": captions(KEYS)}])
    ds = build_dataset(str(manifest), shuffle=False, decode="pil")
    with pytest.raises(DecodeError, match=r"sample 'k1'.*image\.jpg") as err:
        list(ds)
    assert "UnidentifiedImageError" in str(err.value) and "k1.jpg" in str(err.value)
    assert isinstance(err.value.__cause__, Exception)


def test_truncated_npy_is_a_decode_error_not_an_unsafe_one() -> None:
    buf = io.BytesIO()
    np.save(buf, np.zeros((8, 64), np.float16))
    sample = {"__key__": "k7", "__shard__": 3, "__index__": 1, "umt5.npy": buf.getvalue()[:100]}
    with pytest.raises(DecodeError, match=r"sample 'k7' \(shard 3, member 1\): cannot decode umt5.npy"):
        Decoder()(sample)


# ----------------------------------------------------------------------------- foreign names


def test_multi_dot_member_names_never_crash(tmp_path: Path) -> None:
    keys = ("a.b.c", "a.b.d", "x")
    manifest = write_hand_shards(tmp_path / "b", [{
        "image": [(f"{k}.jpg", jpeg_bytes(i)) for i, k in enumerate(keys)],
        "caption": [(f"{k}.json", caption_bytes(k)) for k in keys],
    }], index_keys=[keys])
    # Index mode knows the real keys (the longest known prefix wins).
    samples, _ = read_all(manifest, mode="index", decode="pil")
    assert keys_of(samples) == list(keys)
    assert [s["caption"] for s in samples] == [f"caption of {k}" for k in keys]
    assert all(s["image"].size == (24, 16) for s in samples)
    # Zip mode splits the WebDataset way (first dot): still three samples, nothing merged.
    samples, _ = read_all(manifest, decode="pil")
    assert keys_of(samples) == ["a", "a", "x"]
    assert [s["caption"] for s in samples] == [f"caption of {k}" for k in keys]


# ----------------------------------------------------------------------------- unsafe members


@pytest.fixture
def pickled_members(tmp_path: Path) -> tuple[Path, dict]:
    values = {"pkl": {"labels": [1, 2]}, "pt": torch.arange(4), "npy": np.array([{"a": 1}, None], dtype=object)}
    pt = io.BytesIO()
    torch.save(values["pt"], pt)
    npy = io.BytesIO()
    np.save(npy, values["npy"], allow_pickle=True)
    manifest = write_hand_shards(tmp_path / "b", [{
        "image": images(("k0",)), "caption": captions(("k0",)),
        "meta": [("k0.pkl", pickle.dumps(values["pkl"]))],
        "weights": [("k0.pt", pt.getvalue())],
        "objects": [("k0.npy", npy.getvalue())],
    }])
    return manifest, values


@pytest.mark.parametrize("modality", ["meta", "weights", "objects"])
def test_pickle_members_are_refused_by_default(pickled_members, modality: str) -> None:
    manifest, _ = pickled_members
    ds = build_dataset(str(manifest), modalities=["image", modality], decode="pil")
    with pytest.raises(UnsafeDataError, match=r"sample 'k0'.*trusted_data=True"):
        list(ds)


def test_pickle_members_load_with_trusted_data(pickled_members) -> None:
    manifest, values = pickled_members
    (sample,) = list(build_dataset(str(manifest), decode="pil", trusted_data=True))
    assert sample["meta"] == values["pkl"]
    assert torch.equal(sample["weights"], values["pt"])
    assert sample["objects"][0] == {"a": 1} and sample["objects"][1] is None


def test_decoder_refuses_pickle_on_its_own() -> None:
    sample = {"__key__": "k", "x.pickle": pickle.dumps(1)}
    with pytest.raises(UnsafeDataError, match="x.pickle"):
        Decoder()(sample)
    assert Decoder(trusted_data=True)(sample)["x"] == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_counts_from_workers_reach_the_loader(caption_lacks_k2: Path, num_workers: int) -> None:
    """Counters live in each DataLoader worker; the loader in the training process sums them."""
    from loader.wds.pipeline import make_loader

    ds = build_dataset(str(caption_lacks_k2), mode="index", shuffle=False, decode=None, batch_size=1)
    loader = make_loader(ds, num_workers=num_workers)
    batches = list(loader)
    assert sorted(k for b in batches for k in b["__key__"]) == ["k0", "k1", "k3"]
    assert all("__stats__" not in b for b in batches)  # bookkeeping never reaches the loop
    assert loader.stats["missing_keys"] == {"caption": 1}
    assert loader.stats["samples"] == 3
