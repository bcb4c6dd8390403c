"""The ``lerobot_publish`` pool: publishes run one at a time across the whole instance.

Two publishes to one repository would race for the same branch (git and the Hub reject the
loser; it would only retry), and a publish holds a network upload. Dagster 1.13 keeps
per-pool limits in the instance's storage, not in ``dagster.yaml`` (whose ``concurrency: pools:``
block has only ``default_limit``, which would limit every pool, ``pid_build`` included).
``apply_pool_limits`` sets the limit below on a pool that has none yet, and leaves a limit an
operator chose alone; ``lerobot_datasets_sensor`` calls it on every tick. By hand, the same is
``dagster instance concurrency set lerobot_publish 1`` (or the UI: Deployment > Concurrency).
"""

from __future__ import annotations

import dagster as dg

PUBLISH_POOL = "lerobot_publish"
POOL_LIMITS = {PUBLISH_POOL: 1}


def apply_pool_limits(instance: dg.DagsterInstance) -> dict[str, int]:
    """Give each pool in POOL_LIMITS its limit unless it already has one; the limits in force."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:  # e.g. in-memory storage: nothing to set
        return {}
    configured = {p.name: p.limit for p in storage.get_pool_limits() if not p.from_default}
    for pool, limit in POOL_LIMITS.items():
        if pool not in configured:
            storage.set_concurrency_slots(pool, limit)
            configured[pool] = limit
    return {pool: configured[pool] for pool in POOL_LIMITS}
