"""Rewrite boxes of a real MP4 file for tests, keeping it valid: box sizes follow the edits and
chunk offsets follow the media data when the edit moves it (a bigger ``moov`` before ``mdat``).

    mp4 = Mp4Boxes(path.read_bytes())
    mp4.set_edits([Edit(0, -1), Edit(2800, 2048)])   # an empty edit, then a media edit
    path2.write_bytes(mp4.to_bytes())

Only the containers on the way to the sample tables are opened; every other box is kept as is.
FFmpeg's demuxer reads the results, so tests can compare against PyAV.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

CONTAINERS = {"moov", "trak", "mdia", "minf", "stbl", "edts"}


@dataclass
class Node:
    type: str
    payload: bytes = b""                              # leaves only
    children: list[Node] | None = None                # containers only
    large: bool = False                               # write a 64-bit size (size == 1 + largesize)
    to_end: bool = False                              # write size 0 ("runs to the end of the file")

    def body(self) -> bytes:
        return self.payload if self.children is None else b"".join(c.to_bytes() for c in self.children)

    def header_size(self) -> int:
        return 16 if self.large else 8

    def to_bytes(self) -> bytes:
        body = self.body()
        kind = self.type.encode("latin-1")
        if self.to_end:
            return struct.pack(">I4s", 0, kind) + body
        if self.large or len(body) + 8 > 0xFFFFFFFF:
            return struct.pack(">I4sQ", 1, kind, len(body) + 16) + body
        return struct.pack(">I4s", len(body) + 8, kind) + body

    def find(self, box_type: str) -> Node | None:
        for c in self.children or []:
            if c.type == box_type:
                return c
        return None


@dataclass
class Edit:
    segment_duration: int
    media_time: int
    rate_integer: int = 1
    rate_fraction: int = 0


def parse(data: bytes, start: int = 0, end: int | None = None) -> list[Node]:
    end = len(data) if end is None else end
    nodes, pos = [], start
    while pos < end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        header, large, to_end = 8, False, False
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header, large = 16, True
        elif size == 0:
            size, to_end = end - pos, True
        box_type = kind.decode("latin-1")
        if box_type in CONTAINERS:
            node = Node(box_type, children=parse(data, pos + header, pos + size), large=large, to_end=to_end)
        else:
            node = Node(box_type, payload=data[pos + header:pos + size], large=large, to_end=to_end)
        nodes.append(node)
        pos += size
    return nodes


@dataclass
class Mp4Boxes:
    data: bytes
    top: list[Node] = field(init=False)

    def __post_init__(self) -> None:
        self.top = parse(self.data)
        self._old_media = self._media_start()

    # -- navigation -------------------------------------------------------------------------
    def box(self, *path: str) -> Node:
        """The first box along ``path`` from the top (``trak`` is the video track)."""
        nodes = self.top
        node = None
        for kind in path:
            if kind == "trak":
                node = next(n for n in nodes if n.type == "trak" and _is_video(n))
            else:
                node = next(n for n in nodes if n.type == kind)
            nodes = node.children or []
        assert node is not None
        return node

    def stbl(self) -> Node:
        return self.box("moov", "trak", "mdia", "minf", "stbl")

    # -- edits ------------------------------------------------------------------------------
    def set_edits(self, edits: list[Edit], *, version: int = 0) -> None:
        """Replace (or add) the video track's edit list."""
        fmt = ">QqhH" if version == 1 else ">IihH"
        payload = struct.pack(">II", version << 24, len(edits)) + b"".join(
            struct.pack(fmt, e.segment_duration, e.media_time, e.rate_integer, e.rate_fraction) for e in edits)
        trak = self.box("moov", "trak")
        edts = trak.find("edts")
        if edts is None:
            edts = Node("edts", children=[])
            trak.children.insert(1, edts)  # after tkhd
        edts.children = [Node("elst", payload=payload)]

    def edits(self) -> tuple[int, list[Edit]]:
        payload = self.box("moov", "trak", "edts", "elst").payload
        version, n = payload[0], struct.unpack_from(">I", payload, 4)[0]
        fmt = ">QqhH" if version == 1 else ">IihH"
        width = struct.calcsize(fmt)
        return version, [Edit(*struct.unpack_from(fmt, payload, 8 + i * width)) for i in range(n)]

    def stco_to_co64(self) -> None:
        stbl = self.stbl()
        stco = stbl.find("stco")
        n = struct.unpack_from(">I", stco.payload, 4)[0]
        offsets = struct.unpack_from(f">{n}I", stco.payload, 8)
        stco.type = "co64"
        stco.payload = stco.payload[:8] + struct.pack(f">{n}Q", *offsets)

    def rechunk(self, pattern: list[int]) -> None:
        """Regroup the (back to back) samples into chunks of ``pattern[i % len(pattern)]`` samples:
        new ``stsc`` runs and chunk offsets, the media bytes untouched."""
        stbl = self.stbl()
        stsz = stbl.find("stsz").payload
        constant, n = struct.unpack_from(">II", stsz, 4)
        sizes = [constant] * n if constant else list(struct.unpack_from(f">{n}I", stsz, 12))
        chunks = stbl.find("stco") or stbl.find("co64")
        code = "I" if chunks.type == "stco" else "Q"
        first = struct.unpack_from(f">{code}", chunks.payload, 8)[0]
        offsets, runs, sample, pos, i = [], [], 0, first, 0
        while sample < n:
            count = min(pattern[i % len(pattern)], n - sample)
            offsets.append(pos)
            if not runs or runs[-1][1] != count:
                runs.append((len(offsets), count))  # (first chunk, 1-based; samples per chunk)
            pos += sum(sizes[sample:sample + count])
            sample += count
            i += 1
        chunks.payload = struct.pack(">II", 0, len(offsets)) + struct.pack(f">{len(offsets)}{code}", *offsets)
        stbl.find("stsc").payload = struct.pack(">II", 0, len(runs)) + b"".join(
            struct.pack(">III", c, k, 1) for c, k in runs)

    def ctts_to_v1(self) -> None:
        """Mark ``ctts`` version 1 (signed offsets): same bytes for non-negative offsets."""
        ctts = self.stbl().find("ctts")
        ctts.payload = bytes([1]) + ctts.payload[1:]

    def top_box(self, box_type: str) -> Node:
        return next(n for n in self.top if n.type == box_type)

    def drop_top(self, box_type: str) -> None:
        self.top.remove(self.top_box(box_type))

    # -- output -----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Serialize, moving the chunk offsets by however far the media data moved."""
        shift = self._media_start() - self._old_media
        if shift:
            self._shift_chunks(shift)
            self._old_media += shift
        return b"".join(n.to_bytes() for n in self.top)

    def _media_start(self) -> int:
        pos = 0
        for node in self.top:
            if node.type == "mdat":
                return pos + node.header_size()
            pos += len(node.to_bytes())
        raise ValueError("no mdat box")

    def _shift_chunks(self, shift: int) -> None:
        stbl = self.stbl()
        for kind, code in (("stco", "I"), ("co64", "Q")):
            box = stbl.find(kind)
            if box is None:
                continue
            n = struct.unpack_from(">I", box.payload, 4)[0]
            offsets = [o + shift for o in struct.unpack_from(f">{n}{code}", box.payload, 8)]
            box.payload = box.payload[:8] + struct.pack(f">{n}{code}", *offsets)


def _is_video(trak: Node) -> bool:
    hdlr = trak.find("mdia").find("hdlr")
    return hdlr.payload[8:12] == b"vide"
