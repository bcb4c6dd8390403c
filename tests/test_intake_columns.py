"""The intake as columns (issue 18, part 4): the listing, the basename join, the cached outcomes,
keys and buckets are Arrow columns, and they decide exactly what the per-file definitions
(``stem_of``, ``sanitize_key``, ``nearest_bucket``, the basename intersection) decide; an intake
whose outcomes are all cached makes no object per file or sample."""

from __future__ import annotations

import io
import random
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loader.formats.twin_tar import nearest_bucket, sanitize_key
from pid_platform.sharding.intake import cache as cache_mod
from pid_platform.sharding.intake import listing as listing_mod
from pid_platform.sharding.intake.cache import CACHE_SCHEMA, IntakeCache
from pid_platform.sharding.intake.file_checks import ext_of
from pid_platform.sharding.intake.keys import buckets, sanitized_keys
from pid_platform.sharding.intake.listing import list_source, raw_extensions, stems
from pid_platform.sharding.intake.task import intake
from pid_platform.sharding.storage import LocalSourceStore
from tests.support.build_data import SOURCE, stem_of

# Characters that make names hard: dots, a newline, non-ASCII letters (one whose lower case is
# ASCII, one whose lower case is two characters), a character outside the BMP, a slash-like one.
ALPHABET = ["a", "B", ".", "\n", "é", "日", "\u212a", "İ", "-", "_", " ", "\U0001f600", "\\", "%", "0"]


def _names(n: int, seed: int, longest: int = 12) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, longest))) for _ in range(n)]


def test_stems_and_extensions_are_the_python_definitions() -> None:
    names = _names(20_000, 1)
    assert stems(pa.array(names)).to_pylist() == [stem_of(n) for n in names]
    assert [e.lower() for e in raw_extensions(pa.array(names)).to_pylist()] == [ext_of(n) for n in names]


def test_keys_are_sanitize_key_including_long_empty_and_unicode_names() -> None:
    names = _names(20_000, 2) + ["", "x" * 79, "x" * 80, "y" * 81, "日" * 90, "a.b" * 40, "ok_name-1"]
    assert sanitized_keys(pa.array(names)).to_pylist() == [sanitize_key(n) for n in names]


def test_buckets_are_nearest_bucket_decided_once_per_size() -> None:
    rng = random.Random(3)
    sizes = [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(5000)]
    sizes += [(0, 0), (None, None), (4096, 4096), (3840, 2160), (1, 9000)]
    got = buckets(pa.array([w for w, _ in sizes], pa.int32()), pa.array([h for _, h in sizes], pa.int32()))
    assert got.to_pylist() == [nearest_bucket(w, h) if w else None for w, h in sizes]


def _cache_rows(modality: str, names: list[str], fingerprint: str, width: int | None = None) -> pa.Table:
    n = len(names)
    return pa.table({"modality": [modality] * n, "name": names, "fingerprint": [fingerprint] * n,
                     "kind": ["image"] * n, "reason": [None] * n, "width": [width] * n, "height": [width] * n,
                     "sha256": [None] * n},
                    schema=CACHE_SCHEMA)


def test_cache_sources_later_win_and_lookups_align_with_the_names(tmp_path: Path) -> None:
    first = IntakeCache("full", _cache_rows("image", ["a.jpg", "b.jpg", "c.jpg"], "old", 1))
    first.save(tmp_path / "first.parquet")
    later = IntakeCache("full", _cache_rows("image", ["b.jpg", "d.jpg"], "new", 2))
    later.save(tmp_path / "later.parquet")
    cache = IntakeCache.load([tmp_path / "first.parquet", tmp_path / "missing.parquet", tmp_path / "later.parquet"],
                             "full")
    got = cache.lookup("image", pa.array(["d.jpg", "zz.jpg", "b.jpg", "a.jpg"])).to_pydict()
    assert got["fingerprint"] == ["new", None, "new", "old"]
    assert got["width"] == [2, None, 2, 1]
    assert cache.lookup("caption", pa.array(["a.jpg"])).to_pydict()["fingerprint"] == [None]
    assert len(cache) == 4
    # Another validation level or rules version: ignored as a whole.
    assert len(IntakeCache.load([tmp_path / "later.parquet"], "header")) == 0


def test_a_cache_file_damaged_after_it_was_found_usable_only_costs_validation(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    IntakeCache("full", _cache_rows("image", ["a.jpg"], "fp")).save(path)
    cache = IntakeCache.load([path], "full")  # its rows are read on the first lookup
    path.write_bytes(path.read_bytes()[:-40])  # its footer torn
    assert cache.lookup("image", pa.array(["a.jpg"])).to_pydict()["fingerprint"] == [None]


def test_saved_cache_has_row_groups_across_modalities_as_one_write_table_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_mod, "ROW_GROUP_ROWS", 7)
    a = _cache_rows("caption", [f"{i:03d}.json" for i in range(10)], "f")
    b = _cache_rows("image", [f"{i:03d}.jpg" for i in range(12)], "g", 5)
    cache = IntakeCache("full", b)
    cache.add(a)
    cache.save(tmp_path / "c.parquet")
    whole = pa.concat_tables([a, b]).replace_schema_metadata(
        {"rules_version": str(cache_mod.RULES_VERSION), "validate": "full"})
    ref = io.BytesIO()
    pq.write_table(whole, ref, compression="zstd", row_group_size=7)
    assert (tmp_path / "c.parquet").read_bytes() == ref.getvalue()
    assert [pq.ParquetFile(tmp_path / "c.parquet").metadata.row_group(i).num_rows for i in range(4)] == [7, 7, 7, 1]


def _oracle(files: dict[str, list[str]]) -> tuple[list[tuple[str, dict[str, str]]], Counter, dict[str, int]]:
    """The basename intersection as the per-file definition states it."""
    active = sorted(m for m, names in files.items() if names)
    by_stem: dict[str, dict[str, str]] = defaultdict(dict)
    ambiguous: set[str] = set()
    for m in active:
        for name in sorted(files[m]):
            stem = stem_of(name)
            if m in by_stem[stem]:
                ambiguous.add(stem)
            by_stem[stem][m] = name
    dropped: Counter = Counter({"ambiguous_basename": len(ambiguous)} if ambiguous else {})
    orphans = dict.fromkeys(active, 0)
    complete = []
    for stem in sorted(by_stem):
        if stem in ambiguous:
            continue
        have = by_stem[stem]
        if len(have) == len(active):
            complete.append((stem, have))
            continue
        for m in have:
            orphans[m] += 1
        dropped["missing_modality: " + ",".join(m for m in active if m not in have)] += 1
    return complete, dropped, orphans


@pytest.mark.parametrize("seed", range(6))
def test_the_basename_join_is_the_intersection_as_defined(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    stems_ = sorted({n.replace("\n", "_").replace("\\", "_").strip(".") or "x"
                     for n in _names(150, seed, 6)} - {""})
    files: dict[str, list[str]] = {}
    for m, exts in (("caption", [".json", ".txt"]), ("image", [".jpg", ".png"]), ("umt5", [".npy"])):
        chosen = {}
        for s in stems_:
            if s.startswith(".") or rng.random() < 0.15:
                continue  # an orphan elsewhere
            chosen[f"{s}{exts[0]}"] = 1
            if seed % 2 and rng.random() < 0.05:
                chosen[f"{s}{exts[-1]}"] = 1  # x.jpg and x.png: ambiguous
        files[m] = sorted(chosen)
        (tmp_path / SOURCE / m).mkdir(parents=True)
        for name in files[m]:
            (tmp_path / SOURCE / m / name).touch()
    got = list_source(LocalSourceStore(tmp_path), SOURCE)
    complete, dropped, orphans = _oracle(files)
    rows = got.complete.to_pydict()
    assert [(s, {m: rows[f"name.{m}"][i] for m in got.modalities}) for i, s in enumerate(rows["basename"])] == complete
    assert got.report.dropped == dropped
    assert got.report.orphans == orphans
    # Examples: each reason's first names in basename order.
    assert all(examples == sorted(examples) for examples in got.report.examples.values())


def test_a_clean_drop_and_one_with_an_orphan_give_the_same_samples(raw_root: Path) -> None:
    store = LocalSourceStore(raw_root)
    clean, report, _ = intake(store, SOURCE, validate="header")
    assert report.dropped_total == 0
    (raw_root / SOURCE / "caption" / "0-orphan.json").write_text('{"prompt": "no image"}')
    with_orphan, report, _ = intake(store, SOURCE, validate="header")
    assert dict(report.dropped) == {"missing_modality: image,umt5": 1}
    assert with_orphan.equals(clean)


def test_an_intake_whose_outcomes_are_cached_makes_no_object_per_file(
        raw_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalSourceStore(raw_root)
    first, _, used = intake(store, SOURCE, validate="header")
    made = Counter()
    real = listing_mod.FileEntry

    def counting(*args, **kwargs):
        made["FileEntry"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(listing_mod, "FileEntry", counting)
    again, report, _ = intake(store, SOURCE, validate="header", cache=used)
    assert (report.files_validated, report.outcomes_reused) == (0, 3 * first.num_rows)
    assert made["FileEntry"] == 0
    assert again.equals(first)
