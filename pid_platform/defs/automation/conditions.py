"""Declarative automation: the derived assets follow their upstream on their own.

``FOLLOW_UPSTREAM`` requests an asset (per partition) after any of its dependencies was updated,
once no dependency is missing or in progress, and only when every blocking check of its
dependencies passed: a twin-tar build whose checks failed is never indexed or committed by
automation. Assets updated in the same run as their dependency (a whole ``source_build`` run)
are not requested again. ``follow_upstream_sensor`` (``automation/automation_sensor.py``) evaluates them;
it is on by default.
"""

import dagster as dg

FOLLOW_UPSTREAM = dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()
