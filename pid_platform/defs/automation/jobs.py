"""The two jobs: build one source (a partition), and rebuild the catalog of all sources."""

import dagster as dg

SOURCE_ASSETS = ("sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests")

# Checks of the selected assets come along, so the blocking ones gate each step in the run.
source_build_job = dg.define_asset_job(
    "source_build",
    selection=dg.AssetSelection.assets(*SOURCE_ASSETS),
    description="Intake -> twin tars -> key indexes -> wdinfo.json for one source (one partition).",
)

catalog_job = dg.define_asset_job(
    "catalog_build",
    selection=dg.AssetSelection.assets("dataset_catalog"),
    description="Rewrite catalog.json from the manifests of every built source.",
)
