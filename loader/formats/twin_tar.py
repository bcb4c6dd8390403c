"""Twin-tar contract: layout, safe sample keys, aspect buckets and a deterministic tar writer.

Layout: ``<out>/<bucket>/<modality>/part_<NNNNNN>/<NNNNNN>.tar`` (``<bucket>`` is absent in
flat mode). Every modality tar of a shard holds the same keys in the same order; a member is
``<key>.<ext>``. Headers are normalised (mtime 0, uid/gid 0, no owner names, mode 0644), so the
same input and plan give byte-identical tars.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.formats.atomic import atomic_writer
from loader.formats.errors import FormatError
from loader.formats.layout import (  # noqa: F401 - the layout's names, kept importable from here
    DEFAULT_PART_SIZE,
    bucket_name,
    key_index_relpath,
    shard_relpath,
)

BLOCK = 512
RECORD = 20 * BLOCK  # GNU tar's default record size; the archive is padded to a multiple of it
END_OF_ARCHIVE = 2 * BLOCK
USTAR_NAME_MAX = 100
MAX_KEY_LEN = 80
MAX_EXT_LEN = 16

# (name, width, height), in the order PiD lists them.
ASPECT_BUCKETS: tuple[tuple[str, int, int], ...] = tuple(
    (bucket_name(w, h), w, h) for w, h in ((21, 9), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16))
)
BUCKET_NAMES = tuple(b[0] for b in ASPECT_BUCKETS)
_LOG_RATIOS = tuple((name, math.log(w / h)) for name, w, h in ASPECT_BUCKETS)


def nearest_bucket(width: int, height: int) -> str:
    """Aspect bucket nearest in log space (so 2:1 and 1:2 are equally far from 1:1)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    r = math.log(width / height)
    # Ties go to the bucket listed first: deterministic and independent of float noise order.
    return min(_LOG_RATIOS, key=lambda item: abs(item[1] - r))[0]


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def sanitize_key(basename: str) -> str:
    """A WebDataset-safe key: no dot (WebDataset splits at the first dot), no path characters.

    Over-long names are cut and suffixed with a digest so distinct names stay distinct.
    """
    key = _UNSAFE.sub("_", basename)
    if not key:
        key = "_"
    if len(key) > MAX_KEY_LEN:
        digest = hashlib.sha1(basename.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        key = f"{key[: MAX_KEY_LEN - 13]}_{digest}"
    return key


def disambiguate_key(key: str, basename: str) -> str:
    """A collision-free variant of ``key`` derived only from the original basename."""
    digest = hashlib.sha1(basename.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return f"{key[: MAX_KEY_LEN - 11]}_{digest}"


def sanitize_ext(ext: str) -> str:
    ext = ext.lower().lstrip(".")
    ext = re.sub(r"[^a-z0-9]", "", ext)[:MAX_EXT_LEN]
    return ext or "bin"


def member_name(key: str, ext: str) -> str:
    return f"{key}.{ext}"


def padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def member_span(size: int) -> int:
    """Bytes a member occupies in a tar: one header block plus its padded data."""
    return BLOCK + padded(size)


def tar_size(member_sizes: Sequence[int]) -> int:
    """Exact size of a tar written by :func:`write_tar` for members of these sizes."""
    body = sum(member_span(s) for s in member_sizes) + END_OF_ARCHIVE
    return -(-body // RECORD) * RECORD


@dataclass(frozen=True)
class TarMember:
    """One member to write: its name in the tar and where its bytes come from."""

    name: str
    size: int
    path: str | None = None  # local file: copied with sendfile, never through Python memory
    data: bytes | None = None


def _header_template() -> bytes:
    # Every field but name, size and checksum is the same in every header we write.
    h = bytearray(BLOCK)
    h[100:108] = b"0000644\0"  # mode
    h[108:116] = b"0000000\0"  # uid
    h[116:124] = b"0000000\0"  # gid
    h[136:148] = b"00000000000\0"  # mtime 0
    h[148:156] = b"        "  # checksum, counted as spaces
    h[156:157] = tarfile.REGTYPE
    h[257:265] = tarfile.POSIX_MAGIC  # "ustar\0" "00"
    # linkname, uname, gname, prefix: NUL. devmajor/devminor: NUL, as current CPython tarfile
    # leaves them for regular files (GNU tar writes octal zeros there).
    return bytes(h)


_HEADER_TEMPLATE = _header_template()
USTAR_SIZE_MAX = 8**11 - 1  # 11 octal digits


def _header(name: str, size: int) -> bytes:
    """A normalised USTAR header (mtime 0, uid/gid 0, no owner names, mode 0644).

    Built by hand rather than with ``tarfile.TarInfo.tobuf``: about 5x faster per member, and
    the bytes cannot drift with the Python version (tarfile's devmajor/devminor have changed).
    """
    raw = name.encode("utf-8")
    if len(raw) > USTAR_NAME_MAX:
        raise FormatError(
            f"tar member name {name!r} is longer than {USTAR_NAME_MAX} bytes; "
            "keys are limited at intake, so this is a bug in the caller"
        )
    if not 0 <= size <= USTAR_SIZE_MAX:
        raise FormatError(f"tar member {name!r}: size {size} does not fit a USTAR header (8 GiB - 1 at most)")
    h = bytearray(_HEADER_TEMPLATE)
    h[: len(raw)] = raw
    h[124:136] = b"%011o\0" % size
    h[148:155] = b"%06o\0" % sum(h)  # the 8th checksum byte stays a space
    return bytes(h)


class SourceChangedError(OSError):
    """A source file's size differs from the size recorded when the shard was planned."""


def _copy_file(out_fd: int, member: TarMember) -> None:
    assert member.path is not None
    with open(member.path, "rb") as src:
        st = os.fstat(src.fileno())
        if st.st_size != member.size:
            raise SourceChangedError(
                f"{member.path}: size is {st.st_size} bytes but {member.size} were planned; "
                "the source changed during the build - re-run the build"
            )
        offset = 0
        while offset < member.size:
            sent = os.sendfile(out_fd, src.fileno(), offset, member.size - offset)
            if sent == 0:
                raise SourceChangedError(f"{member.path}: file shrank while being copied; re-run the build")
            offset += sent


def write_tar(path: str | os.PathLike[str], members: Sequence[TarMember], *, durable: bool = True) -> list[int]:
    """Write ``members`` as a normalised USTAR archive, atomically; return header offsets.

    ``durable=False``: no fsync per tar (see ``atomic_writer``); the caller syncs the batch.
    """
    offsets: list[int] = []
    pos = 0
    with atomic_writer(path, durable=durable) as fh:
        fd = fh.fileno()
        for m in members:
            offsets.append(pos)
            header = _header(m.name, m.size)
            fh.write(header)
            if m.data is not None:
                if len(m.data) != m.size:
                    raise SourceChangedError(f"member {m.name}: {len(m.data)} bytes, {m.size} planned")
                fh.write(m.data)
            else:
                fh.flush()  # sendfile writes at the fd's position, behind Python's buffer
                _copy_file(fd, m)
            pad = padded(m.size) - m.size
            if pad:
                fh.write(b"\0" * pad)
            pos += member_span(m.size)
        total = tar_size([m.size for m in members])
        fh.write(b"\0" * (total - pos))
    return offsets


def iter_member_headers(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """``(name, header_offset, size)`` of each regular member, reading headers only."""
    out: list[tuple[str, int, int]] = []
    with tarfile.open(path, "r:") as tf:
        for info in tf:
            if info.isfile():
                out.append((info.name, info.offset, info.size))
    return out


def split_member_name(name: str) -> tuple[str, str]:
    """Split ``dir/key.ext.more`` the WebDataset way: key before the first dot of the basename."""
    base = name.rsplit("/", 1)[-1]
    if "." not in base:
        return name, ""
    stem, ext = base.split(".", 1)
    prefix = name[: len(name) - len(base)]
    return prefix + stem, ext


def file_sha256(path: str | os.PathLike[str], bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def tar_path(out: str | os.PathLike[str], bucket: str | None, modality: str, rel: str) -> Path:
    base = Path(out)
    if bucket:
        base = base / bucket
    return base / modality / rel
