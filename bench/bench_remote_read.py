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
  once, through the same proxy, nothing parsed.
* **Checked first:** each reader's samples (key, image bytes, caption bytes) equal the source's.
* **Timed:** ``--rounds`` rounds; in each, every (workers, decode) row runs each contender once, the
  order rotating round by round. Samples/s and MB/s (tar bytes of the samples / wall seconds), CPU
  seconds per 1000 samples (the process and its workers and curl children), bytes fetched per
  sample. Medians over rounds; ratios are medians of the within-round ratios.
* **Targets** (per delay, workers, decode): ours >= 1.0x LitData and >= 1.0x webdataset samples/s;
  ours >= 0.8x the floor with no decode; ours' bytes fetched <= 1.05x the bytes it handed out.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
LITDATA = "litdata==0.2.76"
LITDATA_INSTALLS = [["torch==2.13.0"], [LITDATA, "pillow"]]  # torch first: the CPU wheel, not a CUDA build
LITDATA_STAMP = {"v": 1, "installs": LITDATA_INSTALLS}
MODS = ("image", "caption")
FLOOR_CONNECTIONS = 16
FLOOR_PART = 8 << 20
DATA_V = 1


# -- the same decode for every reader ---------------------------------------------------------------

def decode_pil(image: bytes, caption: bytes) -> tuple[tuple[int, int], object]:
    from PIL import Image

    with Image.open(io.BytesIO(image)) as im:
        rgb = im.convert("RGB")
    return rgb.size, json.loads(bytes(caption))  # LitData hands bytes out as memoryviews


def _image_field(sample: dict) -> str:
    return next(k for k in sample if k.startswith("image."))


def ours_pil(sample: dict) -> dict:
    f = _image_field(sample)
    sample[f], sample["caption.json"] = decode_pil(sample[f], sample["caption.json"])
    return sample


def wds_pil(sample: dict) -> dict:
    f = _image_field(sample)
    sample[f], sample["caption.json"] = decode_pil(sample[f], sample["caption.json"])
    return sample


def as_list(batch: list) -> list:
    return batch


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _digest(key: str, image: bytes, caption: bytes) -> str:
    return hashlib.sha256(key.encode() + b"\0" + image + b"\0" + caption).hexdigest()


# -- children: one reader run each --------------------------------------------------------------------

def child_ours(args) -> None:
    from loader.io import StreamConfig
    from loader.wds.pipeline import build_dataset, make_loader

    urls = json.loads(Path(args.spec).read_text())["ours"]
    maps = [ours_pil] if args.decode == "pil" else []
    config = StreamConfig(read_ahead_bytes=0) if args.read_ahead_off else None
    t0, c0 = time.perf_counter(), _cpu_s()
    ds = build_dataset(urls, modalities=list(MODS), decode=None, shuffle=False, augment=maps, stream_config=config)
    ds.collate = as_list
    loader = make_loader(ds, batch_size=args.batch_size, num_workers=args.workers)
    setup = time.perf_counter() - t0
    n, digests, first = 0, [], None
    for batch in loader:
        n += len(batch)
        first = first or time.perf_counter() - t0
        if args.check:
            digests += [_digest(s["__key__"], s[_image_field(s)], s["caption.json"]) for s in batch]
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    st = loader.stats.get("stream", {})
    _result(samples=n, wall=wall, cpu=cpu, digests=sorted(digests), handed=st.get("bytes_handed", 0),
            fetched=st.get("bytes_read", 0), setup=setup, first=first, stream=st)


def child_wds(args) -> None:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = json.loads(Path(args.spec).read_text())["wds"]
    t0, c0 = time.perf_counter(), _cpu_s()
    ds = wds.WebDataset(urls, shardshuffle=False, workersplitter=wds.split_by_worker)
    if args.decode == "pil":
        ds = ds.map(wds_pil)
    ds = ds.batched(args.batch_size, collation_fn=as_list, partial=True)
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers)
    n, digests = 0, []
    for batch in loader:
        n += len(batch)
        if args.check:
            digests += [_digest(s["__key__"], s[_image_field(s)], s["caption.json"]) for s in batch]
    _result(samples=n, wall=time.perf_counter() - t0, cpu=_cpu_s() - c0, digests=sorted(digests))


def child_litdata(args) -> None:  # runs in the litdata virtualenv
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset

    # LitData reads chunks through obstore, which refuses a plain-HTTP endpoint unless its client
    # options allow it (our proxy is http:// on loopback; a real bucket is https://): the one
    # change made to the peer, in its own process.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}

    spec = json.loads(Path(args.spec).read_text())
    cache = tempfile.mkdtemp(prefix="litdata-cache-", dir=args.cache_root)
    decode = args.decode == "pil"

    class Photos(StreamingDataset):
        def __getitem__(self, index):
            s = super().__getitem__(index)
            if decode:
                s["image"], s["caption"] = decode_pil(s["image"], s["caption"])
            return s

    try:
        t0, c0 = time.perf_counter(), _cpu_s()
        ds = Photos(spec["litdata"], cache_dir=cache, shuffle=False)
        loader = StreamingDataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, collate_fn=as_list)
        n, digests = 0, []
        for batch in loader:
            n += len(batch)
            if args.check:
                digests += [_digest(s["key"], s["image"], s["caption"]) for s in batch]
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    _result(samples=n, wall=wall, cpu=cpu, digests=sorted(digests))


def child_litdata_optimize(args) -> None:  # runs in the litdata virtualenv
    import litdata

    tars = json.loads(Path(args.spec).read_text())["wds_local"]
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    litdata.optimize(fn=_litdata_samples, inputs=tars, output_dir=str(tmp), chunk_bytes="64MB", num_workers=1,
                     mode="overwrite")
    os.replace(tmp, out)


def _litdata_samples(tar_path: str):
    """The samples of one WebDataset tar, as LitData stores them (key, image bytes, caption bytes)."""
    import tarfile

    with tarfile.open(tar_path) as tf:
        cur: dict = {}
        for ti in tf:
            key, _, rest = ti.name.partition(".")
            if cur and cur["key"] != key:
                yield cur
                cur = {}
            cur["key"] = key
            cur["image" if rest.startswith("image.") else "caption"] = tf.extractfile(ti).read()
        if cur:
            yield cur


def child_floor(args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    spec = json.loads(Path(args.spec).read_text())
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    parts = [(b, k, o, min(FLOOR_PART, size - o)) for b, k, size in spec["floor"] for o in range(0, size, FLOOR_PART)]

    def get(part) -> int:
        b, k, o, n = part
        body = client.get_object(Bucket=b, Key=k, Range=f"bytes={o}-{o + n - 1}")["Body"]
        got = 0
        while chunk := body.read(1 << 20):
            got += len(chunk)
        return got

    t0, c0 = time.perf_counter(), _cpu_s()
    with ThreadPoolExecutor(FLOOR_CONNECTIONS) as pool:
        total = sum(pool.map(get, parts))
    _result(samples=spec["samples"], wall=time.perf_counter() - t0, cpu=_cpu_s() - c0, bytes=total)


# -- the shaping proxy (a child process) --------------------------------------------------------------

def child_proxy(args) -> None:
    """Forward 127.0.0.1:<port> to the S3 server: the first byte of each response waits
    ``delay`` after its request; each connection carries at most ``cap`` bytes/s. Prints its
    port, then the bytes forwarded to clients whenever a line arrives on stdin."""
    host, port = args.upstream.rsplit(":", 1)
    delay, cap = args.delay_ms / 1000, args.cap_mbps * 1e6
    forwarded = [0]

    async def pipe_up(reader, writer, state) -> None:
        while data := await reader.read(1 << 16):
            if not state["pending"]:
                state["pending"], state["asked"] = True, asyncio.get_running_loop().time()
            writer.write(data)
            await writer.drain()
        writer.close()

    async def pipe_down(reader, writer, state) -> None:
        loop = asyncio.get_running_loop()
        free_at = 0.0
        while data := await reader.read(1 << 16):
            now = loop.time()
            if state["pending"]:
                state["pending"] = False
                if state["asked"] + delay > now:
                    await asyncio.sleep(state["asked"] + delay - now)
                    now = loop.time()
                free_at = max(free_at, now)
            if free_at > now:
                await asyncio.sleep(free_at - now)
            free_at = max(free_at, loop.time()) + len(data) / cap
            forwarded[0] += len(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    async def handle(creader, cwriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection(host, int(port))
        except OSError:
            cwriter.close()
            return
        state = {"pending": False, "asked": 0.0}
        with _quiet():
            await asyncio.gather(pipe_up(creader, swriter, state), pipe_down(sreader, cwriter, state))

    async def control() -> None:
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(forwarded[0], flush=True)
        os._exit(0)  # the bench ended (stdin closed): so does the proxy

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await control()

    asyncio.run(main())


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is not None and issubclass(kind, (ConnectionError, OSError, asyncio.CancelledError))


class Proxy:
    def __init__(self, upstream: str, delay_ms: int, cap_mbps: float):
        from pid_platform.demo.local_s3 import _die_with_parent

        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", "proxy", "--upstream", upstream.split("//", 1)[1],
             "--delay-ms", str(delay_ms), "--cap-mbps", str(cap_mbps)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def forwarded(self) -> int:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- driver -------------------------------------------------------------------------------------------

CHILD_TIMEOUT_S = 240


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
        if args.child in ("ours", "wds", "litdata"):
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
        results: dict[tuple, list[dict]] = {}
        checks: dict[str, str] = {}
        for delay in delays:
            proxy = Proxy(server.endpoint_url, delay, args.cap_mbps)
            try:
                proxied = boto3_client(server, proxy.url)
                wds_urls = [proxied.generate_presigned_url("get_object", Params={
                    "Bucket": "bench", "Key": f"wds/{Path(t).name}"}, ExpiresIn=24 * 3600) for t in wds_tars]
                spec = cache_root / f"spec-{delay}.json"
                spec.write_text(json.dumps({"ours": manifests, "wds": wds_urls, "litdata": "s3://bench/litdata",
                                            "floor": floor, "samples": n}))
                env = {**server.env(), "AWS_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(ROOT)}

                def run(name: str, w: int, decode: str, check: bool = False, spec=spec, env=env, proxy=proxy) -> dict:
                    py = Path(sys.executable) if name != "litdata" else lit_py
                    child = {"ours": "ours", "ours, no read-ahead": "ours", "webdataset": "wds", "litdata": "litdata",
                             "floor": "floor"}[name]
                    argv = ["--child", child, "--spec", str(spec), "--workers", str(w), "--decode", decode,
                            "--batch-size", str(args.batch_size), "--cache-root", str(cache_root)]
                    if name == "ours, no read-ahead":
                        argv.append("--read-ahead-off")
                    before = proxy.forwarded()
                    res = run_child(py, argv + (["--check"] if check else []), env)
                    res["forwarded"] = proxy.forwarded() - before
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


def report(results: dict, delays, rows, contenders, n: int, tar_bytes: int, checks: dict) -> None:
    med = statistics.median
    print()
    print("| delay | workers | decode | reader | samples/s | MB/s | CPU-s / 1000 samples | fetched MB / 1000 samples | ours / reader |")
    print("|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for delay in delays:
        fl = results[(delay, "floor")]
        floor_rate = med(n / x["wall"] for x in fl)
        for w, d in rows:
            ours = results[(delay, w, d, "ours")]
            for name in contenders:
                runs = results[(delay, w, d, name)]
                if any(x.get("timed_out") for x in runs):  # no rate to compare: said, not guessed
                    print(f"| {delay} ms | {w} | {d} | {name} | timed out | | | | |")
                    if name not in ("ours", "ours, no read-ahead"):
                        verdicts.append((False, f"ours >= 1.0x {name} samples/s at {delay} ms, {w} workers, "
                                         f"decode {d}", f"{name} timed out after {CHILD_TIMEOUT_S} s"))
                    continue
                rate = med(x["samples"] / x["wall"] for x in runs)
                mbs = med(tar_bytes / 1e6 / x["wall"] for x in runs)
                cpu = med(x["cpu"] / max(1, x["samples"]) * 1000 for x in runs)
                fetched = med(x["forwarded"] / max(1, x["samples"]) * 1000 / 1e6 for x in runs)
                ratio = med(o["samples"] / o["wall"] / max(1e-9, x["samples"] / x["wall"]) for o, x in zip(ours, runs, strict=True))
                print(f"| {delay} ms | {w} | {d} | {name} | {rate:.0f} | {mbs:.0f} | {cpu:.2f} | {fetched:.1f} | "
                      f"{'' if name == 'ours' else f'{ratio:.2f}x'} |")
                if name not in ("ours", "ours, no read-ahead"):
                    verdicts.append((ratio >= 1.0, f"ours >= 1.0x {name} samples/s at {delay} ms, {w} workers, decode {d}",
                                     f"{ratio:.2f}x"))
            if d == "none":
                ratio = med(n / o["wall"] for o in ours) / floor_rate
                verdicts.append((ratio >= 0.8, f"ours >= 0.8x the x{FLOOR_CONNECTIONS} parallel-GET floor at {delay} ms, "
                                 f"{w} workers, decode none", f"{ratio:.2f}x: {med(n / o['wall'] for o in ours):.0f} vs "
                                 f"{floor_rate:.0f} samples/s"))
        print(f"| {delay} ms | - | - | floor (x{FLOOR_CONNECTIONS} ranged GETs) | {floor_rate:.0f} | "
              f"{med(tar_bytes / 1e6 / x['wall'] for x in fl):.0f} | {med(x['cpu'] / n * 1000 for x in fl):.2f} | "
              f"{med(x['forwarded'] / n * 1000 / 1e6 for x in fl):.1f} | |")
    seq = [x for (delay, *rest), runs in results.items() if rest[-1:] == ["ours"] and rest[0] == 0 for x in runs]
    if seq:
        factor = max(x["fetched"] / x["handed"] for x in seq) if all(x["handed"] for x in seq) else float("inf")
        verdicts.append((factor <= 1.05, "ours' bytes fetched <= 1.05x bytes handed out, sequential plan (0 workers)",
                         f"{factor:.3f}x at most"))
    verdicts.append((all(v == "equal" for v in checks.values()), "every reader's samples equal the source's",
                     ", ".join(f"{k}: {v}" for k, v in checks.items())))
    print()
    for ok, target, measured in verdicts:
        print(f"{'PASS' if ok else 'MISS'}: {target} ({measured})")


if __name__ == "__main__":
    main()
