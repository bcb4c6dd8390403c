"""A small source's re-shard launched from the Dagster UI, end to end, through a real instance.

    python bench/bench_ui_reshard.py [--repeat 2] [--tasks 4] [--work-dir DIR]

Data: ``pid-demo``'s photographs source (``pid_platform.demo.sample_data``: 4 photographs x 8
aspect ratios, image + caption + umt5 embedding, about 3 MB), built once per contender, untimed.

Each contender gets a fresh instance prepared as ``./dev ui`` prepares it (``pid-demo
--prepare-instance``: the run queue, pools and run monitoring of ``dagster.yaml``), the code
location served by a code server as ``dagster dev`` serves it, and runs launched as the UI
launches them: GraphQL ``launchRun`` with the launchpad's config (a new ``max_shard_size_mb``,
``--tasks`` write tasks), dequeued by the daemon's run queue into a run worker. Timed: from the
launch to the run's SUCCESS (the queue is ticked every 0.1 s, as often as needed). Rounds
alternate between two shard sizes so no re-shard is a no-op, and between the contenders.

* ``ours (small source: one process)`` - the code location as it is: a source under
  ``PID_IN_PROCESS_BELOW_MB`` runs its steps in the run worker (``defs/small_sources.py``).
* ``fan-out (a process per step)`` - the same with ``PID_IN_PROCESS_BELOW_MB=0``: every step,
  each write task and check, a process of its own (what every source did before).

Target: ours < 15 s end to end on this machine (the audit measured 80 s in the UI). The fan-out's
time is printed beside it, with the ratio. Run from the repository root with PYTHONPATH set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pid_platform.defs.small_sources import IN_PROCESS_BELOW_ENV  # noqa: E402
from pid_platform.demo import pid_demo as demo  # noqa: E402
from pid_platform.demo.sample_data import make_sample_source  # noqa: E402
from tests.support.ui_launch import dequeue, launch, launchpad_params, ui_workspace  # noqa: E402

SOURCE = "photos"
TARGET_S = 15.0
QUIET = {"console": {"config": {"log_level": "WARNING"}}}
CONTENDERS = {"ours (small source: one process)": None, "fan-out (a process per step)": "0"}


def _run(context, instance: dg.DagsterInstance, **sharding: object) -> float:
    params = launchpad_params("source_build", SOURCE, **sharding)
    params["params"]["runConfigData"]["loggers"] = QUIET  # the run worker's console: warnings only
    start = time.perf_counter()
    run_id = launch(context, params)
    while True:
        dequeue(context)
        status = instance.get_run_by_id(run_id).status
        if status == dg.DagsterRunStatus.SUCCESS:
            return time.perf_counter() - start
        if status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED):
            raise SystemExit(f"run {run_id} of {SOURCE} ended {status}")
        time.sleep(0.1)


def _contender(work: Path, name: str, below_mb: str | None, sizes: list[float], tasks: int) -> list[float]:
    """A fresh instance for ``name``; its re-shard times, one per entry of ``sizes``."""
    slug = "ours" if below_mb is None else "fanout"
    raw, out = work / slug / "raw", work / slug / "out"
    make_sample_source(raw / SOURCE, with_problems=False)
    home = demo.prepare_home(work / slug / "home")
    env = {"DAGSTER_HOME": str(home), "PID_RAW_ROOT": str(raw), "PID_OUTPUT_ROOT": str(out),
           "PYTHONPATH": str(ROOT)}
    saved = {k: os.environ.get(k) for k in [*env, IN_PROCESS_BELOW_ENV]}
    os.environ.update(env)
    if below_mb is None:
        os.environ.pop(IN_PROCESS_BELOW_ENV, None)
    else:
        os.environ[IN_PROCESS_BELOW_ENV] = below_mb
    try:
        with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
            instance.add_dynamic_partitions("sources", [SOURCE])
            first = _run(context, instance, write_tasks=tasks)
            print(f"  {name}: first build {first:.1f} s (untimed)", flush=True)
            return [_run(context, instance, write_tasks=tasks, max_shard_size_mb=mb) for mb in sizes]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2, help="re-shards per contender (alternating sizes)")
    ap.add_argument("--tasks", type=int, default=4, help="write tasks of each build")
    ap.add_argument("--work-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    sizes = [(0.25, 0.5)[r % 2] for r in range(args.repeat)]
    with tempfile.TemporaryDirectory(prefix="bench-ui-reshard-") as tmp:
        work = args.work_dir or Path(tmp)
        times = {name: _contender(work, name, below, sizes, args.tasks) for name, below in CONTENDERS.items()}
    print(f"\n{'contender':36s} {'best (s)':>9s} {'median (s)':>11s} {'vs fan-out':>11s}")
    ours, fanout = (times[n] for n in CONTENDERS)
    for name, ts in times.items():
        print(f"{name:36s} {min(ts):9.1f} {statistics.median(ts):11.1f} {min(fanout) / min(ts):10.1f}x")
    print(f"{'PASS' if min(ours) < TARGET_S else 'MISS'}: a small source's UI re-shard ({args.tasks} write tasks) "
          f"< {TARGET_S:.0f} s end to end ({min(ours):.1f} s; fan-out {min(fanout):.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
