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
import zlib
from collections.abc import Callable, Iterator, Sequence
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


# ---------------------------------------------------------------- reading
#
# Training reads every byte of every tar, so this reader is on the hot path. It parses the plain
# USTAR / GNU / v7 headers that pid-shard (and GNU tar, and Python's tarfile) write itself, with
# two reads per member - the data, straight into the bytes object handed on, then its padding
# together with the next header - and no TarInfo, no record buffer and no extractfile wrapper.
# Anything else (pax and GNU long-name headers, sparse members, base-256 sizes, unknown types, a
# compressed stream, a header whose checksum does not add up) goes through tarfile's own header
# code, so every tar tarfile reads reads the same here: the same names, members and order.


class TarReadError(FormatError):
    """A tar cannot be read on (truncated, a damaged header); the message names the tar and byte."""

    def __init__(self, origin: str, problem: str, offset: int | None = None):
        super().__init__(f"{origin}: unreadable tar ({problem}); the file is truncated or corrupt - rebuild or re-copy it")
        self.origin, self.problem = origin, problem
        self.offset = offset  # byte of the tar where reading failed, when known


_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = frozenset(b"07\0")  # REGTYPE, CONTTYPE, AREGTYPE: tarfile's isreg()
_NO_DATA = frozenset(b"123456")  # links, devices, directories, FIFOs: tarfile skips no data after them
_GNU_TYPES = frozenset(b"LKS")  # bytes 345:500 of these are not a ustar name prefix
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ")  # gzip, bzip2, xz: what tarfile's "r|*" unpacks
_SKIP_CHUNK = 1 << 20


def _is_meta(name: str) -> bool:
    # webdataset's tar iterator drops top-level "__...__" members; so do we, to yield what it yields.
    return name.startswith("__") and name.endswith("__") and "/" not in name


def _cstr(field: bytes) -> bytes:
    end = field.find(0)
    return field if end < 0 else field[:end]


def _header_sum(hdr: bytes, adler32=zlib.adler32) -> int:
    """The sum of a header's bytes with its checksum field (148:156) counted as eight spaces:
    what an unsigned tar checksum holds.

    ``sum(hdr)`` costs ~2.5 us a header in Python, as much as the rest of reading a small member.
    zlib's Adler-32 sums bytes in C (its low half is 1 + the sum, modulo 65521), exact for up to
    256 bytes (256 * 255 < 65521): three pieces around the field, each shorter, give the sum.
    """
    return (adler32(hdr[:148]) & 0xFFFF) + (adler32(hdr[156:384]) & 0xFFFF) + (adler32(hdr[384:]) & 0xFFFF) + 253


def is_member_header(hdr: bytes, name: str, size: int) -> bool:
    """Whether ``hdr`` is the USTAR header of a regular member ``name`` of ``size`` bytes as
    :func:`write_tar` writes it (the name in the name field, no prefix, an unsigned checksum
    that adds up): what the build checks before indexing a tar it wrote."""
    raw = name.encode("utf-8")
    if len(hdr) != BLOCK or len(raw) > USTAR_NAME_MAX or hdr[:100] != raw.ljust(100, b"\0"):
        return False
    if hdr[156:157] not in (b"0", b"\0") or hdr[345:500].strip(b"\0"):
        return False
    try:
        stored_size = int(hdr[124:136].strip(b" \0") or b"0", 8)
        stored_sum = int(hdr[148:156].strip(b" \0"), 8)
    except ValueError:
        return False
    return stored_size == size and stored_sum == _header_sum(hdr)


def _plain_header(hdr: bytes) -> tuple[str, int, bool] | None:
    """``(name, size, is_regular)`` of a plain header we read ourselves, or None for tarfile.

    Same rules as ``tarfile.TarInfo.frombuf`` for these types: name from bytes 0:100, a ustar
    prefix (345:500) joined in front, an old-style regular file whose name ends in "/" is a
    directory, the checksum an unsigned sum with its own field counted as spaces.
    """
    kind = hdr[156]
    if not (kind in _REGULAR or kind in _NO_DATA) or hdr[124] & 0x80:
        return None
    try:
        chk = int(_cstr(hdr[148:156]).strip() or b"0", 8)
        size = int(_cstr(hdr[124:136]).strip() or b"0", 8)
    except ValueError:
        return None  # tarfile names the damage
    if chk != _header_sum(hdr):  # tarfile's unsigned test
        return None  # maybe a signed checksum (old tars), maybe damage: tarfile decides
    name = _cstr(hdr[:100])
    if hdr[345]:
        name = _cstr(hdr[345:500]) + b"/" + name
    regular = kind in _REGULAR
    if kind == 0 and name.endswith(b"/"):
        regular = False
    return name.decode(tarfile.ENCODING, "surrogateescape"), size, regular


class _Replay:
    """A stream with already-read bytes put back in front, counting its position, for tarfile."""

    def __init__(self, head: bytes, read: Callable[[int], bytes], pos: int):
        self.head, self._read, self.pos = head, read, pos

    def read(self, n: int = -1) -> bytes:
        head = self.head
        if not head:
            out = self._read(n)
        elif 0 <= n <= len(head):
            out, self.head = head[:n], head[n:]
        else:
            self.head = b""
            out = head + self._read(-1 if n < 0 else n - len(head))
        self.pos += len(out)
        return out

    def tell(self) -> int:
        return self.pos


class _TarfileState:
    """What ``tarfile.TarInfo.fromtarfile`` (documented) uses of a TarFile. One per stream: a
    pax global header's values stay in ``pax_headers`` for every later member, as in tarfile."""

    encoding = tarfile.ENCODING
    errors = "surrogateescape"

    def __init__(self) -> None:
        self.pax_headers: dict[str, str] = {}
        self.fileobj: _Replay | None = None
        self.offset = 0


def _read_upto(read: Callable[[int], bytes], n: int) -> bytes:
    """``n`` bytes, or fewer only at the end of the stream (some streams return short reads)."""
    data = read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n and (more := read(n - got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _truncated(origin: str, at: int, what: str) -> TarReadError:
    return TarReadError(origin, f"it ends at byte {at}, inside {what}", at)


def _read_data(read: Callable[[int], bytes], size: int, origin: str, pos: int, name: str) -> bytes:
    data = read(size) if size else b""
    if len(data) != size:
        data = data + _read_upto(read, size - len(data)) if data else data
        if len(data) != size:
            raise _truncated(origin, pos + BLOCK + len(data), f"member {name!r} ({size} bytes from byte {pos + BLOCK})")
    return data


def _skip(read: Callable[[int], bytes], n: int, origin: str, at: int) -> None:
    while n > 0:
        got = len(read(min(n, _SKIP_CHUNK)))
        if not got:
            raise _truncated(origin, at, f"the data of the member whose header is before byte {at + n}")
        n -= got
        at += got


def _tarfile_member(hdr: bytes, read: Callable[[int], bytes], pos: int, state: _TarfileState,
                    origin: str) -> tuple[str | None, bytes, int]:
    """One member whose headers tarfile parses: ``(name or None if not yielded, data, next header)``."""
    src = _Replay(hdr, read, pos)
    state.fileobj = src
    try:
        info = tarfile.TarInfo.fromtarfile(state)
    except (tarfile.HeaderError, ValueError) as exc:
        if str(exc) in ("truncated header", "empty header"):  # a later header of the chain (pax, long name)
            raise _truncated(origin, src.pos, f"the headers of the member at byte {pos}") from None
        raise TarReadError(origin, f"damaged header at byte {pos} ({exc})", pos) from None
    data, name = b"", None
    if info.isreg() and not _is_meta(info.name):
        name = info.name
        if info.sparse:
            stored = _read_data(src.read, sum(n for _, n in info.sparse), origin, src.pos - BLOCK, name)
            whole, p = bytearray(info.size), 0
            for off, n in info.sparse:
                whole[off : off + n] = stored[p : p + n]
                p += n
            data = bytes(whole)
        else:
            data = _read_data(src.read, info.size, origin, src.pos - BLOCK, name)
    _skip(src.read, state.offset - src.pos, origin, src.pos)
    return name, data, state.offset


def _iter_compressed(stream: _Replay, origin: str) -> Iterator[tuple[str, bytes]]:
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tf:
            for info in tf:
                if info.isreg() and not _is_meta(info.name):
                    yield info.name, tf.extractfile(info).read()
                tf.members = []  # stream mode: keep no TarInfo behind
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TarReadError(origin, f"compressed tar, unreadable ({type(exc).__name__}: {exc})") from exc


class TarCursor:
    """The regular members of one tar stream, one call at a time.

    ``stream`` (anything with ``read(n)``) is positioned at byte ``start`` of the tar, a header
    boundary; ``origin`` names the tar in errors, whose byte offsets count from the tar's start.
    :meth:`next` reads the next member, :meth:`skip` passes it reading only its header (a
    relative seek when the stream can seek, so a reader that wants every fourth member of a local
    tar copies a quarter of it). Members are named and chosen as webdataset's
    ``tar_file_iterator`` does (tarfile's names, regular files only, top-level ``__*__`` names
    skipped). The archive ends at its first all-zero block, or where the stream ends on a header
    boundary (as in tarfile); the stream ending inside a header or a member, or a damaged header,
    raises ``TarReadError``.
    """

    __slots__ = ("origin", "pos", "_read", "_seek", "_hdr", "_state", "_compressed", "_seeked", "_done")

    def __init__(self, stream, origin: str, start: int = 0):
        self.origin = origin
        self.pos = start  # offset of the header in ``_hdr`` (or of the next one to read)
        self._read = stream.read
        seekable = getattr(stream, "seekable", None)
        self._seek = stream.seek if seekable is not None and seekable() else None
        self._hdr: bytes | None = None  # the next header, read ahead with the previous padding
        self._state: _TarfileState | None = None  # made at the first header tarfile parses
        self._compressed: Iterator[tuple[str, bytes]] | None = None
        self._seeked = False  # the last skip seeked past data: the stream's end is no proof of a whole tar
        self._done = False
        if start == 0:
            hdr = self._read(BLOCK)
            if hdr.startswith(_COMPRESSED):
                self._compressed = _iter_compressed(_Replay(hdr, self._read, 0), origin)
            else:
                self._hdr = hdr

    def next(self) -> tuple[str, bytes] | None:
        """``(name, bytes)`` of the next regular member, or None at the end of the archive."""
        hdr = self._hdr
        # The hot path, spelled out once: a regular-file header as pid-shard, GNU tar and tarfile
        # write it (11-digit size, 6-digit checksum, no ustar prefix, an unsigned checksum that
        # adds up, see _header_sum), read ahead with the last padding. Anything else, and any
        # short read, goes the general way (_member), which names the damage.
        if (hdr is None or len(hdr) != BLOCK or hdr[156] != 48 or hdr[135] or hdr[154] or hdr[345]
                or self._state is not None):
            return self._member(True)
        try:
            size = int(hdr[124:135], 8)
            chk = int(hdr[148:154], 8)
        except ValueError:
            return self._member(True)
        adler32 = zlib.adler32  # _header_sum, inline: this runs once per member
        if chk != (adler32(hdr[:148]) & 0xFFFF) + (adler32(hdr[156:384]) & 0xFFFF) + (adler32(hdr[384:]) & 0xFFFF) + 253:
            return self._member(True)
        end = hdr.find(0, 0, 100)
        raw = hdr[:end] if end >= 0 else hdr[:100]
        if raw.endswith(b"/") or raw.startswith(b"__"):
            return self._member(True)
        read = self._read
        span = -(-size // BLOCK) * BLOCK
        pad = span - size
        data = read(size)
        tail = read(pad + BLOCK)
        if len(data) != size or len(tail) != pad + BLOCK:
            return self._short(hdr, raw, data, tail, size)
        self.pos += BLOCK + span
        self._hdr = tail[pad:] if pad else tail
        return raw.decode(tarfile.ENCODING, "surrogateescape"), data

    def _short(self, hdr: bytes, raw: bytes, data: bytes, tail: bytes, size: int) -> tuple[str, bytes]:
        """The hot path's reads came back short: read on (some streams return less than asked),
        or name where the tar ends."""
        name = raw.decode(tarfile.ENCODING, "surrogateescape")
        pos, read = self.pos, self._read
        span = -(-size // BLOCK) * BLOCK
        pad = span - size
        if len(data) != size:
            got = data + tail
            data = got[:size] + _read_upto(read, size - len(got)) if len(got) < size else got[:size]
            if len(data) != size:
                raise _truncated(self.origin, pos + BLOCK + len(data),
                                 f"member {name!r} ({size} bytes from byte {pos + BLOCK})")
            tail = got[size:]
        if len(tail) != pad + BLOCK:
            tail += _read_upto(read, pad + BLOCK - len(tail))
            if len(tail) < pad:
                raise _truncated(self.origin, pos + BLOCK + size + len(tail), f"the padding of member {name!r}")
        self.pos = pos + BLOCK + span
        self._hdr = tail[pad:] if pad else tail
        return name, data

    def skip(self) -> str | None:
        """The next regular member's name, its data passed over; None at the end."""
        got = self._member(False)
        return None if got is None else got[0]

    def _header(self) -> bytes | None:
        hdr = self._hdr
        if hdr is None:
            hdr = self._read(BLOCK)
        self._hdr = None
        if len(hdr) == BLOCK:
            return None if hdr == _ZERO_BLOCK else hdr
        if not hdr:
            if self.pos == 0:
                raise TarReadError(self.origin, "empty file, not a tar", 0)
            if self._seeked:
                self._check_length()
            return None
        hdr += _read_upto(self._read, BLOCK - len(hdr))
        if len(hdr) != BLOCK:
            raise _truncated(self.origin, self.pos + len(hdr), f"the header at byte {self.pos}")
        return None if hdr == _ZERO_BLOCK else hdr

    def _check_length(self) -> None:
        # A relative seek past the end succeeds and reading there returns nothing: compare where
        # the skipped member's data ended (the stream's position now) with the stream's length.
        assert self._seek is not None
        here = self._seek(0, os.SEEK_CUR)
        end = self._seek(0, os.SEEK_END)
        if end < here:
            at = self.pos - (here - end)
            raise _truncated(self.origin, at, f"the data of the member whose header is before byte {self.pos}")

    def _member(self, want: bool) -> tuple[str, bytes] | None:
        if self._done:
            return None
        if self._compressed is not None:
            got = next(self._compressed, None)
            self._done = got is None
            return got
        read = self._read
        while True:
            hdr = self._header()
            if hdr is None:
                self._done = True
                return None
            pos = self.pos
            state = self._state
            plain = _plain_header(hdr) if state is None or not state.pax_headers else None
            if plain is None:
                state = self._state = state or _TarfileState()
                name, data, self.pos = _tarfile_member(hdr, read, pos, state, self.origin)
                if name is not None:
                    return name, data
                continue
            name, size, regular = plain
            if not regular:
                self.pos = pos + BLOCK  # tarfile reads no data after these types
                continue
            span = -(-size // BLOCK) * BLOCK
            self.pos = pos + BLOCK + span
            if not want and self._seek is not None:
                self._seek(span, os.SEEK_CUR)
                self._seeked = True
                data = b""
            else:
                data = _read_data(read, size, self.origin, pos, name)
                pad = span - size
                # The padding and the next header in one read.
                tail = read(pad + BLOCK)
                if len(tail) != pad + BLOCK:
                    tail += _read_upto(read, pad + BLOCK - len(tail)) if tail else b""
                    if len(tail) < pad:
                        raise _truncated(self.origin, pos + BLOCK + size + len(tail), f"the padding of member {name!r}")
                self._hdr = tail[pad:] if pad else tail
            if not _is_meta(name):
                return name, data


def iter_tar(stream, origin: str, start: int = 0) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of each regular member of a tar stream, in order (see
    :class:`TarCursor`, which this walks to the end)."""
    cursor = TarCursor(stream, origin, start)
    while (member := cursor.next()) is not None:
        yield member
