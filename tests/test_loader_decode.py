"""Decoding built twin tars back into what the raw drop held, same-aspect batching, and a resume
that starts inside a shard at the member offset of the key index."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from loader.wds.consumed import split_sid
from loader.wds.decode import CAPTION_FIELDS
from loader.wds.discovery import load_wdinfo
from loader.wds.errors import ShardReadError
from loader.wds.pipeline import build_dataset, make_loader
from tests.support.loader_data import all_sids, build_photos, raw_file, shared_build


@pytest.fixture(scope="module")
def built32(tmp_path_factory, photo_drop_template) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=3)


def _samples(root: Path, **kw) -> list[dict]:
    return list(build_dataset(str(root), **kw))


def _bucket_of_key(key: str) -> str:
    w, h = key.rsplit("-", 1)[1].split("x")
    return f"aspect_ratio_{w}_{h}"


def test_images_decode_to_pil_and_to_chw_uint8_tensors(built32: Path) -> None:
    pil = {s["__key__"]: s for s in _samples(built32, decode="pil", modalities=["image"])}
    assert len(pil) == 32
    for key, s in pil.items():
        with Image.open(raw_file(built32, "image", key)) as im:
            want = np.asarray(im.convert("RGB"))
        assert isinstance(s["image"], Image.Image) and s["image"].mode == "RGB"
        assert np.array_equal(np.asarray(s["image"]), want), key
        assert s["__bucket__"] == _bucket_of_key(key)
    for s in _samples(built32, decode="tensor", modalities=["image"]):
        t = s["image"]
        assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape[0] == 3
        assert torch.equal(t.permute(1, 2, 0), torch.from_numpy(np.array(pil[s["__key__"]]["image"])))


def test_embeddings_are_the_source_float16_arrays(built32: Path) -> None:
    loader = make_loader(build_dataset(str(built32), decode="bytes", modalities=["umt5"], batch_size=4))
    seen = 0
    for batch in loader:
        emb = batch["umt5"]
        assert emb.dtype == torch.float16 and emb.shape == (len(batch["__key__"]), 8, 64)
        for key, row in zip(batch["__key__"], emb, strict=True):
            src = np.load(raw_file(built32, "umt5", key))
            assert src.dtype == np.float16 and np.array_equal(row.numpy(), src)
            seen += 1
    assert seen == 32


def _captions(root: Path, **kw) -> dict[tuple[int, int], str]:
    """(epoch, sid) -> chosen caption, over epochs 0 and 1."""
    num_workers = kw.pop("num_workers", 0)
    loader = make_loader(build_dataset(str(root), modalities=["caption"], batch_size=4, **kw), num_workers=num_workers)
    out = {}
    for _ in range(2):
        for b in loader:
            for e, sid, cap in zip(b["__epoch__"].tolist(), b["__sid__"].tolist(), b["caption"], strict=True):
                out[(e, sid)] = cap
    return out


def test_caption_choice_depends_only_on_seed_epoch_and_sample(built32: Path) -> None:
    base = _captions(built32, seed=5)
    assert len(base) == 64
    docs = {}
    for s in _samples(built32, decode=None, modalities=["caption"]):
        docs[s["__sid__"]] = json.loads(raw_file(built32, "caption", s["__key__"]).read_text())
    chosen = Counter()
    for (_, sid), cap in base.items():
        field = next(f for f in CAPTION_FIELDS if docs[sid][f] == cap)
        chosen[field] += 1
    assert set(chosen) == set(CAPTION_FIELDS), chosen  # all three fields get picked
    # Not the order of reading, nor workers or shuffle buffers: only (seed, epoch, sample).
    assert _captions(built32, seed=5, shuffle_buffer=7) == base
    assert _captions(built32, seed=5, num_workers=2) == base
    # Another epoch or another seed picks differently for some samples.
    assert any(base[(0, sid)] != base[(1, sid)] for _, sid in base)
    other = _captions(built32, seed=6)
    assert other.keys() == base.keys() and other != base
    # Weights and field lists are honoured.
    only_prompt = _captions(built32, seed=5, caption_weights=(1, 0, 0))
    assert all(cap == docs[sid]["prompt"] for (_, sid), cap in only_prompt.items())
    short = _captions(built32, seed=5, caption_fields=("prompt_short",))
    assert all(cap == docs[sid]["prompt_short"] for (_, sid), cap in short.items())


def test_same_aspect_batches_are_single_bucket_and_lose_nothing(built32: Path) -> None:
    everything = all_sids(load_wdinfo(str(built32)).tar_files.counts)
    ds = build_dataset(str(built32), decode="tensor", modalities=["image"], batch_size=3,
                       same_aspect_batches=True, shuffle_buffer=6)
    seen: list[int] = []
    for batch in make_loader(ds, num_workers=2):
        buckets = set(batch["__bucket__"])
        assert len(buckets) == 1
        (bucket,) = buckets
        assert {_bucket_of_key(k) for k in batch["__key__"]} == {bucket}
        seen += batch["__sid__"].tolist()
    assert sorted(seen) == sorted(everything)


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_resume_inside_a_shard_seeks_to_the_member_offset(photo_drop_template: Path, tmp_path: Path,
                                                          mode: str) -> None:
    out = build_photos(photo_drop_template, tmp_path / "out", shard_size=4)  # one 4-sample tar per bucket
    ds = lambda: build_dataset(str(out), mode=mode, decode="bytes", batch_size=1, seed=2)  # noqa: E731
    loader = make_loader(ds())
    it = iter(loader)
    before = [next(it) for _ in range(2)]
    state = loader.state_dict()
    shard, members = zip(*(split_sid(b["__sid__"].item()) for b in before), strict=True)
    assert len(set(shard)) == 1 and members == (0, 1)  # the first shard is half read
    shard_info = load_wdinfo(str(out)).tar_files[shard[0]]

    # Make the shard's first member unreadable in every modality: only a reader that seeks to
    # member 2 through the key index can finish the epoch.
    for m in shard_info.keys:
        tar = Path(shard_info.url(m))
        data = bytearray(tar.read_bytes())
        data[:512] = b"\x01" * 512
        tar.write_bytes(bytes(data))
    with pytest.raises(ShardReadError, match="unreadable tar"):
        list(ds())

    restored = make_loader(ds())
    restored.load_state_dict(state)
    after = list(restored)
    got = Counter(b["__sid__"].item() for b in before + after)
    assert set(got) == all_sids(load_wdinfo(str(out)).tar_files.counts) and max(got.values()) == 1
    for b in after:
        key = b["__key__"][0]
        assert b["image"][0] == raw_file(out, "image", key).read_bytes(), key
        assert key.split("-")[0] in b["caption"][0]
        assert np.array_equal(b["umt5"][0].numpy(), np.load(raw_file(out, "umt5", key)))
    resumed_in_shard = [b["__key__"][0] for b in after if split_sid(b["__sid__"].item())[0] == shard[0]]
    assert len(resumed_in_shard) == 2
