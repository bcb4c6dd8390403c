"""The tar reader (``loader.formats.twin_tar.iter_tar``) against webdataset's, on every kind of tar.

Plain USTAR headers are parsed by our code, everything else by tarfile's: each case checks that
the names and bytes are exactly what webdataset's ``tar_file_iterator`` yields for the same file,
and that damaged tars fail with the tar's name and the byte where reading stopped.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from webdataset.tariterators import tar_file_iterator

from loader.formats.twin_tar import BLOCK, TarMember, TarReadError, iter_tar, write_tar
from loader.wds.errors import ShardReadError
from loader.wds.members import iter_members

GNU_TAR = shutil.which("tar")
needs_gnu_tar = pytest.mark.skipif(
    GNU_TAR is None or b"GNU tar" not in subprocess.run([GNU_TAR or "tar", "--version"], capture_output=True).stdout,
    reason="GNU tar is not installed",
)


def _webdataset(path: Path) -> list[tuple[str, bytes]]:
    with open(path, "rb") as fh:
        return [(s["fname"], s["data"]) for s in tar_file_iterator(fh, skip_meta=None)]


def _ours(path: Path, start: int = 0, stream=None) -> list[tuple[str, bytes]]:
    with open(path, "rb") as fh:
        fh.seek(start)
        return list(iter_tar(stream(fh) if stream else fh, str(path), start))


def _same_as_webdataset(path: Path) -> list[tuple[str, bytes]]:
    ours = _ours(path)
    assert ours == _webdataset(path)
    return ours


def _tree(root: Path) -> dict[str, bytes]:
    """Files with long, nested and non-ASCII names, every size class around a block."""
    files = {
        "short.jpg": os.urandom(1000),
        "k" * 99 + ".bin": os.urandom(511),  # 103 bytes: a long name
        "deep/" + "d" * 90 + "/" + "n" * 120 + ".json": b'{"a": 1}',  # > 100 and > 255 bytes with its folder
        "mid/" + "m" * 60 + "/" + "n" * 60 + ".bin": os.urandom(3),  # ustar: a prefix and a name
        "café/größe.txt": "über".encode(),
        "empty.txt": b"",
        "block.npy": os.urandom(512),
        "big.bin": os.urandom(70_000),
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "emptydir").mkdir()
    (root / "link.jpg").symlink_to("short.jpg")
    return files


def _gnu_tar(tmp_path: Path, fmt: str, *extra: str) -> Path:
    src = tmp_path / "src"
    _tree(src)
    out = tmp_path / f"{fmt}.tar"
    subprocess.run([GNU_TAR, f"--format={fmt}", *extra, "-cf", str(out), "-C", str(src), "."], check=True)
    return out


# ---------------------------------------------------------------- valid tars


def test_ours_read_back_byte_for_byte(tmp_path: Path) -> None:
    sizes = [0, 1, 511, 512, 513, 10240, 70000]
    members = [TarMember(f"k{i}.bin", n, data=os.urandom(n)) for i, n in enumerate(sizes)]
    write_tar(tmp_path / "a.tar", members)
    got = _same_as_webdataset(tmp_path / "a.tar")
    assert got == [(m.name, m.data) for m in members]


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["gnu", "ustar", "posix", "v7"])
def test_gnu_tar_formats_long_names_links_and_directories(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    files = _tree(src)
    too_long = {"ustar": ("deep/", "k" * 99), "v7": ("deep/", "k" * 99, "mid/")}.get(fmt, ())
    for name in [k for k in files if k.startswith(too_long)]:  # what the format cannot hold
        (src / name).unlink()
        del files[name]
    out = tmp_path / f"{fmt}.tar"
    subprocess.run([GNU_TAR, f"--format={fmt}", "-cf", str(out), "-C", str(src), "."], check=True)
    got = dict(_same_as_webdataset(out))
    assert got == {f"./{k}": v for k, v in files.items()}


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_sparse_members(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse.bin", "wb") as fh:
        fh.write(b"head" * 100)
        fh.seek(1 << 20)
        fh.write(b"middle" * 50)
        fh.seek(3 << 20)
        fh.write(b"tail")
    (src / "after.txt").write_bytes(b"after the sparse one")
    out = tmp_path / "s.tar"
    subprocess.run([GNU_TAR, f"--format={fmt}", "--sparse", "-cf", str(out), "-C", str(src),
                    "sparse.bin", "after.txt"], check=True)
    got = dict(_same_as_webdataset(out))
    assert got == {"sparse.bin": (src / "sparse.bin").read_bytes(), "after.txt": b"after the sparse one"}


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_python_tarfile_formats_with_a_global_pax_header(tmp_path: Path, fmt: int) -> None:
    out = tmp_path / "py.tar"
    names = ["a.jpg", "p" * 80 + "/" + "q" * 90 + ".json", "__meta__", "dir/__meta__", "x/y.z.txt"]
    if fmt != tarfile.USTAR_FORMAT:
        names.append("long" * 60 + ".bin")
    pax = {"comment": "global"} if fmt == tarfile.PAX_FORMAT else {}
    with tarfile.open(out, "w", format=fmt, pax_headers=pax) as tf:
        for i, name in enumerate(names):
            data = os.urandom(100 * i + 7)
            info = tarfile.TarInfo(name)
            info.size, info.uname, info.mtime = len(data), "someone" * 4, 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
        d = tarfile.TarInfo("folder")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
    got = _same_as_webdataset(out)
    assert [n for n, _ in got] == [n for n in names if n != "__meta__"]  # top-level __*__: skipped


def test_a_signed_checksum_is_accepted_as_tarfile_does(tmp_path: Path) -> None:
    write_tar(tmp_path / "a.tar", [TarMember("é-key.bin", 5, data=b"12345"), TarMember("b.bin", 1, data=b"x")])
    raw = bytearray((tmp_path / "a.tar").read_bytes())
    hdr = raw[:BLOCK]
    hdr[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in hdr)
    raw[148:156] = b"%06o\0 " % signed
    (tmp_path / "a.tar").write_bytes(bytes(raw))
    assert _same_as_webdataset(tmp_path / "a.tar") == [("é-key.bin", b"12345"), ("b.bin", b"x")]


def test_a_compressed_tar_is_read_through_tarfile(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "a.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo("a.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    assert _same_as_webdataset(tmp_path / "a.tar.gz") == [("a.txt", b"abc")]


def test_start_at_a_member_and_short_reads(tmp_path: Path) -> None:
    members = [TarMember(f"k{i}.bin", n, data=os.urandom(n)) for i, n in enumerate([700, 0, 3000, 512])]
    offsets = write_tar(tmp_path / "a.tar", members)
    assert _ours(tmp_path / "a.tar", offsets[2]) == [(m.name, m.data) for m in members[2:]]

    class Trickle:  # a socket-like stream: never more than 100 bytes a read
        def __init__(self, fh):
            self.fh = fh

        def read(self, n: int = -1) -> bytes:
            return self.fh.read(100 if n < 0 else min(n, 100))

    assert _ours(tmp_path / "a.tar", stream=Trickle) == [(m.name, m.data) for m in members]


def test_a_tar_without_end_blocks_ends_at_its_last_member(tmp_path: Path) -> None:
    write_tar(tmp_path / "a.tar", [TarMember("a.bin", 3, data=b"abc")])
    raw = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "b.tar").write_bytes(raw[: 2 * BLOCK])  # header + data block, no zero blocks
    assert _same_as_webdataset(tmp_path / "b.tar") == [("a.bin", b"abc")]


# ---------------------------------------------------------------- hostile tars


def _sample_tar(tmp_path: Path) -> tuple[Path, list[int]]:
    members = [TarMember(f"k{i}.bin", n, data=os.urandom(n)) for i, n in enumerate([1000, 2000, 300])]
    path = tmp_path / "h.tar"
    return path, write_tar(path, members)


@pytest.mark.parametrize(
    ("cut", "where"),
    [
        (BLOCK + 500, r"ends at byte 1012, inside member 'k0.bin' \(1000 bytes from byte 512\)"),
        (BLOCK + 1010, r"ends at byte 1522, inside the padding of member 'k0.bin'"),
        (1536 + 100, r"ends at byte 1636, inside the header at byte 1536"),
    ],
)
def test_truncated_tar_names_the_file_and_byte(tmp_path: Path, cut: int, where: str) -> None:
    path, offsets = _sample_tar(tmp_path)
    assert offsets[1] == 1536
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(TarReadError, match=rf"{path}: unreadable tar \(it {where}\)") as exc:
        _ours(path)
    assert exc.value.offset == int(where.split("byte ")[1].split(",")[0])


def test_bad_checksum_names_the_header(tmp_path: Path) -> None:
    path, offsets = _sample_tar(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[offsets[2] + 3] ^= 0x20  # a flipped bit in the third member's name
    path.write_bytes(bytes(raw))
    with pytest.raises(TarReadError, match=rf"{path}: unreadable tar \(damaged header at byte {offsets[2]} \(bad checksum\)\)"):
        _ours(path)


def test_truncated_inside_a_pax_header_chain(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "p.tar", "w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("n" * 200)
        info.size = 10
        tf.addfile(info, io.BytesIO(b"0123456789"))
    raw = (tmp_path / "p.tar").read_bytes()
    (tmp_path / "p.tar").write_bytes(raw[: 2 * BLOCK + 100])  # pax header + its records + part of the next header
    with pytest.raises(TarReadError, match=r"p.tar: unreadable tar \(.*(ends at byte|damaged header at byte 0)"):
        _ours(tmp_path / "p.tar")


def test_empty_file_and_not_a_tar(tmp_path: Path) -> None:
    (tmp_path / "e.tar").write_bytes(b"")
    with pytest.raises(TarReadError, match="e.tar: unreadable tar \\(empty file, not a tar\\)"):
        _ours(tmp_path / "e.tar")
    (tmp_path / "t.tar").write_bytes(b"just some text, not a tar\n" * 40)
    with pytest.raises(TarReadError, match=r"t.tar: unreadable tar \(damaged header at byte 0"):
        _ours(tmp_path / "t.tar")


def test_a_start_that_is_no_header_suggests_a_stale_key_index(tmp_path: Path) -> None:
    path, offsets = _sample_tar(tmp_path)
    with pytest.raises(ShardReadError, match=rf"damaged header at byte {offsets[1] + BLOCK}.*index is stale"):
        list(iter_members(str(path), start=offsets[1] + BLOCK))  # the data, not the header, of member 1
