"""Full image validation decodes every JPEG layout's entropy-coded data, and refuses a cut one."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pid_platform.sharding.intake.file_checks import (
    VALIDATE_FULL,
    VALIDATE_HEADER,
    ImageInfo,
    check_image,
)

W, H = 96, 64


def _noise(mode: str) -> Image.Image:
    bands = len(Image.new(mode, (1, 1)).getbands())
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (H, W, bands) if bands > 1 else (H, W), dtype=np.uint8)
    return Image.fromarray(arr, mode)


def _rgb_components(data: bytes) -> bytes:
    """The same baseline JPEG with component ids 'R', 'G', 'B': libjpeg then reads it as RGB,
    not YCbCr (what Adobe-tagged RGB JPEGs amount to)."""
    d = bytearray(data)
    sof, sos = d.find(b"\xff\xc0"), d.find(b"\xff\xda")
    for k, c in enumerate(b"RGB"):
        d[sof + 10 + 3 * k] = c
        d[sos + 5 + 2 * k] = c
    return bytes(d)


def _jpeg(layout: str) -> bytes:
    buf = io.BytesIO()
    if layout == "grey":
        _noise("L").save(buf, "JPEG", quality=90)
    elif layout == "cmyk":
        _noise("CMYK").save(buf, "JPEG", quality=90)
    elif layout == "progressive":
        _noise("RGB").save(buf, "JPEG", quality=90, progressive=True)
    else:
        _noise("RGB").save(buf, "JPEG", quality=90, subsampling=0 if layout == "rgb_ids" else 2)
    return _rgb_components(buf.getvalue()) if layout == "rgb_ids" else buf.getvalue()


LAYOUTS = ["ycbcr_420", "grey", "rgb_ids", "cmyk", "progressive"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_validation_decodes_every_jpeg_layout(layout: str) -> None:
    assert check_image(_jpeg(layout), VALIDATE_FULL) == ImageInfo(W, H)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_validation_refuses_a_cut_jpeg_the_header_check_passes(layout: str) -> None:
    data = _jpeg(layout)
    cut = data[: len(data) * 2 // 3]
    assert check_image(cut, VALIDATE_HEADER) == ImageInfo(W, H)
    reason = check_image(cut, VALIDATE_FULL)
    assert isinstance(reason, str) and reason.startswith("unreadable_image"), reason
