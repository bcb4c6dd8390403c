"""One make_loader shape for both loaders: ``make_loader(dataset, batch_size=, drop_last=)``;
the twin-tar ``build_dataset(batch_size=)`` stays as a deprecated alias giving the same batches."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from loader.wds.pipeline import build_dataset, make_loader
from tests.support.loader_data import shared_build


@pytest.fixture(scope="module")
def built(tmp_path_factory, photo_drop_template) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=4)


def sids(batches) -> list[list[int]]:
    return [b["__sid__"].tolist() for b in batches]


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_size_on_make_loader_equals_the_deprecated_alias(built: Path, drop_last: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the new convention warns about nothing
        new = make_loader(build_dataset(str(built), decode=None, seed=5), batch_size=5, drop_last=drop_last)
        got = sids(new)
    with pytest.warns(DeprecationWarning, match=r"make_loader\(dataset, batch_size="):
        old_ds = build_dataset(str(built), decode=None, seed=5, batch_size=5, drop_last=drop_last)
    assert got == sids(make_loader(old_ds))
    assert all(len(b) == 5 for b in got[:-1]) and (len(got[-1]) == 5 or not drop_last)


def test_conflicting_batch_sizes_are_refused(built: Path) -> None:
    with pytest.warns(DeprecationWarning):
        ds = build_dataset(str(built), decode=None, batch_size=4)
    with pytest.raises(ValueError, match="built with batch_size=4"):
        make_loader(ds, batch_size=3)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        make_loader(build_dataset(str(built), decode=None), batch_size=0)
