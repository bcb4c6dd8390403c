"""Shard sizing: the byte bound holds on disk, oversize samples are kept, fixed counts are exact."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from loader.formats.twin_tar import tar_path
from tests.support.build_data import (
    CLEAN_SAMPLES,
    MODALITIES,
    all_problems,
    build,
    index_rows,
    manifests,
    output_files,
    plans_of,
)


def _shard_bytes(out: Path) -> list[tuple[str, str, int, int]]:
    """(bucket, tar path, samples, bytes of all its twin tars on disk) per shard."""
    rows = []
    for man in manifests(out):
        root = Path(man.root_path())
        for t in man.tars:
            total = sum((root / m / t.path).stat().st_size for m in man.data_keys)
            rows.append((man.bucket, t.path, t.count, total))
    return rows


def test_every_shard_respects_the_bound_except_oversize_singles(photo_drop_template: Path, tmp_path: Path) -> None:
    bound_mb = 0.25
    out = tmp_path / "out"
    s = build(photo_drop_template, out, max_shard_size_mb=bound_mb)
    bound = int(bound_mb * 1024 * 1024)
    shards = _shard_bytes(out)
    assert sum(n for _, _, n, _ in shards) == CLEAN_SAMPLES == s.samples
    over = [r for r in shards if r[3] > bound]
    assert all(n == 1 for _, _, n, _ in over), over
    assert over, "the drop has PNGs over 0.25 MB; each must make its own shard"
    assert any(n > 1 for _, _, n, _ in shards), "the bound must still pack small samples together"
    assert all_problems(out, max_shard_size_mb=bound_mb) == []


def test_sample_larger_than_the_bound_gets_its_own_listed_shard(photo_drop_template: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(photo_drop_template, out, max_shard_size_mb=0.1)
    rows = index_rows(out)
    big = {r["basename"] for r in rows if r["size.image"] > 0.1 * 1024 * 1024}
    assert "coffee-4x3" in big  # a 390 KB PNG
    by_tar = defaultdict(list)
    for r in rows:
        by_tar[(r["bucket"], r["tar"])].append(r["basename"])
    for (bucket, tar), names in by_tar.items():
        if big & set(names):
            assert len(names) == 1, (bucket, tar, names)
    # PiD leaves one-sample tars out of wdinfo.json; every one is listed here.
    listed = {(m.bucket, t.path): t.count for m in manifests(out) for t in m.tars}
    singles = [k for k, n in listed.items() if n == 1]
    assert len(singles) >= len(big)
    assert {k for k in by_tar} == set(listed)
    assert sum(listed.values()) == CLEAN_SAMPLES


def test_fixed_count_mode_ignores_the_byte_bound(photo_drop_template: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(photo_drop_template, out, shard_size=3, max_shard_size_mb=0.01, classify_aspect_ratio=False)
    (man,) = manifests(out)
    assert [t.count for t in man.tars] == [3] * 10 + [2]
    assert man.chunk_size == 3
    assert all_problems(out, shard_size=3, max_shard_size_mb=0.01, classify_aspect_ratio=False) == []


def test_part_size_groups_tars_into_part_folders(photo_drop_template: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    build(photo_drop_template, out, shard_size=8, part_size=2, classify_aspect_ratio=False)
    (man,) = manifests(out)
    assert man.data_list == [
        "part_000000/000000.tar", "part_000000/000001.tar", "part_000001/000002.tar", "part_000001/000003.tar",
    ]
    files = output_files(out)
    for m in MODALITIES:
        assert f"{m}/part_000001/000003.tar" in files
    assert len(plans_of(out, shard_size=8, part_size=2, classify_aspect_ratio=False)) == 4
    assert tar_path(out, None, "image", man.data_list[-1]).is_file()
