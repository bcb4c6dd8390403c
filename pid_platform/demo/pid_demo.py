"""``pid-demo``, the main job: build every asset of the code location from a sample drop.

Makes a raw root of real photographs (``demo/raw/photos``, with some bad files, and a smaller
``demo/raw/photos-portrait``) and a small LeRobot v3 dataset with real AV1 video
(``demo/lerobot/so100-pick-demo``), points a persistent Dagster instance at ``.dagster_home``,
adds one ``sources`` partition per source and one ``lerobot_datasets`` partition per dataset,
materializes every asset (each source, the catalog, then each dataset's MP4 sidecar, its
blocking check and its publication) and prints what was built. Its runs are in that instance,
recorded with the code location of ``workspace.yaml`` as their origin (as runs launched from the
UI are), so ``dagster dev`` shows them on its Jobs and Overview pages and can re-execute them.
Running it again reuses what is up to date. Exit status 1 when a run or a check failed.

The instance is configured by the project's checked-in ``dagster.yaml`` (copied into
``.dagster_home``), and its pool limits are set before the first run (``defs/pools.py``).

The publication goes where ``PID_LEROBOT_PUBLISH`` says (default ``none``: nothing is published
and the summary says so); the roots are always the project's ``demo/`` folders.
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
from dagster._daemon.asset_daemon import set_auto_materialize_paused

from loader.formats.wdinfo import WDINFO_NAME, read_wdinfo
from loader.lerobot.sidecar import read_sidecar
from pid_platform.cli_args import int_at_least, local_path
from pid_platform.definitions import defs as load_defs
from pid_platform.defs.lerobot.automation import lerobot_sidecar_job
from pid_platform.defs.lerobot.partitions import LEROBOT_DATASETS
from pid_platform.defs.metadata import human_bytes
from pid_platform.defs.partitions import SOURCES
from pid_platform.defs.pools import apply_pool_limits
from pid_platform.demo.sample_data import PHOTOS, make_sample_source
from pid_platform.demo.sample_lerobot import write_v3_dataset
from pid_platform.demo.workspace_runs import WorkspaceRuns, open_workspace_runs
from pid_platform.sharding.layout import STATE_DIR

# A portrait-only source: a second partition, different buckets, quick to build.
PORTRAIT_RATIOS = ((3, 4), (2, 3), (9, 16))
PORTRAIT_PHOTOS = PHOTOS[:6]
# The LeRobot sample: two cameras (AV1 at g=2, as LeRobot encodes), six episodes of 1.6-2.5 s at
# 30 fps, three episodes per MP4 (so 2 files per camera). Written in a few seconds.
LEROBOT_DATASET = "so100-pick-demo"
LEROBOT_SAMPLE: dict = {
    "episodes_per_file": 3, "episode_lengths": (60, 75, 54, 66, 48, 72), "fps": 30, "size": (160, 120),
    "robot_type": "so100", "tasks": ("pick up the cube and place it in the bin", "push the cube to the left"),
}
# Steps run in this process, one after the other (as execute_in_process would): the demo's
# sources are small, and a process per step would cost more than the step.
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}, "execution": {"config": {"in_process": {}}}}
PROJECT = Path(__file__).resolve().parents[2]
INSTANCE_YAML = PROJECT / "dagster.yaml"
WORKSPACE_YAML = PROJECT / "workspace.yaml"
# First lines of the instance configs this project has written: such a copy is replaced by the
# checked-in one; any other dagster.yaml (someone's own, e.g. Postgres) is left alone.
_OUR_HEADERS = ("# The Dagster instance of this project", "# Instance of pid-demo and `dagster dev`")


@dataclass
class SourceOutcome:
    source: str
    ok: bool
    failed_checks: list[str] = field(default_factory=list)
    failed_steps: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # failed checks of severity WARN: reported, not failures


@dataclass
class LeRobotOutcome:
    """One ``lerobot_sidecar_build`` run: the assets' metadata as plain values, the check's outcome."""

    dataset: str
    ok: bool
    sidecar: dict = field(default_factory=dict)      # mp4_sidecar's metadata; empty when it failed
    published: dict = field(default_factory=dict)    # published_mp4_sidecar's; empty when it did not run
    check: dict | None = None                        # mp4_sidecar_is_valid: {"passed": .., **metadata}; None: did not run
    stream_check: dict | None = None                 # published_sidecar_streams, the same way
    failures: dict[str, str] = field(default_factory=dict)  # failed step -> the first line of its error


def prepare_home(home: Path) -> Path:
    """``home`` as a Dagster home configured by the checked-in ``dagster.yaml``, pool limits set."""
    if not INSTANCE_YAML.is_file():
        raise FileNotFoundError(f"{INSTANCE_YAML}: the project's instance config is missing; "
                                "restore it from git (git checkout -- dagster.yaml)")
    home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    if not target.exists() or target.read_text().startswith(_OUR_HEADERS):
        wanted = INSTANCE_YAML.read_text()
        if not target.exists() or target.read_text() != wanted:
            target.write_text(wanted)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        apply_pool_limits(instance)
        # The legacy global auto-materialize toggle: automation runs through this code location's
        # automation-condition sensor either way, but a paused toggle makes every job page say
        # "Auto-materialize off" while it does run.
        set_auto_materialize_paused(instance, False)
    return home


def _make_once(final: Path, make) -> bool:
    """``make(folder)`` into a hidden folder, then rename it to ``final``; False when ``final`` exists.

    The sensors skip hidden folders, so they never see a half-written source or dataset, and an
    interrupted demo leaves no partial one behind. An existing one is left untouched, so a second
    run rebuilds nothing.
    """
    if final.is_dir():
        return False
    partial = final.parent / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    make(partial)
    partial.rename(final)
    return True


def ensure_sample_source(raw: Path, name: str, **kwargs) -> bool:
    """Make the raw source ``raw/name`` unless it exists; False when it was already there."""
    return _make_once(raw / name, lambda folder: make_sample_source(folder, **kwargs))


def ensure_sample_lerobot(lerobot_root: Path, name: str = LEROBOT_DATASET, **overrides) -> bool:
    """Make the LeRobot v3 dataset ``lerobot_root/name`` (``LEROBOT_SAMPLE``, with ``overrides``)
    unless it exists; False when it was already there."""
    lerobot_root.mkdir(parents=True, exist_ok=True)
    return _make_once(lerobot_root / name,
                      lambda folder: write_v3_dataset(folder, **{**LEROBOT_SAMPLE, **overrides}))


def _outcome(source: str, result: dg.ExecutionResult) -> SourceOutcome:
    failed_steps = sorted(
        {e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE}
    )
    failed = [e for e in result.get_asset_check_evaluations() if not e.passed]
    failed_checks = [f"{e.asset_key.to_user_string()}:{e.check_name}" for e in failed
                     if e.severity != dg.AssetCheckSeverity.WARN]
    warnings = [f"{e.asset_key.to_user_string()}:{e.check_name}" for e in failed if e.severity == dg.AssetCheckSeverity.WARN]
    return SourceOutcome(source, result.success and not failed_checks, failed_checks, failed_steps, warnings)


def _plain(metadata: dict) -> dict:
    return {k: v.value if isinstance(v, dg.MetadataValue) else v for k, v in metadata.items()}


def _lerobot_outcome(dataset: str, result: dg.ExecutionResult) -> LeRobotOutcome:
    # With publishing off, published_mp4_sidecar records an observation (published: false), not a materialization.
    assets = {e.asset_observation_data.asset_observation.asset_key.to_user_string():
              _plain(e.asset_observation_data.asset_observation.metadata)
              for e in result.all_events if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION}
    assets.update({e.materialization.asset_key.to_user_string(): _plain(e.materialization.metadata)
                   for e in result.get_asset_materialization_events()})
    checks = {e.check_name: {"passed": e.passed, **_plain(e.metadata)} for e in result.get_asset_check_evaluations()}
    failures = {}
    for e in result.all_events:
        if e.event_type == dg.DagsterEventType.STEP_FAILURE:
            error = e.event_specific_data.error
            # Dagster wraps what the asset raised; its message is the cause's.
            while error is not None and error.cause is not None and (
                    error.cls_name.startswith("Dagster") or error.cls_name == "Failure"):
                error = error.cause
            message = (error.message if error else "failed").strip().splitlines()
            failures[e.step_key] = message[0] if message else "failed"
    check, stream_check = checks.get("mp4_sidecar_is_valid"), checks.get("published_sidecar_streams")
    unpublished = assets.get("published_mp4_sidecar", {}).get("published") is False  # nothing to stream
    ok = result.success and check is not None and check["passed"] and (
        unpublished or (stream_check is not None and stream_check["passed"]))
    return LeRobotOutcome(dataset, ok, assets.get("mp4_sidecar", {}), assets.get("published_mp4_sidecar", {}),
                          check=check, stream_check=stream_check, failures=failures)


def _measured_index_bytes(instance: dg.DagsterInstance, dataset: str, metadata: dict) -> int | None:
    """Bytes indexing the MP4s read: measured only when the sidecar is built, so for a kept
    sidecar it comes from the materialization that built these very bytes (same data version)."""
    if "index_bytes_read" in metadata:
        return metadata["index_bytes_read"]
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("mp4_sidecar"), asset_partitions=[dataset]), limit=50
    ).records
    versions = [r.asset_materialization.tags.get("dagster/data_version") for r in records]
    current = versions[0] if versions else None  # the one this run just recorded
    for record, version in zip(records, versions, strict=True):
        mat = record.asset_materialization
        if version == current and "index_bytes_read" in mat.metadata:
            return _plain(mat.metadata)["index_bytes_read"]
    return None


def build_lerobot(defs: dg.Definitions, runs: WorkspaceRuns) -> list[LeRobotOutcome]:
    """One ``lerobot_sidecar_build`` run per dataset under the ``lerobot`` resource's root: the
    sidecar, its blocking check, then the publish (what ``lerobot_datasets_sensor`` would request)."""
    datasets = []
    for dataset in defs.resources["lerobot"].datasets():
        if "..." in dataset or any(ord(c) < 32 for c in dataset):  # refused as partition keys, as by the sensor
            print(f"skipped LeRobot dataset folder {dataset!r}: rename it (no '...', no control characters)")
        else:
            datasets.append(dataset)
    instance = runs.instance
    known = set(instance.get_dynamic_partitions(LEROBOT_DATASETS))
    if new := [d for d in datasets if d not in known]:
        instance.add_dynamic_partitions(LEROBOT_DATASETS, new)
    outcomes = []
    for dataset in datasets:
        print(f"building mp4_sidecar of {dataset} ...", flush=True)
        result = runs.run(lerobot_sidecar_job.name, partition_key=dataset, run_config=QUIET,
                          tags={"pid/lerobot_dataset": dataset, "pid/launched_by": "pid-demo"})
        outcome = _lerobot_outcome(dataset, result)
        if outcome.sidecar:
            rebuilt = outcome.sidecar["rebuilt"]
            print(f"   {'built' if rebuilt else 'kept (it still matches the dataset)'}: {outcome.sidecar['sidecar']}")
            measured = _measured_index_bytes(instance, dataset, outcome.sidecar)
            if measured is not None:
                outcome.sidecar["index_bytes_read"] = measured
        outcomes.append(outcome)
    return outcomes


def build_everything(raw: Path, out: Path, home: Path, workers: int | None,
                     lerobot_root: Path) -> tuple[list[SourceOutcome], bool, list[LeRobotOutcome]]:
    # Set before anything reads them: the instance, and the resources of the code location.
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ["PID_RAW_ROOT"] = str(raw)
    os.environ["PID_OUTPUT_ROOT"] = str(out)
    os.environ["PID_LEROBOT_ROOT"] = str(lerobot_root)
    with dg.DagsterInstance.get() as instance, open_workspace_runs(instance, WORKSPACE_YAML) as runs:
        defs = load_defs()
        sources = defs.resources["source_store"].open().list_sources()
        known = set(instance.get_dynamic_partitions(SOURCES))
        if new := [s for s in sources if s not in known]:
            instance.add_dynamic_partitions(SOURCES, new)
        run_config = dict(QUIET)
        if workers is not None:
            run_config["resources"] = {"sharding": {"config": {"num_workers": workers}}}
        outcomes = []
        for source in sources:
            print(f"building {source} ...", flush=True)
            result = runs.run("source_build", partition_key=source, run_config=run_config,
                              tags={"pid/source": source, "pid/launched_by": "pid-demo"})
            outcomes.append(_outcome(source, result))
        print("building dataset_catalog ...", flush=True)
        catalog = runs.run("catalog_build", run_config=QUIET, tags={"pid/launched_by": "pid-demo"})
        lerobot = build_lerobot(defs, runs)
    return outcomes, catalog.success, lerobot


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
    if outcome.warnings:
        lines.append(f"   warnings: {', '.join(outcome.warnings)}")
    buckets = []
    for path in sorted(p for p in src.rglob(WDINFO_NAME) if STATE_DIR not in p.parts):
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


def _fraction(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "-"


def _video_kinds(sidecar: Path) -> str:
    """``av01 160x120`` (each codec and size of the sidecar's files, as indexed)."""
    try:
        with read_sidecar(sidecar) as sc:
            files = sc.manifest["files"]
    except (OSError, ValueError):
        return "?"
    return ", ".join(sorted({f"{f['codec']} {f['width']}x{f['height']}" for f in files}))


def describe_lerobot(outcome: LeRobotOutcome) -> list[str]:
    """The dataset's sidecar, check and publish, from the run's metadata."""
    lines = [f"== lerobot {outcome.dataset}: {'ok' if outcome.ok else 'FAILED'}"]
    lines += [f"   failed step {step}: {message}" for step, message in sorted(outcome.failures.items())]
    sc = outcome.sidecar
    rows: list[tuple[str, str]] = []
    if sc:
        video = sc["video_bytes"]
        if "index_bytes_read" in sc:
            read = f"{human_bytes(sc['index_bytes_read'])} of {human_bytes(video)} of video " \
                   f"({_fraction(sc['index_bytes_read'], video)}; boxes only, no media data)"
        else:  # not measured: what an index from the boxes reads at most
            read = f"at most {human_bytes(sc['header_bytes'])} (the non-media boxes) of {human_bytes(video)} " \
                   f"of video ({_fraction(sc['header_bytes'], video)})"
        revision = sc["revision_source"] if sc["revision"] == "(unpinned)" else \
            f"revision {sc['revision'][:12]} ({sc['revision_source']})"
        rows += [
            ("dataset", f"{sc['data_root']} ({sc['repo_id']}; {revision})"),
            ("MP4 files", f"{sc['files']} ({_video_kinds(Path(sc['sidecar']))}), {sc['samples']} samples"),
            ("index read", read),
            ("sidecar", f"{sc['sidecar']} ({human_bytes(sc['sidecar_bytes'])})"),
            ("compact index", f"{human_bytes(sc['compact_index_bytes'])} vs {human_bytes(sc['int64_array_bytes'])} "
                              f"as int64 arrays ({sc['compact_ratio']:.3f}x)"),
        ]
    check = outcome.check
    if check is None:
        rows.append(("check", "mp4_sidecar_is_valid did not run"))
    elif check["passed"]:
        rows.append(("check", f"mp4_sidecar_is_valid passed ({check.get('video_files', '?')} video files validated)"))
    else:
        problems = check.get("problems") or []
        rows.append(("check", f"mp4_sidecar_is_valid FAILED, {check.get('problems_count', len(problems))} "
                              f"problem(s): {'; '.join(map(str, problems[:3]))}"))
    pub = outcome.published
    if not pub:
        why = "failed" if "published_mp4_sidecar" in outcome.failures else "did not run"
        rows.append(("publish", f"published_mp4_sidecar {why}"))
    elif not pub["published"]:
        rows.append(("publish", f"not published: {pub['note']}"))
    else:
        what = "already published, unchanged," if pub["unchanged"] else "published"
        rows.append(("publish", f"{what} to {pub['target']} ({human_bytes(pub['bytes'])}"
                                + (f", commit {pub['commit'][:12]})" if pub.get("commit") else ")")))
    streamed = outcome.stream_check
    if streamed is None:
        rows.append(("streamed", "published_sidecar_streams did not run"
                     + (": nothing published to read back" if pub and not pub["published"] else "")))
    elif not streamed["published"]:
        rows.append(("streamed", "published_sidecar_streams passed: nothing published to read back"))
    elif streamed["passed"]:
        read = human_bytes(streamed["sidecar_bytes_fetched"])
        rows.append(("streamed", f"published_sidecar_streams passed (read back {read}, a batch of "
                                 f"{streamed['batch_size']} in {streamed['seconds']:.1f} s)"))
    else:
        problems = "; ".join(map(str, streamed["problems"][:3]))
        rows.append(("streamed", f"published_sidecar_streams FAILED: {problems}"))
    width = max(len(k) for k, _ in rows)
    return lines + [f"   {k.ljust(width)}  {v}" for k, v in rows]


def _workspace_file(root: Path) -> str:
    return "workspace.yaml" if WORKSPACE_YAML.parent == root else str(WORKSPACE_YAML)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pid-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=local_path("--root", kind="folder"), default=Path.cwd(),
                        help="project folder; demo/ and .dagster_home/ are made here (default: .)")
    parser.add_argument("--workers", type=int_at_least(1, 1024), default=None,
                        help="worker processes per build step (default: the sharding resource's)")
    parser.add_argument("--prepare-instance", type=local_path("--prepare-instance", kind="folder"), metavar="HOME",
                        default=None,
                        help="only make HOME a Dagster home with the project's dagster.yaml and pool "
                             "limits, then exit (./dev ui runs this)")
    args = parser.parse_args(argv)
    if args.prepare_instance is not None:
        try:
            prepare_home(args.prepare_instance.resolve())
        except OSError as exc:  # e.g. HOME/dagster.yaml is a folder, or a file is in the way
            parser.error(f"--prepare-instance {args.prepare_instance}: {exc}")
        return 0
    root = args.root.resolve()
    raw, out = root / "demo" / "raw", root / "demo" / "out"
    lerobot_root = root / "demo" / "lerobot"
    try:
        home = prepare_home(root / ".dagster_home")
        raw.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder of the demo goes, an unwritable --root
        parser.error(f"--root {root}: {exc}")
    if ensure_sample_source(raw, "photos", with_problems=True):
        print(f"made sample source {raw / 'photos'}")
    if ensure_sample_source(raw, "photos-portrait", photos=PORTRAIT_PHOTOS, ratios=PORTRAIT_RATIOS,
                            with_problems=False):
        print(f"made sample source {raw / 'photos-portrait'}")
    if ensure_sample_lerobot(lerobot_root):
        print(f"made sample LeRobot dataset {lerobot_root / LEROBOT_DATASET}")

    outcomes, catalog_ok, lerobot = build_everything(raw, out, home, args.workers, lerobot_root)

    print()
    for outcome in outcomes:
        print("\n".join(describe_source(out, outcome)))
        print()
    for dataset in lerobot:
        print("\n".join(describe_lerobot(dataset)))
        print()
    print(f"catalog: {out / 'catalog.json'} ({'ok' if catalog_ok else 'FAILED'})")
    print(f"Dagster instance: {home}")
    print(f"see the runs: cd {root} && DAGSTER_HOME={home} dagster dev -w {_workspace_file(root)}")
    ok = catalog_ok and all(o.ok for o in outcomes) and all(d.ok for d in lerobot)
    if not ok:
        print("pid-demo: some runs or checks failed (see above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
