"""``build_dataset(image_transform=...)``: images decoded at the size training keeps.

* the crop of a sample depends on (seed, epoch, key) only: 0 and 2 workers, and a resume at
  another world size, crop every sample the same way;
* against a full Pillow decode + the same crop box + the same resize: PSNR >= 38 dB where a
  JPEG is decoded at a DCT scale, bit-exact pixels where only its region is decoded (scale 1),
  on real photographs with every EXIF orientation, through libjpeg-turbo (the ``_jpeg``
  extension) and through Pillow's ``draft`` (the fallback where the extension is missing);
* the sampling is torchvision's (``transforms/v2/_geometry.py``), checked on its rules;
* bad parameters give one clear error at ``build_dataset``.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from loader.wds import image_decode
from loader.wds.image import (
    CenterCrop,
    Compose,
    ImageTransformError,
    RandomCrop,
    RandomResizedCrop,
    Resize,
    sample_rng,
)
from loader.wds.image_decode import decode_planned, pick_scale
from loader.wds.pipeline import build_dataset, make_loader
from tests.support.dist import run_distributed
from tests.support.loader_data import shared_build

SEED = 7
RRC = RandomResizedCrop(48, scale=(0.25, 1.0))


@pytest.fixture(scope="module")
def built32(tmp_path_factory, photo_drop_template) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=3)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def _crops(batches) -> dict[tuple[int, str], str]:
    """(epoch, key) -> digest of the decoded image, over the given batches."""
    out = {}
    for b in batches:
        for e, key, img in zip(b["__epoch__"].tolist(), b["__key__"], b["image"], strict=True):
            assert img.shape == (3, 48, 48) and img.dtype == torch.uint8
            out[(e, key)] = _digest(img)
    return out


def _run(root: Path, num_workers: int, epochs: int = 2, **kw) -> dict[tuple[int, str], str]:
    ds = build_dataset(str(root), modalities=["image"], decode="tensor", image_transform=RRC, seed=SEED,
                       shuffle_buffer=kw.pop("shuffle_buffer", 0), **kw)
    loader = make_loader(ds, batch_size=4, num_workers=num_workers)
    out: dict[tuple[int, str], str] = {}
    for _ in range(epochs):
        out.update(_crops(loader))
    return out


def test_the_crop_depends_on_seed_epoch_and_key_only(built32: Path) -> None:
    base = _run(built32, 0)
    assert len(base) == 64
    assert _run(built32, 2) == base
    assert _run(built32, 0, shuffle_buffer=7) == base  # another order: the same crops
    # Another epoch crops a sample differently, and so does another seed.
    keys = {k for _, k in base}
    assert sum(base[(0, k)] != base[(1, k)] for k in keys) >= 30
    ds = build_dataset(str(built32), modalities=["image"], decode="tensor", image_transform=RRC, seed=SEED + 1)
    changed = _crops(make_loader(ds, batch_size=4))
    assert sum(changed[(0, k)] != base[(0, k)] for k in keys) >= 30


def _rank_rest(rank: int, world_size: int, root: str, state: dict) -> dict:
    ds = build_dataset(root, modalities=["image"], decode="tensor", image_transform=RRC, seed=SEED)
    loader = make_loader(ds, batch_size=4, num_workers=2 if rank == 0 else 0)
    loader.load_state_dict(state)
    return {f"{e}|{k}": d for (e, k), d in _crops(loader).items()}


@pytest.mark.timeout(180)
def test_a_resume_at_another_world_size_crops_the_same_way(built32: Path) -> None:
    whole = _run(built32, 0, epochs=1)
    ds = build_dataset(str(built32), modalities=["image"], decode="tensor", image_transform=RRC, seed=SEED)
    loader = make_loader(ds, batch_size=4)
    it = iter(loader)
    before = _crops([next(it) for _ in range(3)])
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    ranks = run_distributed(_rank_rest, 2, timeout=150, args=(str(built32), state))
    after: dict[tuple[int, str], str] = {}
    for r in ranks:
        for ek, d in r.items():
            e, k = ek.split("|", 1)
            after[(int(e), k)] = d
    assert len(before) == 12 and len(before) + len(after) >= 32
    for ek, d in {**before, **after}.items():
        assert whole[ek] == d, ek
    assert set(before) | set(after) == set(whole)


# ----------------------------------------------------------------------------- pixels


def _photo(name: str, size: tuple[int, int]) -> Image.Image:
    """A scikit-image photograph at ``size`` with sensor-like noise (what a camera hands in)."""
    from pid_platform.demo.sample_data import load_photo

    im = load_photo(name).convert("RGB").resize(size, Image.Resampling.BICUBIC)
    rng = np.random.default_rng(sum(size))
    noisy = np.asarray(im).astype(np.int16) + rng.normal(0, 4, (size[1], size[0], 3)).astype(np.int16)
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def _jpeg(im: Image.Image, orientation: int) -> bytes:
    buf = io.BytesIO()
    kw = {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    im.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _reference(data: bytes, transform, rng) -> tuple[np.ndarray, object]:
    """A full decode + EXIF turn, then the plan's crop box and resize, in Pillow."""
    im = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    plan = transform(im.width, im.height, rng)
    if plan.is_crop:
        return np.asarray(im.crop(tuple(int(v) for v in plan.box))), plan
    return np.asarray(im.resize(plan.size, Image.Resampling.BILINEAR, box=plan.box)), plan


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


BACKENDS = ["libjpeg-turbo", "pillow-draft"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> bool:
    if request.param == "libjpeg-turbo":
        assert image_decode.native is not None, (
            "the loader.wds._jpeg extension is not built: install libjpeg62-turbo-dev and a C compiler, "
            "then pip install -e . (./dev setup does both)")
        return True
    return False


@pytest.mark.parametrize("orientation", range(1, 9))
def test_scaled_decode_is_within_resampling_of_a_full_decode(orientation: int, backend: bool) -> None:
    data = _jpeg(_photo("astronaut", (1600, 1200)), orientation)
    scales = set()
    for transform in (RandomResizedCrop(192, scale=(0.25, 1.0)), RandomResizedCrop((160, 224)),
                      Resize(300), Compose([Resize(400), CenterCrop(320)])):
        for k in range(4):
            want, plan = _reference(data, transform, random.Random(k))
            got = np.asarray(decode_planned(data, transform, random.Random(k), use_native=backend))
            assert got.shape == want.shape
            scales.add(pick_scale(plan))
            assert _psnr(got, want) >= 38.0, (orientation, transform, k, pick_scale(plan))
    assert scales >= {2, 4}  # the DCT-scaled decode was exercised, not only full ones


@pytest.mark.parametrize("orientation", range(1, 9))
def test_region_decode_is_bit_exact(orientation: int, backend: bool) -> None:
    data = _jpeg(_photo("coffee", (1203, 917)), orientation)  # sizes that are no multiple of a block
    for transform in (RandomCrop(256), RandomCrop((37, 411)), CenterCrop((500, 300)), RandomCrop(917)):
        for k in range(4):
            want, plan = _reference(data, transform, random.Random(k))
            assert pick_scale(plan) == 1
            got = np.asarray(decode_planned(data, transform, random.Random(k), use_native=backend))
            assert np.array_equal(got, want), (orientation, transform, k)


@pytest.mark.parametrize("kind", ["grayscale", "cmyk", "progressive"])
def test_other_jpeg_kinds_crop_bit_exact(kind: str, backend: bool) -> None:
    im = _photo("rocket", (700, 500))
    buf = io.BytesIO()
    if kind == "progressive":
        im.save(buf, "JPEG", quality=90, progressive=True)
    else:
        im.convert("L" if kind == "grayscale" else "CMYK").save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    for k in range(3):
        want, _ = _reference(data, RandomCrop((200, 300)), random.Random(k))
        got = np.asarray(decode_planned(data, RandomCrop((200, 300)), random.Random(k), use_native=backend))
        assert np.array_equal(got, want), (kind, k)


def test_a_truncated_jpeg_is_an_error_as_with_pillow(backend: bool) -> None:
    data = _jpeg(_photo("rocket", (700, 500)), 1)
    with pytest.raises((ValueError, OSError), match="truncated"):
        decode_planned(data[: len(data) // 2], Resize(100), random.Random(0), use_native=backend)


def test_a_crop_larger_than_the_image_pads_with_zeros_as_torchvision() -> None:
    data = _jpeg(_photo("coffee", (300, 200)), 1)
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    got = np.asarray(decode_planned(data, CenterCrop((204, 305)), random.Random(0)))
    assert got.shape == (204, 305, 3)
    # torchvision pads (crop - size) // 2 on the top/left and the rest on the bottom/right.
    assert np.array_equal(got[2:202, 2:302], full) and not got[:2].any() and not got[:, 302:].any()
    padded = np.asarray(decode_planned(data, RandomCrop(256, pad_if_needed=True), random.Random(3)))
    assert padded.shape == (256, 256, 3)
    with pytest.raises(ValueError, match="larger than input image size"):
        decode_planned(data, RandomCrop(256), random.Random(0))


def test_png_is_decoded_whole_then_transformed() -> None:
    im = _photo("chelsea", (451, 300))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    got = decode_planned(buf.getvalue(), RandomCrop(128), random.Random(1), output="numpy")
    plan = RandomCrop(128)(451, 300, random.Random(1))
    assert np.array_equal(got, np.asarray(im.crop(tuple(int(v) for v in plan.box))))
    t = decode_planned(buf.getvalue(), Resize(100), random.Random(1), output="tensor")
    assert t.shape == (3, 100, 150) and t.dtype == torch.uint8


# ----------------------------------------------------------------------------- sampling rules


def test_sampling_follows_torchvision() -> None:
    # Resize of an int: the shorter side; the longer one truncated as torchvision does.
    assert Resize(512).output_size(3840, 2160) == (910, 512)
    assert Resize(512).output_size(2160, 3840) == (512, 910)
    assert Resize([300, 200]).output_size(3840, 2160) == (200, 300)
    assert Resize(512, max_size=800).output_size(3840, 2160) == (800, 450)
    # CenterCrop rounds the offset; RandomCrop draws it inclusive at both ends.
    assert CenterCrop(100)(301, 201, random.Random(0)).box == (100.0, 50.0, 200.0, 150.0)
    lefts = {RandomCrop((10, 12))(14, 10, random.Random(k)).box[0] for k in range(200)}
    assert lefts == {0.0, 1.0, 2.0}
    # RandomResizedCrop: crops within (scale, ratio); a ratio no crop can meet falls back to the
    # center crop of the nearest allowed ratio after 10 tries.
    t = RandomResizedCrop(64, scale=(0.25, 0.5), ratio=(0.5, 2.0))
    for k in range(200):
        top, left, h, w = t.crop_box(3840, 2160, random.Random(k))
        assert 0.24 <= w * h / (3840 * 2160) <= 0.51 and 0.49 <= w / h <= 2.05
        assert 0 <= top <= 2160 - h and 0 <= left <= 3840 - w
    narrow = RandomResizedCrop(64, scale=(0.9, 1.0), ratio=(5.0, 6.0))
    assert narrow.crop_box(400, 300, random.Random(0)) == (110, 0, 80, 400)
    # The same (seed, epoch, key) gives the same numbers; another key others.
    assert sample_rng(1, 0, "a").random() == sample_rng(1, 0, "a").random() != sample_rng(1, 0, "b").random()


def test_bad_parameters_give_one_clear_error_at_build_dataset(built32: Path) -> None:
    root = str(built32)
    with pytest.raises(ImageTransformError, match=r"scale must be \(min, max\)"):
        build_dataset(root, image_transform=RandomResizedCrop(512, scale=(1.0, 0.25)))
    with pytest.raises(ImageTransformError, match="size must be"):
        build_dataset(root, image_transform=RandomCrop(0))
    with pytest.raises(ImageTransformError, match="interpolation must be one of"):
        build_dataset(root, image_transform=Resize(256, interpolation="cubic-ish"))
    with pytest.raises(ImageTransformError, match="antialias=False"):
        build_dataset(root, image_transform=Resize(256, antialias=False))
    with pytest.raises(ImageTransformError, match="other callables go in augment="):
        build_dataset(root, image_transform=lambda im: im)
    with pytest.raises(ImageTransformError, match="decode must be"):
        build_dataset(root, image_transform=Resize(256), decode="bytes")
    with pytest.raises(ImageTransformError, match="other callables"):  # before any manifest is looked for
        build_dataset(str(built32 / "no-such-folder"), image_transform="RandomCrop(64)")
    # A list is a composition.
    ds = build_dataset(root, modalities=["image"], decode="numpy", image_transform=[Resize(40), CenterCrop(32)])
    assert {s["image"].shape for s in ds} == {(32, 32, 3)}


# ----------------------------------------------------------------------------- the training example


def test_the_training_example_declares_its_image_size(built32: Path, tmp_path: Path) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "examples" / "train_policy.py"
    spec = importlib.util.spec_from_file_location("train_policy_image_size", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--data", "twin-tars", "--root", str(built32), "--checkpoint-dir", str(tmp_path), "--num-workers", "0",
            "--batch-size", "4"]
    with pytest.raises(SystemExit):
        example.parse_args([*argv, "--image-size", "8"])  # smaller than the letterbox: refused
    task = example.TwinTarTask(example.parse_args([*argv, "--image-size", "64"]), rank=0)
    transform = task.loader.dataset.decoder.image_transform
    assert isinstance(transform, Resize) and transform.size == [64]
    batch = next(iter(task.loader))
    assert batch["letterboxed"].shape == (4, 3, 32, 32)
    # The aspect target is the resized image's: within rounding of the photograph's own.
    for key, target in zip(batch["__key__"], batch["log_aspect"].tolist(), strict=True):
        w, h = (int(v) for v in key.rsplit("-", 1)[1].split("x"))
        assert abs(target - np.log(w / h)) < 0.05, key


# ----------------------------------------------------------------------------- decode="cuda"

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="checks the error where there is no GPU")
def test_decode_cuda_without_a_gpu_is_one_clear_error(built32: Path) -> None:
    from loader.wds.image_cuda import CudaDecodeUnavailable

    with pytest.raises(CudaDecodeUnavailable, match="needs a CUDA GPU.*use decode='tensor'"):
        build_dataset(str(built32), decode="cuda", image_transform=RRC)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_gpu_path_turns_crops_and_resizes_like_the_cpu_path(orientation: int) -> None:
    """The GPU path's tensor steps, run on the CPU: EXIF turns equal Pillow's, whole-pixel crops
    are exact, resizes close (torch's antialiased bilinear on the box's whole pixels)."""
    from loader.wds.image_cuda import apply_plan, turn

    data = _jpeg(_photo("astronaut", (640, 480)), orientation)
    stored = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
    method = image_decode.ORIENT.get(orientation)
    upright = turn(stored, method)
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert np.array_equal(upright.permute(1, 2, 0).numpy(), want)
    for transform, floor in ((RandomCrop(200), float("inf")), (CenterCrop(700), float("inf")),
                             (RandomResizedCrop(128, scale=(0.25, 1.0)), 28.0)):
        for k in range(3):
            ref, plan = _reference(data, transform, random.Random(k))
            got = apply_plan(upright, plan).permute(1, 2, 0).numpy()
            assert got.shape == ref.shape and _psnr(got, ref) >= floor, (transform, k, _psnr(got, ref))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (nvJPEG)")
def test_decode_cuda_gives_the_cpu_crops_on_the_gpu(built32: Path) -> None:
    cpu = {s["__key__"]: s["image"] for s in build_dataset(str(built32), modalities=["image"], decode="tensor",
                                                            image_transform=RRC, seed=SEED)}
    ds = build_dataset(str(built32), modalities=["image"], decode="cuda", image_transform=RRC, seed=SEED)
    with pytest.raises(ValueError, match="num_workers=0"):
        make_loader(ds, num_workers=2)
    seen = 0
    for s in ds:
        t = s["image"]
        assert t.is_cuda and t.dtype == torch.uint8 and t.shape == (3, 48, 48)
        assert _psnr(t.cpu().numpy(), cpu[s["__key__"]].numpy()) >= 28.0, s["__key__"]
        seen += 1
    assert seen == 32
