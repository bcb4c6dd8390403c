"""``pid-demo``, the main job: build every asset of the code location from a sample drop.

Makes a raw root of real photographs (``demo/raw/photos``, with some bad files, and a smaller
``demo/raw/photos-portrait``), points a persistent Dagster instance at ``.dagster_home``, adds one
``sources`` partition per source, materializes every asset (each source, then the catalog) and
prints what was built. Its runs are in that instance, so ``dagster dev`` shows them afterwards.
Running it again reuses what is up to date. Exit status 1 when a run or a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from loader.formats.wdinfo import read_wdinfo
from pid_platform.build.layout import STATE_DIR
from pid_platform.definitions import defs as load_defs
from pid_platform.defs.partitions import SOURCES
from pid_platform.sample_data import PHOTOS, make_sample_source

# A portrait-only source: a second partition, different buckets, quick to build.
PORTRAIT_RATIOS = ((3, 4), (2, 3), (9, 16))
PORTRAIT_PHOTOS = PHOTOS[:6]
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
DAGSTER_YAML = """\
# Instance of pid-demo and `dagster dev`: Dagster's default storage (sqlite files in this folder).
telemetry:
  enabled: false
"""


@dataclass
class SourceOutcome:
    source: str
    ok: bool
    failed_checks: list[str] = field(default_factory=list)
    failed_steps: list[str] = field(default_factory=list)


def prepare_home(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text(DAGSTER_YAML)
    return home


def ensure_sample_source(raw: Path, name: str, **kwargs) -> bool:
    """Make ``raw/name`` unless it exists; False when it was already there.

    Written under a hidden name, then renamed: the sensor never sees a half-written source, and
    an interrupted demo leaves no partial one behind. An existing source is left untouched, so
    a second run rebuilds nothing.
    """
    final = raw / name
    if final.is_dir():
        return False
    partial = raw / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    make_sample_source(partial, **kwargs)
    partial.rename(final)
    return True


def _outcome(source: str, result: dg.ExecuteInProcessResult) -> SourceOutcome:
    failed_steps = sorted(
        {e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE}
    )
    failed_checks = [
        f"{e.asset_key.to_user_string()}:{e.check_name}" for e in result.get_asset_check_evaluations() if not e.passed
    ]
    return SourceOutcome(source, result.success and not failed_checks, failed_checks, failed_steps)


def build_everything(raw: Path, out: Path, home: Path, workers: int | None) -> tuple[list[SourceOutcome], bool]:
    # Set before anything reads them: the instance, and the store resource of the code location.
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ["PID_RAW_ROOT"] = str(raw)
    os.environ["PID_OUTPUT_ROOT"] = str(out)
    with dg.DagsterInstance.get() as instance:
        defs = load_defs()
        sources = defs.resources["source_store"].open().list_sources()
        known = set(instance.get_dynamic_partitions(SOURCES))
        if new := [s for s in sources if s not in known]:
            instance.add_dynamic_partitions(SOURCES, new)
        job = defs.resolve_job_def("source_build")
        run_config = dict(QUIET)
        if workers is not None:
            run_config["resources"] = {"sharding": {"config": {"num_workers": workers}}}
        outcomes = []
        for source in sources:
            print(f"building {source} ...", flush=True)
            result = job.execute_in_process(
                instance=instance, partition_key=source, run_config=run_config, raise_on_error=False,
                tags={"pid/source": source, "pid/launched_by": "pid-demo"},
            )
            outcomes.append(_outcome(source, result))
        print("building dataset_catalog ...", flush=True)
        catalog = defs.resolve_job_def("catalog_build").execute_in_process(
            instance=instance, run_config=QUIET, raise_on_error=False, tags={"pid/launched_by": "pid-demo"}
        )
    return outcomes, catalog.success


def _table(headers: tuple[str, ...], rows: list[tuple], align: str) -> list[str]:
    """Plain-text table; ``align`` holds ``l`` or ``r`` per column."""
    cells = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)
        ).rstrip()

    return [line(headers), line(tuple("-" * w for w in widths)), *(line(r) for r in cells)]


def describe_source(out: Path, outcome: SourceOutcome) -> list[str]:
    """What is on disk for a source, read back from its manifests and intake report."""
    src = out / outcome.source
    # A failed build leaves the last committed output in place; that is what is shown below.
    status = "ok" if outcome.ok else "FAILED (last committed output shown)"
    lines = [f"== {outcome.source}: {status}"]
    if outcome.failed_steps:
        lines.append(f"   failed steps: {', '.join(outcome.failed_steps)}")
    if outcome.failed_checks:
        lines.append(f"   failed checks: {', '.join(outcome.failed_checks)}")
    buckets = []
    for path in sorted(p for p in src.rglob("wdinfo.json") if STATE_DIR not in p.parts):
        man = read_wdinfo(path)
        buckets.append((man.bucket or "(flat)", len(man.tars), man.total_key_count,
                        sum(sum(t.bytes.values()) for t in man.tars)))
    if buckets:
        total = ("total", *(sum(b[i] for b in buckets) for i in (1, 2, 3)))
        rows = [(name, shards, samples, f"{size / 2**20:.1f} MiB") for name, shards, samples, size in [*buckets, total]]
        lines += ["   " + x for x in _table(("bucket", "shards", "samples", "size"), rows, "lrrr")]
    report_path = src / STATE_DIR / "intake_report.json"
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        dropped = [(reason, n, ", ".join(report["examples"].get(reason, [])[:3]))
                   for reason, n in report["dropped"].items()]
        skipped = [(f"file {reason}", n, ", ".join(report["examples"].get(reason, [])[:3]))
                   for reason, n in report["skipped_files"].items()]
        lines.append(f"   kept {report['samples']} samples, dropped {report['dropped_total']}")
        if dropped or skipped:
            lines += ["   " + x for x in _table(("dropped because", "samples", "examples"), dropped + skipped, "lrl")]
    return lines


def _workspace_file(root: Path) -> str:
    workspace = Path(__file__).resolve().parents[1] / "workspace.yaml"
    return "workspace.yaml" if workspace.parent == root else str(workspace)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pid-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="project folder; demo/ and .dagster_home/ are made here (default: .)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes per build step (default: the sharding resource's)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    raw, out, home = root / "demo" / "raw", root / "demo" / "out", prepare_home(root / ".dagster_home")
    raw.mkdir(parents=True, exist_ok=True)
    if ensure_sample_source(raw, "photos", with_problems=True):
        print(f"made sample source {raw / 'photos'}")
    if ensure_sample_source(raw, "photos-portrait", photos=PORTRAIT_PHOTOS, ratios=PORTRAIT_RATIOS,
                            with_problems=False):
        print(f"made sample source {raw / 'photos-portrait'}")

    outcomes, catalog_ok = build_everything(raw, out, home, args.workers)

    print()
    for outcome in outcomes:
        print("\n".join(describe_source(out, outcome)))
        print()
    print(f"catalog: {out / 'catalog.json'} ({'ok' if catalog_ok else 'FAILED'})")
    print(f"Dagster instance: {home}")
    print(f"see the runs: cd {root} && DAGSTER_HOME={home} dagster dev -w {_workspace_file(root)}")
    ok = catalog_ok and all(o.ok for o in outcomes)
    if not ok:
        print("pid-demo: some runs or checks failed (see above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
