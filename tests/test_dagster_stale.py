"""Stale means stale: lineage starts at each source's raw files (``raw_source``) and settings
(``sharding_settings``), and a change to either marks exactly that source's assets stale, as the
UI reads it from the instance; a rebuild clears it. The sensor's observations are recorded as
the daemon records them."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from pid_platform.demo.sample_data import make_sample_source
from pid_platform.sharding.settings import SETTINGS_NAME
from tests.support.dagster_runs import (
    SOURCE_ASSETS,
    apply_partition_requests,
    build_source,
    dagster_instance,
    evaluate_sensor,
    load_defs,
    use_roots,
)
from tests.support.stale import stale_partitions

SOURCES = ["photos", "portraits"]


@pytest.fixture
def roots(tmp_path: Path, raw_root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    make_sample_source(raw_root / "portraits", photos=("coffee",), ratios=((3, 4), (9, 16)), with_problems=False)
    use_roots(monkeypatch, raw_root, tmp_path / "out")
    return raw_root, tmp_path / "out"


class Daemon:
    """The sensor daemon's part: tick with the last cursor, record the observations, add partitions."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
        self.defs, self.instance, self.cursor = defs, instance, None

    def tick(self) -> list[dg.RunRequest]:
        result = evaluate_sensor(self.defs, self.instance, self.cursor)
        for event in result.asset_events:
            self.instance.report_runless_asset_event(event)
        apply_partition_requests(self.instance, result)
        self.cursor = result.cursor
        return list(result.run_requests)

    def run(self, requests: list[dg.RunRequest]) -> None:
        for r in requests:
            result = build_source(self.defs, self.instance, r.partition_key,
                                  tags={**r.tags, "dagster/run_key": r.run_key})
            assert result.success, [e.message for e in result.all_events if e.is_failure]


def _stale(daemon: Daemon) -> set[tuple[str, str]]:
    return stale_partitions(daemon.defs, daemon.instance, list(SOURCE_ASSETS), SOURCES)


def test_lineage_starts_at_the_raw_files_and_the_settings(roots) -> None:
    with dagster_instance():
        graph = load_defs().resolve_asset_graph()
    parents = {k.to_user_string() for k in graph.get(dg.AssetKey("sample_set")).parent_keys}
    assert parents == {"raw_source", "sharding_settings"}
    for root in ("raw_source", "sharding_settings"):
        node = graph.get(dg.AssetKey(root))
        assert node.is_observable and not node.parent_keys and node.partitions_def.name == "sources"
    assert {k.to_user_string() for k in graph.get(dg.AssetKey("mp4_sidecar")).parent_keys} == {"lerobot_dataset"}


def _built(daemon: Daemon) -> None:
    """Both sources registered by a first tick and built from its requests, as on a fresh instance."""
    daemon.run(daemon.tick())
    assert _stale(daemon) == set()
    assert daemon.tick() == [] and _stale(daemon) == set()  # nothing changed: nothing stale


# Dagster marks stale the assets whose own inputs changed: the ones below them follow once those
# are rebuilt (in the same source_build run).
READS_SETTINGS = ("sample_set", "twin_tar_shards")
READS_RAW = ("sample_set",)


def test_an_edited_settings_file_marks_exactly_that_source_stale(roots) -> None:
    raw, _ = roots
    with dagster_instance() as instance:
        daemon = Daemon(load_defs(), instance)
        _built(daemon)
        (raw / "photos" / SETTINGS_NAME).write_text("max_shard_size_mb: 0.25\n")
        resharded = daemon.tick()
        assert [r.partition_key for r in resharded] == ["photos"]
        assert _stale(daemon) == {(a, "photos") for a in READS_SETTINGS}
        daemon.run(resharded)
        assert _stale(daemon) == set()


def test_a_raw_change_marks_exactly_that_source_stale(roots) -> None:
    raw, _ = roots
    with dagster_instance() as instance:
        daemon = Daemon(load_defs(), instance)
        _built(daemon)
        caption = raw / "portraits" / "caption" / "coffee-3x4.json"
        caption.write_text(json.dumps({"prompt": "A cup of coffee, seen from above."}))
        changed = daemon.tick()
        assert [r.partition_key for r in changed] == ["portraits"]
        assert _stale(daemon) == {(a, "portraits") for a in READS_RAW}
        daemon.run(changed)
        assert _stale(daemon) == set()
        assert daemon.tick() == [] and _stale(daemon) == set()


def test_the_raw_source_is_observed_only_when_it_changes(roots) -> None:
    raw, _ = roots
    with dagster_instance() as instance:
        daemon = Daemon(load_defs(), instance)
        for _ in range(3):
            daemon.tick()
        key = dg.AssetKey("raw_source")

        def versions() -> dict[str, list[str]]:
            records = instance.fetch_observations(key, limit=100).records
            out: dict[str, list[str]] = {}
            for r in reversed(records):
                out.setdefault(r.partition_key, []).append(r.asset_observation.tags["dagster/data_version"])
            return out

        first = versions()
        assert sorted(first) == SOURCES and all(len(v) == 1 for v in first.values())  # three ticks, one each
        (raw / "portraits" / "caption" / "coffee-3x4.json").write_text('{"prompt": "Coffee."}')
        daemon.tick()
        after = versions()
        assert after["photos"] == first["photos"] and len(after["portraits"]) == 2
        assert after["portraits"][0] != after["portraits"][1]
