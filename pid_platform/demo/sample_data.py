"""A small raw drop made of real photographs (scikit-image's bundled ones) for demos and tests.

Each photograph is centre-cropped to several aspect ratios and saved as JPEG or PNG under
``image/``, with a generated caption under ``caption/`` and a float16 embedding under
``umt5/``. ``with_problems`` adds the kinds of bad input a real drop has, so a build shows
what it drops and why.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina",
    "immunohistochemistry", "camera", "moon", "brick", "grass", "coins", "clock",
)
RATIOS = ((21, 9), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16))


def load_photo(name: str) -> Image.Image:
    import skimage.data

    arr = getattr(skimage.data, name)()
    if arr.dtype != np.uint8:
        arr = (arr.astype(np.float64) / max(arr.max(), 1) * 255).astype(np.uint8)
    im = Image.fromarray(arr)
    return im.convert("RGB")


def center_crop(im: Image.Image, rw: int, rh: int) -> Image.Image:
    w, h = im.size
    if w * rh > h * rw:  # too wide
        nw = h * rw // rh
        left = (w - nw) // 2
        return im.crop((left, 0, left + nw, h))
    nh = w * rh // rw
    top = (h - nh) // 2
    return im.crop((0, top, w, top + nh))


def embedding_of(im: Image.Image) -> np.ndarray:
    small = np.asarray(im.convert("L").resize((64, 8), Image.BILINEAR), dtype=np.float32) / 255.0
    return small.astype(np.float16)


def caption_of(photo: str, rw: int, rh: int, size: tuple[int, int]) -> dict:
    subject = photo.replace("_", " ")
    return {
        "prompt": f"A photograph of {subject}, centre-cropped to a {rw}:{rh} frame of {size[0]}x{size[1]} pixels.",
        "prompt_medium": f"Photograph of {subject}, {rw}:{rh}.",
        "prompt_short": subject,
    }


def _encode(im: Image.Image, fmt: str, exif_orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        exif = None
        if exif_orientation:
            ex = Image.Exif()
            ex[0x0112] = exif_orientation
            exif = ex.tobytes()
        im.save(buf, "JPEG", quality=90, **({"exif": exif} if exif else {}))
    else:
        im.save(buf, "PNG", optimize=False)
    return buf.getvalue()


def make_sample_source(
    root: str | Path, photos: tuple[str, ...] = PHOTOS, ratios: tuple[tuple[int, int], ...] = RATIOS,
    with_problems: bool = True,
) -> Path:
    """Write a raw drop to ``root`` (``image/``, ``caption/``, ``umt5/``); return ``root``."""
    root = Path(root)
    for m in ("image", "caption", "umt5"):
        (root / m).mkdir(parents=True, exist_ok=True)
    for pi, photo in enumerate(photos):
        base = load_photo(photo)
        for ri, (rw, rh) in enumerate(ratios):
            im = center_crop(base, rw, rh)
            stem = f"{photo}-{rw}x{rh}"
            fmt = "PNG" if (pi + ri) % 5 == 0 else "JPEG"
            ext = "png" if fmt == "PNG" else "jpg"
            (root / "image" / f"{stem}.{ext}").write_bytes(_encode(im, fmt))
            (root / "caption" / f"{stem}.json").write_text(json.dumps(caption_of(photo, rw, rh, im.size)))
            np.save(root / "umt5" / f"{stem}.npy", embedding_of(im))
    if with_problems:
        _add_problems(root, photos[0])
    return root


def _add_problems(root: Path, photo: str) -> None:
    im = center_crop(load_photo(photo), 16, 9)
    # A landscape picture whose pixels are stored portrait, with EXIF orientation 6 (rotate on
    # display): it must land in the 16:9 bucket, not 9:16.
    (root / "image" / "rotated.exif6.jpg").write_bytes(_encode(im.transpose(Image.Transpose.ROTATE_90), "JPEG", 6))
    (root / "caption" / "rotated.exif6.json").write_text(json.dumps({"prompt": "A photograph stored sideways."}))
    np.save(root / "umt5" / "rotated.exif6.npy", embedding_of(im))
    # A truncated JPEG (a download cut short).
    data = _encode(im, "JPEG")
    (root / "image" / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (root / "caption" / "truncated.json").write_text(json.dumps({"prompt": "cut short"}))
    np.save(root / "umt5" / "truncated.npy", embedding_of(im))
    # A caption without a prompt.
    (root / "image" / "no-prompt.jpg").write_bytes(data)
    (root / "caption" / "no-prompt.json").write_text(json.dumps({"text": "wrong field"}))
    np.save(root / "umt5" / "no-prompt.npy", embedding_of(im))
    # An image whose caption never arrived.
    (root / "image" / "orphan.jpg").write_bytes(data)
    np.save(root / "umt5" / "orphan.npy", embedding_of(im))
