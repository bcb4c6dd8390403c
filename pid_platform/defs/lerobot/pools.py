"""The ``lerobot_publish`` pool: publishes run one at a time across the whole instance.

The limit is set at start-up with the others (``pid_platform/defs/pools.py``);
``lerobot_datasets_sensor`` also sets it on a pool that has none yet (``keep_existing``), for an
instance that was started without that step.
"""

from __future__ import annotations

import dagster as dg

from pid_platform.defs.pools import POOL_LIMITS, PUBLISH_POOL
from pid_platform.defs.pools import apply_pool_limits as _apply

__all__ = ["PUBLISH_POOL", "apply_pool_limits"]


def apply_pool_limits(instance: dg.DagsterInstance) -> dict[str, int]:
    """Give ``lerobot_publish`` its limit unless it already has one; the limit in force."""
    return _apply(instance, {PUBLISH_POOL: POOL_LIMITS[PUBLISH_POOL]}, keep_existing=True)
