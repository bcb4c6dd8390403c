"""Every bad mixture definition is one ``MixtureError`` naming the dataset, the source and the
fix, raised where the definition is read: the Python classes, ``catalog.json`` (the reader),
the build's ``sharding.datasets`` (the writer, in a real Dagster run) and the loader (the
manifests' modalities); the training example's command line and the Dagster run show that
message, no traceback. A changed definition refuses an old resume state, naming the change."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loader.formats.catalog import read_catalog
from loader.mixture import Mixture, MixtureError, Source
from loader.wds.errors import ResumeStateError
from loader.wds.pipeline import build_dataset, make_loader
from tests.support.loader_data import COUNTED, WEIGHTED, mixture_build

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mixroot(tmp_path_factory, photo_drop_template) -> Path:
    return mixture_build(tmp_path_factory, photo_drop_template)


def _assert_names(exc: BaseException, *parts: str) -> None:
    text = str(exc)
    for p in parts:
        assert p in text, f"{p!r} not in {text!r}"


# ------------------------------------------------------------------ the Python definition

@pytest.mark.parametrize(("sources", "kw", "names"), [
    ([Source("a", weight=0.0), Source("b", weight=1)], {}, ("'a'", "weight 0.0", "positive weight")),
    ([Source("a", weight=-1), Source("b", weight=1)], {}, ("'a'", "weight -1", "positive weight")),
    ([Source("a", weight="x"), Source("b", weight=1)], {}, ("'a'", "weight 'x'",)),  # type: ignore[arg-type]
    ([Source("a", repeat=-0.5), Source("b", repeat=1)], {}, ("'a'", "repeat -0.5", "how many times")),
    ([Source("a", choose=-1)], {}, ("'a'", "choose -1", "how many")),
    ([Source("a", weight=0.5), Source("b", repeat=2)], {}, ("'b'", "mixes weights with repeat", "every source")),
    ([Source("a", weight=0.5), Source("b", choose=3)], {}, ("'b'", "mixes weights with choose", "every source")),
    ([Source("a", weight=0.5, repeat=2)], {}, ("'a'", "both 'weight' and 'repeat'", "give one of")),
    ([Source("a", weight=0.5), Source("b")], {}, ("'b'", "no weight", "every source a weight")),
    ([Source("a", repeat=1)], {"samples_per_epoch": 10}, ("samples_per_epoch=10", "remove samples_per_epoch")),
    ([Source("a", weight=1)], {"samples_per_epoch": 0}, ("samples_per_epoch 0", "epoch's length")),
    ([Source("a"), Source("a")], {}, ("'a'", "named twice", "list each source once")),
    ([], {}, ("no sources", "at least one")),
])
def test_a_bad_python_definition_is_one_error_naming_dataset_source_and_fix(sources, kw, names) -> None:
    with pytest.raises(MixtureError) as exc:
        Mixture(sources, name="blend", **kw)
    _assert_names(exc.value, "dataset 'blend'", *names)


def test_choose_more_than_a_source_has_is_refused_when_its_size_is_known(mixroot: Path) -> None:
    mix = Mixture([Source("hq", choose=9), Source("web", choose=1)], name="blend")
    with pytest.raises(MixtureError) as exc:
        build_dataset(mix, catalog=str(mixroot), decode=None)
    _assert_names(exc.value, "dataset 'blend'", "source 'hq'", "choose=9", "its 8 samples", "choose at most 8")


def test_an_unknown_source_in_python_names_it(mixroot: Path) -> None:
    mix = Mixture([Source("photos", weight=1), Source("nope", weight=1)], name="blend")
    with pytest.raises(MixtureError) as exc:
        build_dataset(mix, catalog=str(mixroot), decode=None)
    _assert_names(exc.value, "dataset 'blend'", "source 'nope'", "build the source, or fix its name")


# ------------------------------------------------------------------ catalog.json (the reader)

def _catalog_with(mixroot: Path, tmp_path: Path, datasets: dict) -> Path:
    doc = json.loads((mixroot / "catalog.json").read_text())
    doc["datasets"] = datasets
    (tmp_path / "catalog.json").write_text(json.dumps(doc))
    return tmp_path / "catalog.json"


@pytest.mark.parametrize(("entry", "names"), [
    ({"sources": {"photos": {"weight": 0.6}, "nope": {"weight": 0.4}}}, ("source 'nope'", "no such source", "build it")),
    ({"sources": {"photos": {"weight": 0}}}, ("source 'photos'", "weight 0", "positive weight")),
    ({"sources": {"photos": {"repeat": -1}}}, ("source 'photos'", "repeat -1",)),
    ({"sources": {"photos": {"weight": 1}, "web": {"repeat": 2}}}, ("source 'web'", "mixes weights with repeat")),
    ({"sources": {"photos": {"weight": 1}, "web": {"wieght": 2}}}, ("source 'web'", "['wieght'] is not a setting")),
    ({"sources": {"photos": {"weight": 1}}, "modalities": ["image", "depth"]},
     ("source 'photos'", "lacks modalities ['depth']", "drop them from the dataset's 'modalities'")),
    ({"sources": {"photos": {}}, "samples": 3}, ("unknown keys ['samples']",)),
])
def test_a_bad_catalog_entry_is_one_error_when_the_catalog_is_read(mixroot, tmp_path, entry, names) -> None:
    path = _catalog_with(mixroot, tmp_path, {"blend": entry})
    with pytest.raises(MixtureError) as exc:
        read_catalog(path)
    _assert_names(exc.value, str(path), "dataset 'blend'", *names)


def test_a_catalog_mixture_resolves_to_the_same_mixture(mixroot: Path) -> None:
    catalog = read_catalog(mixroot)
    assert catalog.mixture("weighted") == Mixture.from_json("weighted", WEIGHTED)
    assert catalog.mixture("counted") == Mixture.from_json("counted", COUNTED)
    assert catalog.mixture("union") is None and catalog.datasets["union"] == ["hq", "web"]
    assert read_catalog(mixroot).to_json()["datasets"]["weighted"] == WEIGHTED  # written as it was given


def test_sources_with_different_modalities_must_choose_common_ones(mixroot: Path, tmp_path: Path) -> None:
    """In the catalog (its listed modalities) and from the manifests (folders given in Python)."""
    doc = json.loads((mixroot / "catalog.json").read_text())
    doc["sources"]["web"]["data_keys"] = ["caption", "image"]
    doc["datasets"] = {"blend": {"sources": {"photos": {"weight": 1}, "web": {"weight": 1}}}}
    (tmp_path / "catalog.json").write_text(json.dumps(doc))
    with pytest.raises(MixtureError) as exc:
        read_catalog(tmp_path)
    _assert_names(exc.value, "dataset 'blend'", "source 'web'", "choose common ones: 'modalities': ['caption', 'image']")
    # The manifests themselves: a copy of hq without its umt5 tars.
    lean = tmp_path / "lean"
    shutil.copytree(mixroot / "hq", lean)
    for manifest in lean.rglob("wdinfo.json"):
        m = json.loads(manifest.read_text())
        m["data_keys"] = [k for k in m["data_keys"] if k != "umt5"]
        m.pop("tar_sha256", None)
        m["tar_bytes"] = {k: v for k, v in m.get("tar_bytes", {}).items() if k != "umt5"} if "tar_bytes" in m else None
        if m["tar_bytes"] is None:
            m.pop("tar_bytes")
        manifest.write_text(json.dumps(m))
    mix = Mixture([Source(str(mixroot / "photos"), name="photos", weight=1), Source(str(lean), name="lean", weight=1)],
                  name="py")
    with pytest.raises(MixtureError) as exc:
        build_dataset(mix, decode=None)
    _assert_names(exc.value, "dataset 'py'", "source 'lean'", "choose common ones: 'modalities': ['caption', 'image']")
    with pytest.raises(MixtureError) as exc:
        build_dataset(mix, modalities=["image", "umt5"], decode=None)
    _assert_names(exc.value, "dataset 'py'", "source 'lean'", "lacks modalities ['umt5']", "remove the source")
    ds = build_dataset(mix, modalities=["image", "caption"], decode=None, batch_size=4)  # common ones: fine
    batch = next(iter(make_loader(ds)))
    assert set(batch["__source__"]) <= {"photos", "lean"} and "umt5" not in batch


# ------------------------------------------------------------------ the build's settings (Dagster)

def test_a_bad_dataset_setting_is_left_out_of_the_catalog_with_the_message_only(out_root: Path) -> None:
    """One dataset that does not fit (a source not built) never fails the catalog: the built
    sources stay listed, the dataset is left out and the catalog's metadata says why, in words."""
    from tests.support.dagster_runs import (
        build_catalog,
        build_source,
        dagster_instance,
        load_defs,
        materialized,
    )

    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success
        bad = {"blend": {"sources": {"photos": {"weight": 0.6}, "web": {"weight": 0.4}}}}
        result = build_catalog(defs, instance, datasets=bad)
        assert result.success
        message = materialized(result)["dataset_catalog"]["datasets_left_out"]["blend"]
        _assert_names(message, "dataset 'blend'", "source 'web'", "build it first")
        assert "Traceback" not in message and "File \"" not in message
        assert "blend" not in read_catalog(out_root).datasets and "photos" in read_catalog(out_root).sources
        good = {"blend": {"sources": {"photos": {"repeat": 2}}}}
        assert build_catalog(defs, instance, datasets=good).success
        assert read_catalog(out_root).mixture("blend") == Mixture.from_json("blend", good["blend"])


# ------------------------------------------------------------------ the command line

def test_the_training_example_says_what_is_wrong_without_a_traceback(mixroot: Path, tmp_path: Path) -> None:
    path = _catalog_with(mixroot, tmp_path, {
        "blend": {"sources": {"photos": {"weight": 0.6}, "web": {"weight": 0.4}}, "modalities": ["depth"]}})
    shutil.copytree(mixroot, tmp_path / "root", ignore=shutil.ignore_patterns("catalog.json"))
    shutil.copy(path, tmp_path / "root" / "catalog.json")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "train_policy.py"), "--data", "twin-tars",
                          "--root", "blend", "--catalog", str(tmp_path / "root"), "--checkpoint-dir",
                          str(tmp_path / "ckpt"), "--epochs", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    _assert_names(res.stderr, "train_policy: error:", "dataset 'blend'", "source 'photos'", "lacks modalities ['depth']")


# ------------------------------------------------------------------ resume with another definition

@pytest.mark.timeout(120)
def test_a_changed_definition_refuses_the_state_naming_the_change(mixroot: Path) -> None:
    def loader_of(data):
        return make_loader(build_dataset(data, catalog=str(mixroot), batch_size=3, decode=None, seed=1))

    loader = loader_of("weighted")
    next(iter(loader))
    state = json.loads(json.dumps(loader.state_dict()))
    changed = {**WEIGHTED, "sources": {**WEIGHTED["sources"], "web": {"weight": 0.4}}}
    with pytest.raises(ResumeStateError) as exc:
        loader_of(Mixture.from_json("weighted", changed)).load_state_dict(state)
    _assert_names(exc.value, "'mixture'", "source 'web' weight 0.3 -> 0.4", "resume with the definition")
    with pytest.raises(ResumeStateError) as exc:
        loader_of(Mixture.from_json("weighted", {**WEIGHTED, "samples_per_epoch": 50})).load_state_dict(state)
    _assert_names(exc.value, "source 'photos' per_epoch 24 -> 30")
    fewer = {"sources": {k: v for k, v in WEIGHTED["sources"].items() if k != "hq"}, "samples_per_epoch": 40}
    with pytest.raises(ResumeStateError) as exc:
        loader_of(Mixture.from_json("weighted", fewer)).load_state_dict(state)
    _assert_names(exc.value, "source 'hq' removed")
    with pytest.raises(ResumeStateError) as exc:
        loader_of("photos").load_state_dict(state)
    _assert_names(exc.value, "the state is for the mixture 'weighted'")
    single = loader_of("photos")
    next(iter(single))
    with pytest.raises(ResumeStateError) as exc:
        loader_of("weighted").load_state_dict(json.loads(json.dumps(single.state_dict())))
    _assert_names(exc.value, "the state is for one source list")
    same = loader_of(Mixture.from_json("weighted", WEIGHTED))
    same.load_state_dict(state)  # the same definition, written in Python: accepted


@pytest.mark.timeout(180)
def test_the_training_example_trains_on_a_catalog_mixture(mixroot: Path, tmp_path: Path) -> None:
    """``train_policy.py --data twin-tars --root counted --catalog <root>``: one epoch is the
    mixture's 38 samples (hq's 8 twice, 10 of web's 20, 12 of photos' 32)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "train_policy.py"), "--data", "twin-tars",
                          "--root", "counted", "--catalog", str(mixroot), "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--epochs", "1", "--batch-size", "4", "--num-workers", "0", "--seed", "3"],
                         capture_output=True, text=True, timeout=170, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "samples-rank0.jsonl").read_text().splitlines()]
    ids = [i for r in records if "ids" in r for i, pad in zip(r["ids"], r.get("pad", [False] * len(r["ids"])),
                                                                  strict=True) if not pad]
    assert len(ids) == 38
    seen = Counter(ids)  # keys, not unique across these sources (all cut from the same photographs)
    chelsea = [k for k in seen if k.startswith("chelsea")]
    assert len(chelsea) == 8 and all(seen[k] >= 2 for k in chelsea)  # hq (chelsea's 8) twice
