"""``decode="cuda"``: JPEGs decoded by nvJPEG on the GPU, in the training process.

Imported only when ``decode="cuda"`` is asked for. The plan is the CPU path's (``image.py``: the
same sampling from (seed, epoch, key), on the EXIF-corrected size read from the header); the
JPEG is decoded whole by ``torchvision.io.decode_jpeg(device="cuda")`` (nvJPEG), turned, cropped
and resized on the GPU (bilinear, antialiased, ``torch.nn.functional.interpolate``). Other
formats take the CPU path and are moved to the GPU. CUDA tensors cannot leave DataLoader worker
processes safely, so ``make_loader`` refuses workers with ``decode="cuda"``.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from loader.wds.errors import LoaderError
from loader.wds.image import Plan
from loader.wds.image_decode import ORIENT


class CudaDecodeUnavailable(LoaderError):
    """decode='cuda' was asked for where there is no CUDA GPU or no nvJPEG (torchvision)."""


def check_cuda() -> None:
    """One clear error at ``build_dataset`` where GPU decoding cannot work."""
    if not torch.cuda.is_available():
        raise CudaDecodeUnavailable(
            "decode='cuda' needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); use decode='tensor' (CPU, decoded at the transform's size)")
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as exc:  # ImportError, or a torchvision whose C ops do not load with this torch
        raise CudaDecodeUnavailable(
            f"decode='cuda' decodes with nvJPEG through torchvision.io.decode_jpeg, which does not import here "
            f"({type(exc).__name__}: {exc}); install the torchvision built for torch {torch.__version__} with CUDA"
        ) from exc


def turn(t: torch.Tensor, method: Image.Transpose | None) -> torch.Tensor:
    """A (C, H, W) tensor turned as Pillow's ``transpose(method)`` turns an image."""
    T = Image.Transpose
    if method is None:
        return t
    if method == T.FLIP_LEFT_RIGHT:
        return t.flip(-1)
    if method == T.FLIP_TOP_BOTTOM:
        return t.flip(-2)
    if method == T.ROTATE_180:
        return t.flip(-2, -1)
    if method == T.TRANSPOSE:
        return t.transpose(-2, -1)
    if method == T.ROTATE_90:  # counter-clockwise
        return torch.rot90(t, 1, dims=(-2, -1))
    if method == T.ROTATE_270:
        return torch.rot90(t, -1, dims=(-2, -1))
    return t.transpose(-2, -1).flip(-2, -1)  # TRANSVERSE


def apply_plan(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The plan's box of a displayed (C, H, W) uint8 tensor at its output size: a slice where it is a
    whole-pixel crop of that size, zeros where it leaves the image, else an antialiased resize of
    the whole pixels the box covers."""
    x0, y0, x1, y1 = plan.box
    if plan.interpolation != "bilinear":
        raise ValueError(f"decode='cuda' resizes bilinearly; got interpolation={plan.interpolation!r}")
    ix0, iy0, ix1, iy1 = math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1)
    h, w = t.shape[-2:]
    if ix0 < 0 or iy0 < 0 or ix1 > w or iy1 > h:
        canvas = t.new_zeros((t.shape[0], iy1 - iy0, ix1 - ix0))
        sx0, sy0 = max(ix0, 0), max(iy0, 0)
        sx1, sy1 = min(ix1, w), min(iy1, h)
        canvas[:, sy0 - iy0 : sy1 - iy0, sx0 - ix0 : sx1 - ix0] = t[:, sy0:sy1, sx0:sx1]
        region = canvas
    else:
        region = t[:, iy0:iy1, ix0:ix1]
    if region.shape[-1] == plan.size[0] and region.shape[-2] == plan.size[1]:
        return region.contiguous()
    out = torch.nn.functional.interpolate(region.unsqueeze(0).float(), size=(plan.size[1], plan.size[0]),
                                          mode="bilinear", antialias=True, align_corners=False)
    return out.squeeze(0).round_().clamp_(0, 255).to(torch.uint8)


def decode_cuda(data: bytes, transform: Any, rng: Any, device: str = "cuda") -> torch.Tensor:
    """A (C, H, W) uint8 tensor on ``device``: a JPEG decoded by nvJPEG (other images on the CPU),
    turned upright, then planned by ``transform`` (None: the whole image)."""
    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG" and im.mode in ("RGB", "L"):
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            method = ORIENT.get(im.getexif().get(0x0112, 1))
        except Exception:  # an unreadable EXIF block: ImageOps.exif_transpose ignores it too
            method = None
        t = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, device=device)
        t = turn(t, method)
    else:
        upright = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
        t = torch.from_numpy(upright.copy()).permute(2, 0, 1).to(device)
    if transform is None:
        return t
    return apply_plan(t, transform(t.shape[-1], t.shape[-2], rng))
