"""Per-file checks run at intake: each returns a drop reason, or raises for unsafe input."""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass

from PIL import Image

from pid_platform.build.errors import UnsafeInputError

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif"})
CAPTION_EXTS = frozenset({"json"})
# Loading these runs pickle (torch.load included), so they are refused unless trusted.
PICKLE_EXTS = frozenset({"pkl", "pickle", "pt", "pth", "ckpt"})
PICKLE_MAGIC = b"\x80"  # PROTO opcode that starts every pickle of protocol >= 2
PICKLE_SNIFF_BYTES = 256  # the magic byte, and a .npy header's dtype


def ext_of(name: str) -> str:
    return name.rsplit(".", 1)[1].lower() if "." in name else ""


def stem_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass(frozen=True)
class ImageInfo:
    width: int
    height: int


def check_image(data: bytes) -> ImageInfo | str:
    """Decode the image fully (at reduced scale where the codec allows) to catch truncation.

    Returns displayed width/height (EXIF orientation applied) or a reason string.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            orientation = im.getexif().get(0x0112, 1)
            # JPEG draft decodes every entropy-coded byte at 1/8 scale: truncation still fails.
            im.draft("RGB", (max(1, w // 8), max(1, h // 8)))
            im.load()
    except Exception as exc:  # PIL raises many types for bad data
        return f"unreadable_image: {type(exc).__name__}: {exc}"
    if orientation in (5, 6, 7, 8):  # rotated by 90 or 270 degrees
        w, h = h, w
    return ImageInfo(w, h)


def check_caption(data: bytes) -> str | None:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"bad_caption: not JSON ({exc})"
    if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str) or not doc["prompt"].strip():
        return "bad_caption: no non-empty string 'prompt'"
    return None


def check_pickle(name: str, data: bytes, describe: str, trust_pickle: bool) -> None:
    if trust_pickle:
        return
    ext = ext_of(name)
    looks_pickled = ext in PICKLE_EXTS or (ext not in IMAGE_EXTS | CAPTION_EXTS and data[:1] == PICKLE_MAGIC)
    if ext == "npy" and b"'descr': '|O'" in data[:PICKLE_SNIFF_BYTES]:
        looks_pickled = True  # object arrays in .npy are stored as pickle
    if looks_pickled:
        raise UnsafeInputError(
            f"{describe}: pickle data in an embedding folder; loading it can run arbitrary code. "
            "Convert it to .npy (numeric dtype) or .safetensors, or pass --trust-pickle "
            "(trust_pickle=True) if this data comes from a source you trust."
        )
