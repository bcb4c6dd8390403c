"""Declarative automation: the derived assets follow their upstream on their own.

``FOLLOW_UPSTREAM`` requests an asset (per partition) after any of its dependencies was updated,
once no dependency is missing or in progress, and only when every blocking check of its
dependencies passed: a twin-tar build whose checks failed is never indexed or committed by
automation. Assets updated in the same run as their dependency (a whole ``source_build`` run)
are not requested again. ``follow_upstream_sensor`` (``automation/automation_sensor.py``) evaluates them;
it is on by default.
"""

import datetime as dt

import dagster as dg

FOLLOW_UPSTREAM = dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()

# The catalog is also rewritten every night after the daily rebuild (03:00 UTC), even when no
# source changed: a cheap rewrite that keeps its last materialization younger than a day while the
# daemon's nightly work runs, which is what CATALOG_FRESHNESS watches.
NIGHTLY_CATALOG_CRON = "30 3 * * *"
# The catalog lists the sources that are built: a registered source not built yet (a new folder,
# a build that failed) must not hold it back, as eager()'s "no dependency missing" would, for
# every other source's new manifests. Which manifests it lists is decided by the asset, not here.
CATALOG_FOLLOWS = (dg.AutomationCondition.eager().without(~dg.AutomationCondition.any_deps_missing())
                   & dg.AutomationCondition.all_deps_blocking_checks_passed()).with_label(
    "after new manifests of any source (sources not built yet do not hold it back)")
CATALOG_CONDITION = CATALOG_FOLLOWS | (
    dg.AutomationCondition.cron_tick_passed(NIGHTLY_CATALOG_CRON, "UTC") & ~dg.AutomationCondition.in_progress()
).with_label("nightly, after the daily rebuild")

# A catalog older than 26 hours (a warning after 25): the nightly rebuild and its catalog rewrite
# did not happen, i.e. the daemon (schedule and automation) is not running.
CATALOG_FRESHNESS = dg.FreshnessPolicy.time_window(fail_window=dt.timedelta(hours=26),
                                                  warn_window=dt.timedelta(hours=25))
