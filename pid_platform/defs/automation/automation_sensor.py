"""The sensor that runs the automation conditions (``automation/conditions.py``).

Dagster adds a ``default_automation_condition_sensor`` to a code location that defines none, and
creates it stopped: key indexes, manifests and the catalog then never follow a build on their
own. This code location defines its own, running by default, so a fresh instance follows builds
from its first daemon tick. Its runs carry ``pid/launched_by: automation``.
"""

import dagster as dg

AUTOMATION_SENSOR = "follow_upstream_sensor"

follow_upstream_sensor = dg.AutomationConditionSensorDefinition(
    AUTOMATION_SENSOR,
    target=dg.AssetSelection.all(),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    run_tags={"pid/launched_by": "automation"},
    description=(
        "Evaluates the automation conditions every 30 s: after a build of twin_tar_shards whose blocking "
        "checks passed, the source's key indexes and manifests follow; after new manifests, dataset_catalog "
        "follows. Runs it starts are tagged pid/launched_by=automation."
    ),
)
