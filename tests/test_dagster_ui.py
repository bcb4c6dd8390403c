"""What the UI shows and offers is true: metadata paths lead to data that exists after the
commit, each asset of a source can be materialized alone after a finished build, descriptions
are Markdown, byte counts come with a readable size."""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg

from tests.support.build_data import reverse_members_in_place
from tests.support.dagster_runs import (
    build_source,
    dagster_instance,
    load_defs,
    materialized,
    run_config,
    tars,
)


def _alone(defs: dg.Definitions, instance: dg.DagsterInstance, asset: str) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def("source_build").execute_in_process(
        instance=instance, partition_key="photos", run_config=run_config(), raise_on_error=False,
        asset_selection=[dg.AssetKey(asset)],
    )


def test_paths_in_metadata_exist_after_the_commit_and_sizes_are_readable(raw_root: Path, out_root: Path) -> None:
    with dagster_instance() as instance:
        result = build_source(load_defs(), instance, "photos")
        assert result.success
        paths = {}
        for event in result.get_asset_materialization_events():
            for key, value in event.materialization.metadata.items():
                if isinstance(value, dg.PathMetadataValue):
                    paths[f"{event.asset_key.to_user_string()}.{key}"] = Path(value.path)
        assert {"sample_set.samples_table", "twin_tar_shards.output", "wdinfo_manifests.output"} <= set(paths)
        assert all(p.exists() for p in paths.values()), {k: str(p) for k, p in paths.items() if not p.exists()}
        assert not any(".pid-staging" in str(p) for p in paths.values())
        shards = materialized(result)["twin_tar_shards"]
        assert re.fullmatch(r"\d+\.\d (KiB|MiB|GiB)", shards["size"]) and shards["bytes"] > 1024


def test_key_indexes_and_manifests_materialize_alone_after_a_finished_build(raw_root: Path, out_root: Path) -> None:
    out = out_root / "photos"
    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
        for asset in ("key_indexes", "wdinfo_manifests"):
            result = _alone(defs, instance, asset)
            assert result.success, asset
            assert materialized(result)[asset]["state"] == "committed"
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # verified, not rewritten
        assert not (out_root / ".photos.pid-staging").exists()

        # A committed version that no longer matches its tars is refused with what to do.
        reverse_members_in_place(sorted(tars(out))[0])
        failed = _alone(defs, instance, "key_indexes")
        assert not failed.success
        message = next(e for e in failed.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE
                       ).event_specific_data.error.message
        assert "committed key indexes of photos do not match its tars" in message
        assert "materialize source_build" in message


def test_descriptions_are_markdown() -> None:
    with dg.instance_for_test():
        defs = load_defs()
    graph = defs.resolve_asset_graph()
    texts = {spec.key.to_user_string(): spec.description for spec in defs.resolve_all_asset_specs()}
    texts |= {f"check {k.name}": graph.get_check_spec(k).description for k in graph.asset_check_keys}
    for name, text in texts.items():
        assert text, name
        assert "``" not in text and not re.search(r":(py:)?(func|class|meth|mod):", text), name
