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
# every other source's new manifests; nor must builds still queued or running, as eager()'s "no
# dependency in progress" would (during a queue of 40 new sources the catalog listed the first
# after the whole queue, 25 minutes later): it lists what is committed and follows each commit.
# Which manifests it lists is decided by the asset, not here.
# And a commit that lands while the catalog's own run works is not lost: eager() forgets an
# update once the asset's next materialization is seen, though that run may have scanned the
# sources before the commit; here only a new request of the catalog clears it.
_AC = dg.AutomationCondition
CATALOG_FOLLOWS = (_AC.in_latest_time_window()
                   & _AC.any_deps_updated().since(_AC.newly_requested() | _AC.initial_evaluation())
                   & ~_AC.in_progress()
                   & _AC.all_deps_blocking_checks_passed()).with_label(
    "after new manifests of any source (sources not built yet or still building do not hold it back)")
# The catalog's code version is a digest of $PID_DATASETS (set as the code location loads,
# pid_platform/definitions.py): an edited datasets.yaml, once the definitions are reloaded, is
# written into catalog.json by the next tick, not at the next manifest or 03:30.
DEFINITIONS_EDITED = (_AC.code_version_changed().since_last_handled() & ~_AC.in_progress()).with_label(
    "after an edit of the dataset definitions ($PID_DATASETS)")
CATALOG_CONDITION = CATALOG_FOLLOWS | DEFINITIONS_EDITED | (
    _AC.cron_tick_passed(NIGHTLY_CATALOG_CRON, "UTC") & ~_AC.in_progress()
).with_label("nightly, after the daily rebuild")

# A logical dataset (datasets/<name>) follows the catalog and its sources' manifests, and so
# re-runs its sources_match check: a source not built yet does not hold it back (its check
# fails, naming it); it waits while one of its own sources or the catalog is being written.
DATASET_FOLLOWS = (_AC.eager().without(~_AC.any_deps_missing())
                   & _AC.all_deps_blocking_checks_passed()).with_label(
    "after the catalog or one of its sources' manifests changed")

# A catalog older than 26 hours (a warning after 25): the nightly rebuild and its catalog rewrite
# did not happen, i.e. the daemon (schedule and automation) is not running.
CATALOG_FRESHNESS = dg.FreshnessPolicy.time_window(fail_window=dt.timedelta(hours=26),
                                                  warn_window=dt.timedelta(hours=25))
