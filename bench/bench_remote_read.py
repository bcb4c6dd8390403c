"""Reading photographs from a bucket: our twin tars vs LitData and webdataset, and the parallel-GET floor.

    python bench/bench_remote_read.py [--samples 1500] [--shard-mb 16] [--delays 20,60] [--cap-mbps 50]
                                      [--workers 0,2] [--decodes none,pil] [--rounds 3] [--batch-size 32]
                                      [--work-dir DIR] [--skip-litdata]

* **Storage:** a real S3 server (SeaweedFS ``weed mini``, ``pid_platform.demo.local_s3``) behind a
  shaping proxy of our own on 127.0.0.1 (a child process): each response's first byte waits
  ``--delays`` ms after its request (a cloud bucket's time to first byte), and each connection
  carries at most ``--cap-mbps`` MB/s (about what one S3 connection gives). The proxy counts the
  bytes it forwards: "fetched/sample" is that count over the samples read.
* **Data:** scikit-image's photographs (``bench/_data.py``: JPEG and PNG, replicated under new
  names) with a JSON caption each, built into twin tars by ``build_source``; read are the image
  and caption modalities. The same samples (the same bytes) as
  - one plain WebDataset tar per shard (``<key>.image.<ext>``, ``<key>.caption.json``), read by the
    real ``webdataset`` over presigned HTTP URLs (its ``curl`` pipe, one stream per shard);
  - LitData chunks (``litdata.optimize``, the real ``litdata==0.2.76`` in its own virtualenv under
    the work folder, CPU torch installed first), read by ``litdata.StreamingDataset`` from
    ``s3://`` (its parallel chunk downloads; chunks cached on local disk, a fresh cache per run;
    its obstore client is allowed plain HTTP, the proxy's, and nothing else is changed).
* **Contenders** (``--baseline`` adds ``ours, no read-ahead``: ``StreamConfig(read_ahead_bytes=0)``,
  one open-ended stream per tar, the reader before the read-ahead; each run a fresh process; batches of ``--batch-size`` samples as lists, no
  stacking): ``ours`` (``build_dataset(s3 manifests, shuffle=False)`` + ``make_loader``, default
  ``StreamConfig``: the read-ahead on), ``webdataset``, ``litdata``; at ``--workers`` DataLoader
  workers, with no decode or PIL decode (``Image.open(...).convert("RGB")`` and ``json.loads`` of
  the caption, the same function for all, run where each reader maps samples: in its workers).
  ``floor``: the same twin-tar bytes (image + caption tars) fetched as 8 MiB ranged GETs, 16 at
  once, through the same proxy, nothing parsed; its boto3 client is made on the clock, as every
  reader's is. ``floor over N workers`` (for each ``--workers`` N > 0): the same GETs split over N
  DataLoader workers (16 / N at once in each), each part's bytes handed to the training process
  through the DataLoader, as every reader with workers hands its samples: the best any reader can
  do in that configuration. Both floors are reported; the target is stated against each. Neither
  floor learns what to read: ``floor with discovery`` (each of them again, reported, no target)
  first GETs the manifests ours reads, all at once, as ours must before its first range. LitData's raw bytes (memoryviews) become ``bytes`` in its workers: a worker cannot
  pickle a memoryview into the DataLoader's queue (it hung at 2 workers without decode).
* **Checked first:** each reader's samples (key, image bytes, caption bytes) equal the source's.
* **Timed:** ``--rounds`` rounds; in each, every (workers, decode) row runs each contender once, the
  order rotating round by round. Samples/s and MB/s (tar bytes of the samples / wall seconds), CPU
  seconds per 1000 samples (the process and its workers and curl children), bytes fetched per
  sample. Medians over rounds; ratios are medians of the within-round ratios. Beside them, what the
  storage cost the same 2 CPUs during each run ("server + proxy CPU-s / 1000 samples": SeaweedFS's
  and the proxy's CPU time, from ``/proc``): a cloud bucket and its network take none of the
  reader's CPU, so where a reader is CPU-bound (workers, decode) this is time the bench takes from
  it and a real bucket would not. SeaweedFS reads a whole stored chunk (4 MiB) for every ranged
  GET, so its share grows with the number of GETs, not only with the bytes.
* **The proxy's own rate:** before the rounds, a few 8 MiB ranged GETs over one connection say
  what one connection really carries through it, its first-byte delay included (8 MiB at 50 MB/s
  after 20 ms: 44 MB/s); reported, no target. ``tests/test_bench_shaping_proxy.py`` holds it to
  its cap. (The asyncio proxy before it carried 25-30 MB/s under a 50 MB/s cap: every run of this
  bench before 2026-12-06 measured connections at about half the stated cap.)
* **Targets** (per delay, workers, decode): ours >= 1.0x LitData and >= 1.0x webdataset samples/s;
  ours >= 0.8x the floor with no decode; ours' bytes fetched <= 1.05x the bytes it handed out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))  # the bench's parts (remote_read/), also in the peers' virtualenvs

from remote_read.proxy import Proxy, child_proxy  # noqa: E402
from remote_read.readers import (  # noqa: E402
    MODS,
    _digest,
    _image_field,
    child_floor,
    child_litdata,
    child_litdata_optimize,
    child_ours,
    child_wds,
)
from remote_read.report import CHILD_TIMEOUT_S, report  # noqa: E402

LITDATA = "litdata==0.2.76"
LITDATA_INSTALLS = [["torch==2.13.0"], [LITDATA, "pillow"]]  # torch first: the CPU wheel, not a CUDA build
LITDATA_STAMP = {"v": 1, "installs": LITDATA_INSTALLS}
DATA_V = 1


# -- driver -------------------------------------------------------------------------------------------

def run_child(py: Path, argv: list[str], env: dict) -> dict:
    try:
        out = subprocess.run([str(py), __file__, *argv], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Seen once with LitData at 2 workers (its obstore client in forked workers): the run
        # counts as 0 samples in CHILD_TIMEOUT_S seconds, and the bench goes on.
        print(f"[timed out after {CHILD_TIMEOUT_S} s: {' '.join(argv[:2])} {' '.join(argv[4:10])}]", flush=True)
        return {"samples": 0, "wall": float(CHILD_TIMEOUT_S), "cpu": 0.0, "digests": [], "handed": 0, "fetched": 0,
                "timed_out": True}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"child {argv} failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far; 0 off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def connection_rate(client, bucket: str, key: str, size: int, tries: int = 3) -> tuple[float, float]:
    """(MB/s, first byte ms): the median of ``tries`` GETs of 8 MiB (or the object) over one
    connection of ``client`` (the proxy's): what one connection carries through it."""
    n = min(size, 8 << 20)
    rates, firsts = [], []
    for _ in range(tries):
        t0 = time.perf_counter()
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{n - 1}")["Body"]
        got = len(body.read(1))
        first = time.perf_counter() - t0
        while chunk := body.read(1 << 20):
            got += len(chunk)
        rates.append(got / 1e6 / (time.perf_counter() - t0))
        firsts.append(first * 1000)
    return sorted(rates)[tries // 2], sorted(firsts)[tries // 2]


def prepare(work: Path, args, log=print):
    """(twin tar output folder, webdataset tars, litdata chunk folder or None, reference digests, sizes)."""
    sys.path.insert(0, str(BENCH))
    from _data import combined_tars, twin_dataset

    from loader.wds.discovery import load_wdinfo
    from loader.wds.pipeline import build_dataset

    out = twin_dataset(work, args.samples, args.shard_mb, log=log)
    table = load_wdinfo(str(out), modalities=list(MODS)).tar_files
    wds_tars = combined_tars(table, work / f"wds-n{args.samples}-s{args.shard_mb:g}", MODS)
    ref, tar_bytes = [], 0
    for s in build_dataset(str(out), modalities=list(MODS), decode=None, shuffle=False):
        f = _image_field(s)
        ref.append(_digest(s["__key__"], s[f], s["caption.json"]))
    for shard in table:
        tar_bytes += sum(os.path.getsize(shard.url(m)) for m in MODS)
    return out, table, wds_tars, sorted(ref), tar_bytes


def ensure_litdata(work: Path, wds_tars: list[str], args, log=print) -> tuple[Path, Path]:
    sys.path.insert(0, str(BENCH))
    from _venv import peer_venv

    py = peer_venv(work / "litdata-venv", LITDATA_STAMP, LITDATA_INSTALLS,
                   "import litdata, torch; print(litdata.__version__, torch.__version__)", log=log)
    chunks = work / f"litdata-n{args.samples}-s{args.shard_mb:g}-v{DATA_V}"
    if not (chunks / "index.json").is_file():
        spec = work / "litdata-optimize.json"
        spec.write_text(json.dumps({"wds_local": wds_tars}))
        log(f"[data] litdata.optimize -> {chunks}")
        run = subprocess.run([str(py), __file__, "--child", "litdata-optimize", "--spec", str(spec), "--out",
                              str(chunks)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"litdata.optimize failed:\n{run.stderr[-3000:]}")
    return py, chunks


def upload(client, bucket: str, prefix: str, folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder).as_posix()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=("ours", "wds", "litdata", "litdata-optimize", "floor", "proxy"))
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--shard-mb", type=float, default=16)
    ap.add_argument("--delays", default="20,60")
    ap.add_argument("--cap-mbps", type=float, default=50)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--decodes", default="none,pil")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pid-bench-remote")
    ap.add_argument("--skip-litdata", action="store_true")
    ap.add_argument("--baseline", action="store_true",
                    help="also run ours with the read-ahead off (one open-ended stream per tar: the reader before it)")
    ap.add_argument("--read-ahead-off", action="store_true")
    ap.add_argument("--discover", action="store_true", help="(floor child) GET the manifests first")
    # child arguments
    ap.add_argument("--spec")
    ap.add_argument("--decode")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--cache-root")
    ap.add_argument("--out")
    ap.add_argument("--upstream")
    ap.add_argument("--delay-ms", type=int)
    args = ap.parse_args()
    if args.child:
        if args.child in ("ours", "wds", "litdata", "floor"):
            args.workers = int(args.workers)
        {"ours": child_ours, "wds": child_wds, "litdata": child_litdata, "litdata-optimize": child_litdata_optimize,
         "floor": child_floor, "proxy": child_proxy}[args.child](args)
        return

    from pid_platform.demo import local_s3

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    out, table, wds_tars, ref, tar_bytes = prepare(work, args)
    contenders = ["ours", "webdataset"] + (["ours, no read-ahead"] if args.baseline else [])
    lit_py = None
    if not args.skip_litdata:
        lit_py, chunks = ensure_litdata(work, wds_tars, args)
        contenders.append("litdata")
    delays = [int(x) for x in args.delays.split(",")]
    workers = [int(x) for x in args.workers.split(",")]
    decodes = args.decodes.split(",")
    n = len(ref)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; {n} samples "
          f"({tar_bytes / 1e6:.0f} MB of image + caption tars in {len(table)} shards); proxy: first byte "
          f"+{args.delays} ms, {args.cap_mbps:g} MB/s per connection; {args.rounds} rounds, order rotating; "
          f"batch {args.batch_size}")

    server = local_s3.start()
    cache_root = Path(tempfile.mkdtemp(prefix="remote-read-", dir=work))
    try:
        client = boto3_client(server)
        client.create_bucket(Bucket="bench")
        upload(client, "bench", "twin", out)
        upload(client, "bench", "wds", Path(wds_tars[0]).parent)
        if lit_py is not None:
            upload(client, "bench", "litdata", chunks)
        from loader.wds.discovery import find_manifests

        manifests = [f"s3://bench/twin/{Path(m).relative_to(out).as_posix()}" for m in find_manifests(str(out))]
        floor = [("bench", f"twin/{Path(shard.url(m)).relative_to(out).as_posix()}", os.path.getsize(shard.url(m)))
                 for shard in table for m in MODS]
        discover = [("bench", m[len("s3://bench/"):]) for m in manifests]
        results: dict[tuple, list[dict]] = {}
        checks: dict[str, str] = {}
        for delay in delays:
            proxy = Proxy(__file__, server.endpoint_url, delay, args.cap_mbps)
            try:
                proxied = boto3_client(server, proxy.url)
                wds_urls = [proxied.generate_presigned_url("get_object", Params={
                    "Bucket": "bench", "Key": f"wds/{Path(t).name}"}, ExpiresIn=24 * 3600) for t in wds_tars]
                big = max(floor, key=lambda f: f[2])
                rate, first_ms = connection_rate(proxied, *big)
                print(f"proxy at {delay} ms: one connection carries {rate:.0f} MB/s on an 8 MiB range (cap "
                      f"{args.cap_mbps:g} MB/s), first byte after {first_ms:.0f} ms", flush=True)
                spec = cache_root / f"spec-{delay}.json"
                spec.write_text(json.dumps({"ours": manifests, "wds": wds_urls, "litdata": "s3://bench/litdata",
                                            "floor": floor, "discover": discover, "samples": n}))
                env = {**server.env(), "AWS_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(ROOT)}

                def run(name: str, w: int, decode: str, check: bool = False, spec=spec, env=env, proxy=proxy,
                        discover: bool = False) -> dict:
                    py = Path(sys.executable) if name != "litdata" else lit_py
                    child = {"ours": "ours", "ours, no read-ahead": "ours", "webdataset": "wds", "litdata": "litdata",
                             "floor": "floor"}[name]
                    argv = ["--child", child, "--spec", str(spec), "--workers", str(w), "--decode", decode,
                            "--batch-size", str(args.batch_size), "--cache-root", str(cache_root)]
                    if name == "ours, no read-ahead":
                        argv.append("--read-ahead-off")
                    if discover:
                        argv.append("--discover")
                    before = proxy.forwarded()
                    storage_cpu = process_cpu_s(server.process.pid) + process_cpu_s(proxy.proc.pid)
                    res = run_child(py, argv + (["--check"] if check else []), env)
                    res["forwarded"] = proxy.forwarded() - before
                    res["storage_cpu"] = process_cpu_s(server.process.pid) + process_cpu_s(proxy.proc.pid) - storage_cpu
                    return res

                if not checks:
                    for name in contenders:
                        got = run(name, 0, "none", check=True)
                        checks[name] = ("equal" if got["digests"] == ref else
                                        f"DIFFERENT ({len(got['digests'])} samples, {len(set(got['digests']) & set(ref))} equal)")
                    print("checked against the source (key, image bytes, caption bytes): "
                          + ", ".join(f"{k} {v}" for k, v in checks.items()))
                rows = [(w, d) for w in workers for d in decodes]
                for r in range(args.rounds):
                    order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
                    results.setdefault((delay, "floor"), []).append(run("floor", 0, "none"))
                    results.setdefault((delay, "floor+d"), []).append(run("floor", 0, "none", discover=True))
                    for w in workers:  # the same GETs over w DataLoader workers, handed through it
                        if w:
                            results.setdefault((delay, "floor", w), []).append(run("floor", w, "none"))
                            results.setdefault((delay, "floor+d", w), []).append(run("floor", w, "none", discover=True))
                    for w, d in rows:
                        for name in order:
                            results.setdefault((delay, w, d, name), []).append(run(name, w, d))
                    print(f"[round {r + 1}/{args.rounds} at {delay} ms done, load {os.getloadavg()[0]:.2f}]", flush=True)
            finally:
                proxy.stop()
        report(results, delays, rows, contenders, n, tar_bytes, checks)
    finally:
        local_s3.stop(server)
        shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(cache_root, ignore_errors=True)


def boto3_client(server, endpoint: str | None = None):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint or server.endpoint_url, aws_access_key_id=server.access_key,
                        aws_secret_access_key=server.secret_key, region_name=server.region,
                        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))


if __name__ == "__main__":
    main()
