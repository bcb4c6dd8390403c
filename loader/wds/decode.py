"""Decoding, safe by default: no pickle and no torch.load of dataset bytes unless trusted."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from loader.wds.errors import DecodeError, UnsafeDataError
from loader.wds.image import ImageTransform, check_image_transform, sample_rng
from loader.wds.image_decode import decode_planned

IMAGE_EXTS = {"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif"}
PICKLE_EXTS = {"pkl", "pickle", "pt", "pth", "ckpt"}
CAPTION_FIELDS = ("prompt", "prompt_medium", "prompt_short")


class Decoder:
    """``{"__key__", "image.jpg": b"...", "caption.json": b"..."}`` -> ``{"image": PIL, "caption": str}``."""

    def __init__(
        self, image: str = "pil", caption_fields: Sequence[str] = CAPTION_FIELDS,
        caption_weights: Sequence[float] | None = None, trusted_data: bool = False, seed: int = 0,
        image_transform: ImageTransform | None = None,
    ):
        if image not in ("pil", "tensor", "numpy", "bytes", "cuda"):
            raise ValueError(f"image must be 'pil', 'tensor', 'numpy', 'bytes' or 'cuda', got {image!r}")
        if image == "cuda":  # nvJPEG; imported only when asked for
            from loader.wds.image_cuda import check_cuda

            check_cuda()
        self.image = image
        self.caption_fields = tuple(caption_fields)
        self.caption_weights = caption_weights
        self.trusted_data = trusted_data
        self.seed = seed
        self.image_transform = None if image_transform is None else check_image_transform(image_transform, image)

    def _image(self, data: bytes, sample: dict):
        if self.image == "bytes":
            return data
        rng = None
        if self.image_transform is not None:
            # Decoded at the size the transform keeps; its random numbers depend on (seed,
            # epoch, key) only (a mixture's repeat of a sample gets a crop of its own).
            rng = sample_rng(self.seed, sample.get("__epoch__"), str(sample.get("__key__")),
                             f"{sample.get('__source__', '')}:{sample.get('__repeat__', 0)}")
        if self.image == "cuda":
            from loader.wds.image_cuda import decode_cuda

            return decode_cuda(data, self.image_transform, rng)
        if rng is not None:
            return decode_planned(data, self.image_transform, rng, self.image)
        from PIL import Image, ImageOps

        im = Image.open(io.BytesIO(data))
        # The displayed image: the build buckets and indexes the size after EXIF orientation,
        # so the pixels handed on must be turned the same way (decode="bytes" keeps the file).
        # In place, and no convert to the mode it has: each would copy a 4K image (~10 ms).
        ImageOps.exif_transpose(im, in_place=True)
        im = im.convert("RGB") if im.mode != "RGB" else im
        if self.image == "pil":
            return im
        arr = np.asarray(im)
        if self.image == "numpy":
            return arr
        import torch

        return torch.from_numpy(arr.copy()).permute(2, 0, 1)

    def _caption(self, data: bytes, sample: dict) -> str:
        doc = json.loads(data)
        available = [f for f in self.caption_fields if isinstance(doc.get(f), str) and doc[f]]
        if not available:
            raise ValueError(f"sample {sample.get('__key__')!r}: caption has none of {self.caption_fields}")
        weights = None
        if self.caption_weights is not None:
            weights = [w for f, w in zip(self.caption_fields, self.caption_weights, strict=True) if f in available]
        # The choice depends on (seed, epoch, sample) only: a resumed run picks the same caption.
        rng = random.Random(f"{self.seed}:{sample.get('__epoch__')}:{sample.get('__shard__')}:{sample.get('__index__')}")
        return doc[rng.choices(available, weights=weights)[0]]

    def _value(self, name: str, ext: str, data: bytes, sample: dict) -> Any:
        last = ext.rsplit(".", 1)[-1].lower()
        if last in IMAGE_EXTS:
            return self._image(data, sample)
        if last == "json":
            return self._caption(data, sample) if "caption" in name else json.loads(data)
        if last == "npy":
            try:
                return np.load(io.BytesIO(data), allow_pickle=self.trusted_data)
            except ValueError as exc:
                if "pickle" not in str(exc):
                    raise  # a truncated or corrupt array: reported as a DecodeError below
                raise UnsafeDataError(
                    f"sample {sample.get('__key__')!r}: {name}.{ext} holds an object array (pickle); "
                    "pass trusted_data=True only for data you trust"
                ) from exc
        if last in ("txt", "text"):
            return data.decode("utf-8")
        if last in PICKLE_EXTS:
            if not self.trusted_data:
                raise UnsafeDataError(
                    f"sample {sample.get('__key__')!r}: member {name}.{ext} would be loaded with pickle; "
                    "refused - convert it to .npy, or pass trusted_data=True for data you trust"
                )
            if last in ("pkl", "pickle"):
                import pickle

                return pickle.loads(data)  # noqa: S301 - trusted_data=True was asked for
            import torch

            return torch.load(io.BytesIO(data), weights_only=False)
        return data

    def __call__(self, sample: dict) -> dict:
        out = {k: v for k, v in sample.items() if k.startswith("__")}
        for field, data in sample.items():
            if field.startswith("__"):
                continue
            name, _, ext = field.partition(".")
            try:
                out[name] = self._value(name, ext, data, sample)
            except (UnsafeDataError, DecodeError):
                raise
            except Exception as exc:
                raise DecodeError(
                    f"sample {sample.get('__key__')!r} (shard {sample.get('__shard__')}, member "
                    f"{sample.get('__index__')}): cannot decode {field} (member {sample.get('__key__')}.{ext} "
                    f"of the {name} tar): {type(exc).__name__}: {exc}"
                ) from exc
        return out
