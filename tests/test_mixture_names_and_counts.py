"""Mixtures whose names and counts cannot surprise (listed in ``tests/test_hostile_inputs.py``).

A dataset named like a source was accepted and then preferred (a mixture ``photos`` read
itself, a union ``[photos]`` trained on the dataset); a ``./photos`` folder where the job runs
won over ``catalog=``; ``all`` could be defined over the build's own; ``repeat=1e308`` passed
the definition and failed at ``make_loader`` with a 300-digit count and no dataset named. The
cost of ``Mixture.counts`` (it was quadratic) is measured in ``bench/bench_mixture_counts.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loader.formats.catalog import read_catalog
from loader.mixture import Mixture, MixtureError, Source
from loader.wds.errors import ManifestError
from loader.wds.pipeline import build_dataset
from pid_platform.defs.datasets.definitions import DATASETS_ENV, dataset_definitions
from pid_platform.sharding.catalog import build_catalog
from tests.support.loader_data import mixture_build


@pytest.fixture(scope="module")
def mixroot(tmp_path_factory, photo_drop_template) -> Path:
    return mixture_build(tmp_path_factory, photo_drop_template)


def _samples(dataset) -> int:
    return sum(1 for _ in dataset)


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("datasets", [
    {"photos": {"sources": {"web": {"weight": 1}, "hq": {"weight": 1}}}},
    {"photos": ["web", "hq"]},
])
def test_a_dataset_may_not_take_a_built_sources_name(mixroot: Path, tmp_path: Path, datasets: dict) -> None:
    out = tmp_path / "out"
    shutil.copytree(mixroot, out)
    with pytest.raises(MixtureError, match="dataset 'photos' takes the name of the built source 'photos'"):
        build_catalog(out, datasets)


def test_all_is_the_builds_own_dataset(mixroot: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(mixroot, out)
    with pytest.raises(MixtureError, match="dataset 'all': 'all' is the catalog's dataset of every built source"):
        build_catalog(out, {"all": ["web"]})
    shutil.copytree(out / "photos", out / "all")  # a source named all: the catalog's "all" would hide it
    with pytest.raises(MixtureError, match="source 'all' under .*: 'all' is the catalog's dataset"):
        build_catalog(out, {})
    definitions = tmp_path / "datasets.yaml"
    definitions.write_text("all: [photos]\n")
    with pytest.raises(MixtureError, match=f"{definitions}: dataset 'all'"):
        dataset_definitions({DATASETS_ENV: str(definitions)})


def test_a_catalog_that_gives_a_source_name_to_a_dataset_is_refused_when_read(mixroot: Path, tmp_path: Path) -> None:
    doc = json.loads((mixroot / "catalog.json").read_text())
    doc["datasets"]["photos"] = {"sources": {"photos": {"weight": 1}, "web": {"weight": 1}}}
    (tmp_path / "catalog.json").write_text(json.dumps(doc))
    with pytest.raises(MixtureError, match="dataset 'photos' takes the name of the built source 'photos'"):
        read_catalog(tmp_path)


def test_a_name_given_with_a_catalog_resolves_there_before_the_working_directory(
        mixroot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A "photos" folder where the job runs, holding another build (the web source: fewer samples).
    monkeypatch.chdir(tmp_path)
    shutil.copytree(mixroot / "web", tmp_path / "photos")
    from_catalog = _samples(build_dataset(str(mixroot / "photos"), decode=None))
    local = _samples(build_dataset("./photos", decode=None))
    assert from_catalog != local, "the two builds must differ for the test to say anything"
    assert _samples(build_dataset("photos", catalog=str(mixroot), decode=None)) == from_catalog
    assert _samples(build_dataset("./photos", catalog=str(mixroot), decode=None)) == local  # explicit: the folder
    mix = Mixture([Source("photos", weight=1), Source("hq", weight=1)], name="blend", samples_per_epoch=40)
    sources = build_dataset(mix, catalog=str(mixroot), decode=None).shardlist.sources  # type: ignore[attr-defined]
    assert sources.sizes[0] == from_catalog


def test_a_mixtures_source_resolves_as_a_source_only(mixroot: Path, tmp_path: Path) -> None:
    # A catalog of an older build, where the union "union" exists beside the sources.
    mix = Mixture([Source("union", weight=1), Source("web", weight=1)], name="blend")
    with pytest.raises((MixtureError, ManifestError), match="source 'union' is a dataset in the catalog"):
        build_dataset(mix, catalog=str(mixroot), decode=None)


# ------------------------------------------------------------------ counts


@pytest.mark.parametrize(("sources", "kw", "names"), [
    ([Source("a", repeat=1e308)], {}, ("source 'a'", "repeat 1e+308 is not a number from 0 to 2147483647")),
    ([Source("a", choose=10**300)], {}, ("source 'a'", "choose <an integer of", "from 0 to 2147483647")),
    ([Source("a", weight=1), Source("b", weight=1)], {"samples_per_epoch": 10**18},
     ("samples_per_epoch 1000000000000000000 cannot fit an epoch of 2 source(s)",)),
])
def test_counts_that_cannot_fit_an_epoch_are_refused_at_definition(sources, kw, names) -> None:
    with pytest.raises(MixtureError) as exc:
        Mixture(sources, name="blend", **kw)
    text = str(exc.value)
    assert "dataset 'blend'" in text and all(n in text for n in names), text
    assert len(text) < 300


def test_a_count_past_an_epoch_is_refused_naming_the_dataset_when_sizes_are_known() -> None:
    mix = Mixture([Source("a", repeat=2**30), Source("b", repeat=1)], name="blend")
    with pytest.raises(MixtureError, match="dataset 'blend', source 'a': gives 4294967296 samples per epoch"):
        mix.counts([4, 4])


def test_counts_are_the_largest_remainder_apportionment() -> None:
    mix = Mixture([Source(f"s{i}", weight=w) for i, w in enumerate([0.5, 0.25, 0.25, 1e-9, 3])],
                  samples_per_epoch=1001)
    counts = mix.counts([10] * 5)
    assert sum(counts) == 1001 and counts == [125, 63, 62, 0, 751]  # as the quadratic one gave
