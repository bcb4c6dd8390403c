"""Per-file checks run at intake: each returns a drop reason, or raises for unsafe input."""

from __future__ import annotations

import io
import json
import pickletools
import threading
import warnings
from dataclasses import dataclass

from numpy.lib import format as npy_format
from PIL import Image

from pid_platform.sharding.errors import UnsafeInputError

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif"})
CAPTION_EXTS = frozenset({"json", "txt"})
# Loading these runs pickle (torch.load included), so they are refused unless trusted.
PICKLE_EXTS = frozenset({"pkl", "pickle", "pt", "pth", "ckpt"})
PICKLE_SNIFF_BYTES = 256  # enough opcodes to recognise a pickle stream; most .npy headers
NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_HEADER = 10000  # np.load's own limit without allow_pickle: a longer header never loads
# pickletools' messages when the bytes run out mid-stream (a pickle longer than the sniffed head),
# as opposed to an unknown opcode or an impossible stack (bytes that are not a pickle).
_TRUNCATED = ("exhausted", "not enough data", "no newline found", "but only")


def ext_of(name: str) -> str:
    return name.rsplit(".", 1)[1].lower() if "." in name else ""


@dataclass(frozen=True)
class ImageInfo:
    width: int
    height: int


VALIDATE_FULL = "full"  # decode every entropy-coded byte: truncation and corruption are caught
VALIDATE_HEADER = "header"  # size and EXIF from the header only, as PiD reads them (trusted sources)
VALIDATE_LEVELS = (VALIDATE_FULL, VALIDATE_HEADER)
# Bytes read for a header check; a header longer than this (a large EXIF or ICC block) is read whole.
HEADER_BYTES = 64 * 1024
_BOMB_CHECK = threading.Lock()


def check_validate_level(level: str) -> str:
    if level not in VALIDATE_LEVELS:
        raise ValueError(f"validation level {level!r} is not one of {', '.join(VALIDATE_LEVELS)}")
    return level


def check_image(data: bytes, level: str = VALIDATE_FULL) -> ImageInfo | str:
    """Displayed width/height (EXIF orientation applied), or a reason string.

    ``full``: decode the image fully (at reduced scale where the codec allows) to catch
    truncation. ``header``: parse the header only (``Image.open`` without ``load``); ``data``
    may then be just the file's first bytes. Both read the orientation from the EXIF (or XMP)
    found in the header; the header level never decodes pixels, not even a PNG's.
    """
    try:
        # Intake checks files in threads, and the warning filters are global to the process: one
        # thread at a time turns the bomb warning into an error, for the header parse (where
        # Pillow warns) only; the decode below runs in parallel, without the GIL.
        with _BOMB_CHECK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
        if level == VALIDATE_HEADER:
            # The base class reads the EXIF the header held; PNG's own getexif() decodes the image.
            orientation = Image.Image.getexif(im).get(0x0112, 1)
        else:
            orientation = im.getexif().get(0x0112, 1)
            # JPEG draft decodes every entropy-coded byte (all components, every scan) at 1/8
            # scale: truncation and corrupt data still fail. Greyscale output also skips the
            # chroma planes' inverse DCT and the colour conversion (a colour JPEG's
            # components are interleaved, so each is still entropy-decoded); about 4% less work.
            im.draft("L", (max(1, w // 8), max(1, h // 8)))
            im.load()
    except Exception as exc:  # PIL raises many types for bad data
        return f"unreadable_image: {type(exc).__name__}: {exc}"
    if orientation in (5, 6, 7, 8):  # rotated by 90 or 270 degrees
        w, h = h, w
    return ImageInfo(w, h)


def check_caption(data: bytes, ext: str = "json") -> str | None:
    """A ``.json`` caption needs a non-empty string ``prompt``; a ``.txt`` one non-empty UTF-8
    text (the loader decodes it as UTF-8: one bad file would otherwise stop an epoch)."""
    if ext == "txt":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"bad_caption: not UTF-8 text ({exc})"
        return None if text.strip() else "bad_caption: empty text"
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"bad_caption: not JSON ({exc})"
    if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str) or not doc["prompt"].strip():
        return "bad_caption: no non-empty string 'prompt'"
    return None


def sniff_size(head: bytes) -> int:
    """Bytes of a file's head :func:`check_pickle` needs: a whole .npy header, or the default."""
    end = npy_header_end(head)
    if end is None or end <= len(head):
        return len(head)
    return min(end, NPY_MAX_HEADER + 12)


def npy_header_end(head: bytes) -> int | None:
    """Where a .npy file's header ends (the magic, version and header length read), or None."""
    if not head.startswith(NPY_MAGIC) or len(head) < 12:
        return None
    if head[6] == 1:
        return 10 + int.from_bytes(head[8:10], "little")
    return 12 + int.from_bytes(head[8:12], "little")


def npy_holds_objects(head: bytes) -> bool:
    """Whether a .npy header declares a dtype with an object field anywhere (nested fields and
    sub-arrays included): such an array is stored, and loaded, with pickle.

    The header is parsed as ``np.load`` parses it (``numpy.lib.format``), so spacing, quoting
    and field order in the header dict cannot hide the dtype. A header numpy cannot parse is not
    reported: ``np.load`` refuses it before reading any data.
    """
    fh = io.BytesIO(head)
    try:
        version = npy_format.read_magic(fh)
        reader = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        _shape, _fortran, dtype = reader(fh, max_header_size=NPY_MAX_HEADER)
    except (ValueError, SyntaxError, TypeError, EOFError):
        return False
    return bool(dtype.hasobject)


def is_pickle_stream(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) is the start of a pickle, of any protocol (0-5).

    Protocols >= 2 start with the PROTO opcode; 0 and 1 have no header, so the bytes are run
    through pickletools' disassembler, which also checks the stack: a pickle either reaches STOP
    or runs out of bytes mid-stream after a few valid opcodes. Text or numbers fail fast (an
    unknown opcode, a POP with no MARK, a memo key never stored), as do raw arrays.
    """
    if not head:
        return False
    out = io.StringIO()
    try:
        pickletools.dis(head, out=out)
    except ValueError as exc:
        if not any(t in str(exc) for t in _TRUNCATED):
            return False
        opcodes = out.getvalue().count("\n")
        versioned = head[0] == 0x80 and len(head) > 1 and 2 <= head[1] <= 5
        return opcodes >= (2 if versioned else 4)
    except Exception:  # any other complaint of the disassembler: not a pickle
        return False
    return True


def check_pickle(name: str, data: bytes, describe: str) -> None:
    """Refuse a file whose loading would run pickle: by extension, a .npy header with an object
    dtype, or a pickle stream under any other name (``data``: the first :func:`sniff_size` bytes).
    Trusted embeddings are never sniffed (``outcomes.sample_outcome``), so never come here."""
    ext = ext_of(name)
    looks_pickled = ext in PICKLE_EXTS or (
        ext not in IMAGE_EXTS | CAPTION_EXTS and (npy_holds_objects(data) or is_pickle_stream(data))
    )
    if looks_pickled:
        raise UnsafeInputError(
            f"{describe}: pickle data in an embedding folder; loading it can run arbitrary code. "
            "Convert it to .npy (numeric dtype) or .safetensors, or pass --trust-pickle "
            "(trust_pickle=True) if this data comes from a source you trust."
        )
