"""Intake task slices (``balanced_slices``): every sample in exactly one slice, for any number of
tasks (more tasks than samples too), the same slices on every machine, and balanced by bytes
where contiguous ranges of the listing are not."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

from pid_platform.sharding.intake.outcomes import kind_of
from pid_platform.sharding.intake.task import (
    FILE_COST_BYTES,
    balanced_slices,
    intake_slice,
    list_source,
    slice_bounds,
)
from pid_platform.sharding.storage import LocalSourceStore
from tests.support.build_data import SOURCE

TASK_COUNTS = (1, 2, 3, 5, 16)


def _members(owner: list[int], of: int) -> list[list[int]]:
    found: list[list[int]] = [[] for _ in range(of)]
    for i, t in enumerate(owner):
        found[t].append(i)
    return found


def _loads(weights: list[int], owner: list[int], of: int) -> list[int]:
    loads = [0] * of
    for w, t in zip(weights, owner, strict=True):
        loads[t] += w
    return loads


@pytest.mark.parametrize("total", [0, 1, 2, 7, 100, 1000])
@pytest.mark.parametrize("of", TASK_COUNTS)
def test_every_item_in_exactly_one_slice_and_balanced(total: int, of: int) -> None:
    rng = random.Random(total * 31 + of)
    # Heavy-tailed sizes, as photographs are: most small, a few twenty times as large.
    weights = [int(rng.lognormvariate(11, 1.2)) for _ in range(total)]
    owner = balanced_slices(weights, of)
    assert len(owner) == total and all(0 <= t < of for t in owner)
    members = _members(owner, of)
    assert sorted(i for m in members for i in m) == list(range(total))  # each once, none left out
    loads = _loads(weights, owner, of)
    if total:
        assert max(loads) - min(loads) <= max(weights)
    assert balanced_slices(list(weights), of) == owner  # the same slices from the same listing


def test_more_tasks_than_items_leaves_the_extra_tasks_empty() -> None:
    owner = balanced_slices([5, 9, 1], 8)
    assert owner == [0, 1, 2]  # each item to the first task still empty
    assert [len(m) for m in _members(owner, 8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_equal_weights_are_a_stride() -> None:
    assert balanced_slices([7] * 10, 3) == [i % 3 for i in range(10)]


def test_a_listing_cheap_at_its_start_and_costly_at_its_end_is_balanced() -> None:
    # The bench's drop: one photograph's copies lie together in name order, small ones first.
    weights = [20_000] * 500 + [300_000] * 500
    owner = balanced_slices(weights, 2)
    loads = _loads(weights, owner, 2)
    assert max(loads) / min(loads) < 1.01
    start, stop = slice_bounds(len(weights), 0, 2)  # what contiguous halves would have given
    halves = sum(weights[start:stop]), sum(weights[stop:])
    assert max(halves) / min(halves) > 10


def test_bad_task_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        balanced_slices([1, 2], 0)


@pytest.mark.parametrize("of", [1, 2, 3, 40])  # 40: more tasks than the drop's 32 samples
def test_intake_slices_of_a_real_source_cover_every_file_once(raw_root: Path, of: int) -> None:
    store = LocalSourceStore(raw_root)
    listing = list_source(store, SOURCE)
    parts = [intake_slice(store, SOURCE, i, of, validate="header") for i in range(of)]
    complete = listing.entries(listing.complete)
    assert sum(p.samples for p in parts) == len(listing) == len(complete) == 32
    if of > 32:
        assert sum(1 for p in parts if p.samples == 0) == of - 32
    files = [(m, e) for fs in complete for m, e in fs.items()]
    assert sum(p.nbytes for p in parts) == sum(e.size for _, e in files)
    for m, e in files:
        kind = kind_of(m, e.name, listing.report.image_modality)
        found = [p.outcomes.lookup(m, pa.array([e.name])).to_pylist()[0] for p in parts]
        holders = [i for i, row in enumerate(found) if (row["fingerprint"], row["kind"]) == (e.fingerprint, kind)]
        assert len(holders) == 1, (m, e.name, holders)
    assert sum(len(p.outcomes) for p in parts) == len(files)
    # Balanced by weight (bytes + a cost per file): any two slices' bytes differ by at most the
    # heaviest sample plus the per-file cost of the samples one holds more than the other.
    heaviest = max(sum(e.size for e in fs.values()) + FILE_COST_BYTES * len(fs) for fs in complete)
    assert heaviest == int(listing.weights(FILE_COST_BYTES).max())
    for a in parts:
        for b in parts:
            assert a.nbytes - b.nbytes <= heaviest + 3 * FILE_COST_BYTES * abs(a.samples - b.samples)
