"""Image transforms declared to the loader: torchvision's names, parameters and sampling.

``build_dataset(image_transform=RandomResizedCrop(512, scale=(0.25, 1)))`` tells the decoder
what part of each image training keeps, so that it decodes only that (``image_decode.py``: a
JPEG at a DCT scale, only the crop's rows and columns). The classes here mirror
``torchvision.transforms.v2`` (``Resize``, ``CenterCrop``, ``RandomCrop``,
``RandomResizedCrop``, and ``Compose`` of them) on the EXIF-corrected image, with two
differences: they only *plan* (a crop box in the image and an output size, :class:`Plan`), and
their random numbers come from the generator the decoder seeds with (seed, epoch, sample key)
(:func:`sample_rng`), never from torch's global RNG - so a resumed run, any world size and any
``num_workers`` crop a sample the same way. torchvision is not imported (it does not load next
to the CPU build of torch); the sampling follows its source (``transforms/v2/_geometry.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


class ImageTransformError(ValueError):
    """A transform was given parameters it cannot work with; says which and what to pass."""


@dataclass(frozen=True)
class Plan:
    """What to hand on: the part ``box`` = (x0, y0, x1, y1) of the displayed (EXIF-corrected)
    image, in its pixels (fractions after a resize; outside the image where a crop pads with
    zeros), resampled to ``size`` = (width, height) with ``interpolation``."""

    box: tuple[float, float, float, float]
    size: tuple[int, int]
    interpolation: str = "bilinear"

    @classmethod
    def whole(cls, width: int, height: int) -> Plan:
        return cls((0.0, 0.0, float(width), float(height)), (width, height))

    def crop(self, left: int, top: int, width: int, height: int) -> Plan:
        """Crop the current (virtual) image at integer pixels of it."""
        x0, y0, x1, y1 = self.box
        sx, sy = (x1 - x0) / self.size[0], (y1 - y0) / self.size[1]
        nx0, ny0 = x0 + left * sx, y0 + top * sy
        return Plan((nx0, ny0, nx0 + width * sx, ny0 + height * sy), (width, height), self.interpolation)

    def resize(self, width: int, height: int, interpolation: str) -> Plan:
        return Plan(self.box, (width, height), interpolation)

    @property
    def is_crop(self) -> bool:
        """The box is whole pixels of the displayed image and its size the output's: no resampling."""
        x0, y0, x1, y1 = self.box
        return (all(float(v).is_integer() for v in self.box)
                and (round(x1 - x0), round(y1 - y0)) == self.size)


def sample_rng(seed: int, epoch: int | None, key: str, extra: str = "") -> random.Random:
    """The generator of one sample's random image parameters: a pure function of (seed, epoch,
    sample key) - not of the order of reading, the worker, the rank or the world size."""
    return random.Random(f"image:{seed}:{epoch}:{key}:{extra}")


def _size_pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    """torchvision's ``_setup_size``: an int or a one-element sequence is square; (h, w) else."""
    if isinstance(size, bool):
        raise ImageTransformError(f"{what}: size must be an int or (height, width), got {size!r}")
    if isinstance(size, int):
        pair = (size, size)
    elif isinstance(size, Sequence) and len(size) in (1, 2) and all(isinstance(v, int) and not isinstance(v, bool) for v in size):
        pair = (size[0], size[0]) if len(size) == 1 else (size[0], size[1])
    else:
        raise ImageTransformError(f"{what}: size must be an int or (height, width) of ints, got {size!r}")
    if min(pair) < 1:
        raise ImageTransformError(f"{what}: size must be positive, got {size!r}")
    return pair


def _interpolation(value: str, what: str) -> str:
    name = getattr(value, "name", value)  # PIL's Resampling or torchvision's InterpolationMode
    name = str(name).lower()
    if name not in INTERPOLATIONS:
        raise ImageTransformError(f"{what}: interpolation must be one of {INTERPOLATIONS}, got {value!r}")
    return name


def _antialias(value: bool | None, what: str) -> None:
    # Pillow always antialiases when it shrinks (torchvision says so for PIL images too).
    if value is False:
        raise ImageTransformError(f"{what}: antialias=False is not supported: the loader resamples with "
                                  "Pillow, which always antialiases; leave antialias at True")


class ImageTransform:
    """A geometric transform the decoder can plan before decoding (see the module docstring)."""

    def plan(self, plan: Plan, rng: random.Random) -> Plan:
        raise NotImplementedError

    def __call__(self, width: int, height: int, rng: random.Random) -> Plan:
        """The plan for a displayed image of ``width`` x ``height``."""
        return self.plan(Plan.whole(width, height), rng)


class Resize(ImageTransform):
    """``Resize(size)``: an int matches the shorter side (the longer one ``int(size * long /
    short)``, capped by ``max_size``), (h, w) is the output size."""

    def __init__(self, size: int | Sequence[int], interpolation: str = "bilinear", max_size: int | None = None,
                 antialias: bool | None = True):
        if isinstance(size, int) and not isinstance(size, bool):
            size = [size]
        if not (isinstance(size, Sequence) and len(size) in (1, 2)
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
            raise ImageTransformError(f"Resize: size must be a positive int or (height, width), got {size!r}")
        if max_size is not None and (len(size) != 1 or max_size <= size[0]):
            raise ImageTransformError(f"Resize: max_size={max_size!r} needs an int size smaller than it, got {size!r}")
        self.size = list(size)
        self.max_size = max_size
        self.interpolation = _interpolation(interpolation, "Resize")
        _antialias(antialias, "Resize")

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the resize (torchvision's ``_compute_resized_output_size``)."""
        if len(self.size) == 2:
            return self.size[1], self.size[0]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size[0], int(self.size[0] * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def plan(self, plan: Plan, rng: random.Random) -> Plan:
        w, h = self.output_size(*plan.size)
        if (w, h) == plan.size:
            return plan  # torchvision returns the image untouched
        return plan.resize(w, h, self.interpolation)

    def __repr__(self) -> str:
        return f"Resize(size={self.size}, interpolation={self.interpolation!r}, max_size={self.max_size})"


class CenterCrop(ImageTransform):
    """``CenterCrop(size)``: pads with zeros where the image is smaller (as torchvision)."""

    def __init__(self, size: int | Sequence[int]):
        self.size = _size_pair(size, "CenterCrop")

    def plan(self, plan: Plan, rng: random.Random) -> Plan:
        ch, cw = self.size
        w, h = plan.size
        # torchvision pads (crop - image) // 2 on the left/top first, then crops at the center.
        left = -((cw - w) // 2) if cw > w else int(round((w - cw) / 2.0))
        top = -((ch - h) // 2) if ch > h else int(round((h - ch) / 2.0))
        return plan.crop(left, top, cw, ch)

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


class RandomCrop(ImageTransform):
    """``RandomCrop(size, pad_if_needed=False)``: a crop at a random place; an image smaller
    than the crop is an error, or padded with zeros by ``pad_if_needed`` (torchvision's
    ``padding``/``fill``/``padding_mode`` belong in ``augment=``)."""

    def __init__(self, size: int | Sequence[int], pad_if_needed: bool = False):
        self.size = _size_pair(size, "RandomCrop")
        self.pad_if_needed = bool(pad_if_needed)

    def plan(self, plan: Plan, rng: random.Random) -> Plan:
        ch, cw = self.size
        w, h = plan.size
        pad_x = pad_y = 0
        if self.pad_if_needed:  # torchvision pads the difference on both sides
            pad_x, pad_y = max(0, cw - w), max(0, ch - h)
        pw, ph = w + 2 * pad_x, h + 2 * pad_y
        if ch > ph or cw > pw:
            raise ValueError(f"RandomCrop: required crop size {(ch, cw)} is larger than input image size {(h, w)}; "
                             "pass pad_if_needed=True or a smaller size")
        top = rng.randint(0, ph - ch) if ph > ch else 0
        left = rng.randint(0, pw - cw) if pw > cw else 0
        return plan.crop(left - pad_x, top - pad_y, cw, ch)

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, pad_if_needed={self.pad_if_needed})"


class RandomResizedCrop(ImageTransform):
    """``RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3))``: 10 tries of an area
    fraction drawn uniformly in ``scale`` and an aspect ratio drawn uniformly in log space, then
    the center crop of the nearest allowed ratio; the crop is resized to ``size``."""

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0), interpolation: str = "bilinear",
                 antialias: bool | None = True):
        self.size = _size_pair(size, "RandomResizedCrop")
        for name, pair in (("scale", scale), ("ratio", ratio)):
            if not (isinstance(pair, Sequence) and len(pair) == 2 and all(isinstance(v, int | float) for v in pair)):
                raise ImageTransformError(f"RandomResizedCrop: {name} must be (min, max), got {pair!r}")
        # torchvision only warns here; a silently inverted range is a bug in a training config.
        if not (0 < scale[0] <= scale[1]):
            raise ImageTransformError(f"RandomResizedCrop: scale must be (min, max) with 0 < min <= max, got {tuple(scale)!r}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ImageTransformError(f"RandomResizedCrop: ratio must be (min, max) with 0 < min <= max, got {tuple(ratio)!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = _interpolation(interpolation, "RandomResizedCrop")
        _antialias(antialias, "RandomResizedCrop")
        self._log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))

    def crop_box(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        """(top, left, height, width) of the crop (torchvision's ``_get_params``)."""
        area = height * width
        for _ in range(10):
            target_area = area * rng.uniform(*self.scale)
            aspect_ratio = math.exp(rng.uniform(*self._log_ratio))
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def plan(self, plan: Plan, rng: random.Random) -> Plan:
        top, left, h, w = self.crop_box(plan.size[0], plan.size[1], rng)
        out_h, out_w = self.size
        cropped = plan.crop(left, top, w, h)
        if (w, h) == (out_w, out_h):
            return cropped
        return cropped.resize(out_w, out_h, self.interpolation)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class Compose(ImageTransform):
    """Several of the above, in order (e.g. ``Compose([Resize(1024), CenterCrop(896)])``)."""

    def __init__(self, transforms: Sequence[ImageTransform]):
        transforms = list(transforms)
        bad = [t for t in transforms if not isinstance(t, ImageTransform)]
        if not transforms or bad:
            raise ImageTransformError(f"Compose: needs loader.wds.image transforms, got {bad or transforms!r}")
        self.transforms = transforms

    def plan(self, plan: Plan, rng: random.Random) -> Plan:
        for t in self.transforms:
            plan = t.plan(plan, rng)
        return plan

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


def check_image_transform(transform: object, decode: str | None) -> ImageTransform:
    """``build_dataset``'s check: one clear error before any worker starts."""
    if isinstance(transform, Sequence) and not isinstance(transform, str):
        transform = Compose(transform)
    if not isinstance(transform, ImageTransform):
        raise ImageTransformError(
            f"image_transform must be a loader.wds.image transform (Resize, CenterCrop, RandomCrop, "
            f"RandomResizedCrop or a Compose/list of them), got {transform!r}; other callables go in augment=")
    if decode not in ("pil", "numpy", "tensor", "cuda"):
        raise ImageTransformError(f"image_transform needs decoded images: decode must be 'pil', 'numpy', "
                                  f"'tensor' or 'cuda', got decode={decode!r}")
    return transform
