"""``twin_tar_shards``: the size-bounded twin tars of one source, written by write-task steps
that the run's executor places (``tasks.py``: plan -> write_task[I_of_N] -> collect)."""

import warnings

import dagster as dg

from pid_platform.defs.groups import BUILD_GROUP
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.resources import SHARDING_CODE_VERSION
from pid_platform.defs.settings import SETTINGS_ASSET
from pid_platform.defs.shards.tasks import collect_write_tasks, plan_write_tasks, write_task

DESCRIPTION = """Twin tars of a source: `<bucket>/<modality>/part_<NNNNNN>/<NNNNNN>.tar`, one tar per
modality per shard, all holding the same keys in the same order, each shard within
`max_shard_size_mb` (or `shard_size` samples).

Written by write tasks, one step each (`write_task[I_of_N]`, a contiguous range of shards; how
many: the `sharding` resource's `write_tasks` / `shards_per_write_task`), which the run's executor
places and the `pid_build` pool caps; `plan` cuts the shards before them, `collect` records them
after. A failed task is retried; re-executed from failure, a run redoes only unfinished tasks.

The tars are written into the source's staging folder (`.<source>.pid-staging` beside its
output); shards whose inputs and plan are unchanged since the last build are hard-linked
from the published output, not rewritten. The published output does not change until
`wdinfo_manifests` commits the new version.

Materialized without `sample_set` when no intake is staged, it re-shards the committed sample
set with the source's current settings (`sample_set: committed` in the metadata); with
neither staged nor committed samples it fails at once, saying to select `sample_set` too.
"""


def _compose(sample_set, sharding_settings):
    tasks, planned = plan_write_tasks([sample_set, sharding_settings])
    return collect_write_tasks(planned, tasks.map(write_task).collect())


with warnings.catch_warnings():
    # The inputs are order-only (Nothing): the tars are cut from the staged samples and the settings file.
    twin_tar_shards = dg.graph_asset(
        _compose,
        name="twin_tar_shards",
        description=DESCRIPTION,
        ins={"sample_set": dg.AssetIn(dagster_type=dg.Nothing),
             SETTINGS_ASSET: dg.AssetIn(dagster_type=dg.Nothing)},
        partitions_def=sources_partitions,
        group_name=BUILD_GROUP,
        kinds={"python", "webdataset"},
        code_version=SHARDING_CODE_VERSION,
    )
