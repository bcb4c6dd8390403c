"""Pool limits of this code location, set on the instance at start-up.

Dagster 1.13 keeps a named pool's limit in the instance's storage, not in ``dagster.yaml``, whose
``concurrency: pools:`` block has only ``default_limit`` (1 in this project's ``dagster.yaml``, so
no pool is ever unlimited). The limits below are written by ``python -m pid_platform.defs.pools``,
which ``./dev ui`` and ``pid-demo`` run before anything else, so they are in force before the first
run or sensor tick. ``PID_POOL_LIMITS`` overrides them (``pid_build=4,lerobot_publish=1``); a
deployment runs the same command (or ``dagster instance concurrency set <pool> <limit>``).

* ``pid_build``: intake and sharding read every raw byte and keep ``num_workers`` processes busy:
  two at once fit a small machine.
* ``lerobot_publish``: two publishes to one repository would race for the same branch (git and the
  Hub reject the loser), so publishes go one at a time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import dagster as dg

from pid_platform.defs.groups import BUILD_POOL

PUBLISH_POOL = "lerobot_publish"
POOL_LIMITS: dict[str, int] = {BUILD_POOL: 2, PUBLISH_POOL: 1}
POOL_LIMITS_ENV = "PID_POOL_LIMITS"


def configured_pool_limits(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """``POOL_LIMITS`` with the overrides of ``PID_POOL_LIMITS`` (``pool=limit,pool=limit``)."""
    env = os.environ if environ is None else environ
    limits = dict(POOL_LIMITS)
    for item in filter(None, (part.strip() for part in env.get(POOL_LIMITS_ENV, "").split(","))):
        pool, sep, value = item.partition("=")
        if not sep or not pool.strip() or not value.strip().isdigit():
            raise ValueError(f"{POOL_LIMITS_ENV}={env[POOL_LIMITS_ENV]!r}: {item!r} is not pool=limit "
                             f"(a whole number >= 0), e.g. {BUILD_POOL}=4,{PUBLISH_POOL}=1")
        limits[pool.strip()] = int(value)
    return limits


def apply_pool_limits(instance: dg.DagsterInstance, limits: Mapping[str, int] | None = None,
                      *, keep_existing: bool = False) -> dict[str, int]:
    """Set each pool's limit on ``instance``; the limits in force afterwards.

    At start-up the configuration wins (``keep_existing=False``). With ``keep_existing`` a limit
    an operator set by hand (UI: Deployment > Concurrency) is left alone.
    """
    limits = configured_pool_limits() if limits is None else dict(limits)
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:  # e.g. in-memory storage: nothing to set
        return {}
    configured = {p.name: p.limit for p in storage.get_pool_limits() if not p.from_default}
    for pool, limit in limits.items():
        if keep_existing and pool in configured:
            continue
        if configured.get(pool) != limit:
            storage.set_concurrency_slots(pool, limit)
        configured[pool] = limit
    return {pool: configured[pool] for pool in limits}


def main() -> int:
    """Apply the configured limits to the instance in ``$DAGSTER_HOME`` and print them."""
    with dg.DagsterInstance.get() as instance:
        limits = apply_pool_limits(instance)
    print("pool limits: " + ", ".join(f"{p}={n}" for p, n in sorted(limits.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
