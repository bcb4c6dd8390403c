"""Decoding an image at the size its planned transform keeps (``image.py``'s :class:`Plan`).

A JPEG is decoded at the largest DCT reduction (1/2, 1/4, 1/8) that keeps the crop at or above
the output size, and only the crop's rows and columns of it: through libjpeg-turbo's libjpeg
API (``_jpeg.c``: ``jpeg_skip_scanlines``/``jpeg_crop_scanline``) where the extension was
built, else through Pillow's ``draft`` (the DCT scaling without the region). The EXIF
orientation is applied to the plan's box before the region is placed, the region is then turned
like the image, and resampled to the output size with Pillow; a plan that is a whole-pixel crop
of the right size is handed on without resampling (bit-exact against a full decode + crop).
Other formats are decoded whole, then cropped and resized the same way.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from loader.wds.image import Plan

try:  # the optional extension (pyproject's ext-modules): Pillow's draft where it is missing
    from loader.wds import _jpeg as native
except ImportError:  # pragma: no cover - depends on the build
    native = None

# ImageOps.exif_transpose's table: EXIF orientation -> the transpose that displays the image.
ORIENT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
          5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
          8: Image.Transpose.ROTATE_90}
INVERSE = {Image.Transpose.ROTATE_90: Image.Transpose.ROTATE_270, Image.Transpose.ROTATE_270: Image.Transpose.ROTATE_90}
SCALES = (8, 4, 2, 1)
MARGIN = 2  # scaled pixels decoded around the region: the chroma upsampling of its edge pixels needs them
RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
            "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS,
            "box": Image.Resampling.BOX, "hamming": Image.Resampling.HAMMING}
Box = tuple[float, float, float, float]


def _map_point(method: Image.Transpose, x: float, y: float, w: float, h: float) -> tuple[float, float]:
    """Where a point of a ``w`` x ``h`` image lands after ``method`` (pixel-edge coordinates)."""
    T = Image.Transpose
    return {T.FLIP_LEFT_RIGHT: (w - x, y), T.FLIP_TOP_BOTTOM: (x, h - y), T.ROTATE_180: (w - x, h - y),
            T.TRANSPOSE: (y, x), T.ROTATE_90: (y, w - x), T.ROTATE_270: (h - y, x),
            T.TRANSVERSE: (h - y, w - x)}[method]


def map_box(method: Image.Transpose | None, box: Box, w: float, h: float) -> Box:
    """``box`` of a ``w`` x ``h`` image, after ``method`` turned the image."""
    if method is None:
        return box
    ax, ay = _map_point(method, box[0], box[1], w, h)
    bx, by = _map_point(method, box[2], box[3], w, h)
    return min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)


def pick_scale(plan: Plan) -> int:
    """The largest DCT reduction that keeps the box at or above the output size (never fewer
    pixels than the output asks for)."""
    x0, y0, x1, y1 = plan.box
    bw, bh = x1 - x0, y1 - y0
    for s in SCALES:
        if bw / s >= plan.size[0] and bh / s >= plan.size[1]:
            return s
    return 1


def _shown_size(method: Image.Transpose | None, W: int, H: int) -> tuple[int, int]:
    """The displayed size of a ``W`` x ``H`` file turned by ``method``."""
    swaps = (Image.Transpose.TRANSPOSE, Image.Transpose.TRANSVERSE, Image.Transpose.ROTATE_90,
             Image.Transpose.ROTATE_270)
    return (H, W) if method in swaps else (W, H)


def _orientation(im: Image.Image) -> Image.Transpose | None:
    try:
        return ORIENT.get(im.getexif().get(0x0112, 1))
    except Exception:  # an unreadable EXIF block: ImageOps.exif_transpose ignores it too
        return None


def decode_planned(data: bytes, transform: Any, rng: Any, output: str = "pil", *, use_native: bool = True) -> Any:
    """``data`` decoded as ``transform`` (an ``image.ImageTransform``) plans it with ``rng``,
    as ``output`` asks (``pil``, ``numpy`` HWC uint8, ``tensor`` CHW uint8)."""
    im = Image.open(io.BytesIO(data))
    method = _orientation(im)
    W, H = im.size
    plan = transform(*_shown_size(method, W, H), rng)
    if im.format == "JPEG":
        region, rel = _jpeg_region(im, data, plan, method, W, H, use_native)
    else:
        region = ImageOps.exif_transpose(im).convert("RGB")
        rel = plan.box
    return _convert(_finish(region, rel, plan), output)


def _jpeg_region(im: Image.Image, data: bytes, plan: Plan, method: Image.Transpose | None, W: int, H: int,
                 use_native: bool) -> tuple[Image.Image, Box]:
    """The displayed region of the JPEG that ``plan`` needs, at its DCT scale, and the plan's box
    relative to it (in the region's pixels)."""
    s = pick_scale(plan)
    while s > 1 and min(W, H) < s:  # a padded box around a tiny image: no reduction below one pixel
        s //= 2
    inverse = INVERSE.get(method, method) if method is not None else None
    stored = map_box(inverse, plan.box, *_shown_size(method, W, H))  # the box in the file's own pixels
    sw, sh = -(-W // s), -(-H // s)  # libjpeg's scaled size: ceil
    x0 = min(max(0, math.floor(stored[0] / s) - MARGIN), sw - 1)
    y0 = min(max(0, math.floor(stored[1] / s) - MARGIN), sh - 1)
    x1 = max(min(sw, math.ceil(stored[2] / s) + MARGIN), x0 + 1)
    y1 = max(min(sh, math.ceil(stored[3] / s) + MARGIN), y0 + 1)
    region = None
    if use_native and native is not None and im.mode in ("RGB", "L"):
        try:
            px, width, height, xoff = native.decode(data, s, x0, y0, x1 - x0, y1 - y0)
        except native.UnsupportedJpeg:
            pass
        else:
            rows = np.frombuffer(px, np.uint8).reshape(height, width, 3)
            region = Image.fromarray(np.ascontiguousarray(rows[:, x0 - xoff : x1 - xoff]))
    if region is None:
        # Pillow picks the scale from the size it is asked for (floor of the ratio).
        im.draft("RGB", (W // s, H // s))
        if im.size != (sw, sh):
            raise ValueError(f"Pillow's draft decoded {im.size} for {(W, H)} at 1/{s}, expected {(sw, sh)}")
        region = im.crop((x0, y0, x1, y1)).convert("RGB")
    rel = (stored[0] / s - x0, stored[1] / s - y0, stored[2] / s - x0, stored[3] / s - y0)
    if method is not None:
        rel = map_box(method, rel, region.width, region.height)
        region = region.transpose(method)
    return region, rel


def _finish(region: Image.Image, rel: Box, plan: Plan) -> Image.Image:
    """``rel`` of ``region`` at the plan's output size: cropped where that is all the plan asks
    (exact pixels), padded with zeros where the box leaves the image, resampled otherwise."""
    x0, y0, x1, y1 = rel
    inside = x0 >= 0 and y0 >= 0 and x1 <= region.width and y1 <= region.height
    if not inside:
        # A crop larger than the image (CenterCrop, RandomCrop(pad_if_needed=True)): zeros around.
        ix0, iy0, ix1, iy1 = (round(v) for v in rel)
        canvas = Image.new("RGB", (ix1 - ix0, iy1 - iy0))
        canvas.paste(region, (-ix0, -iy0))
        region, rel = canvas, (0.0, 0.0, float(canvas.width), float(canvas.height))
        x0, y0, x1, y1 = rel
    whole = all(float(v).is_integer() for v in rel)
    if whole and (round(x1 - x0), round(y1 - y0)) == plan.size:
        if rel == (0.0, 0.0, float(region.width), float(region.height)):
            return region
        return region.crop(tuple(int(v) for v in rel))
    return region.resize(plan.size, RESAMPLE[plan.interpolation], box=rel)


def _convert(im: Image.Image, output: str) -> Any:
    if output == "pil":
        return im
    arr = np.asarray(im)
    if output == "numpy":
        return arr
    import torch

    return torch.from_numpy(arr.copy()).permute(2, 0, 1)
