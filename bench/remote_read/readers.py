"""The readers bench_remote_read times, each run as a child process (``--child <name>``):
ours, webdataset, LitData (in its own virtualenv: only the standard library at import time
here), ``litdata.optimize``, and the parallel-GET floor. Each prints one ``RESULT {json}`` line."""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

MODS = ("image", "caption")
FLOOR_CONNECTIONS = 16
FLOOR_PART = 8 << 20


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


def _peak_rss_mb() -> tuple[float, float]:
    """(this process's peak RSS, the largest of its ended children's: DataLoader workers), MB.

    This process's is its own image's high-water mark (``VmHWM``): ``ru_maxrss`` survives the
    exec that started it, so every reader whose peak stayed below the driver's RSS at the fork
    (353 MB at 3,000 samples) reported the driver's. Workers are forked, not exec'd: theirs
    counts the pages they share with this process, as the kernel does."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    try:
        with open("/proc/self/status") as fh:
            hwm = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
        return hwm / 1024, kids
    except (OSError, StopIteration, ValueError):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, kids


def _result(**kw) -> None:
    rss, child_rss = _peak_rss_mb()
    print("RESULT " + json.dumps({**kw, "rss_mb": rss, "child_rss_mb": child_rss}), flush=True)


def _digest(key: str, image: bytes, caption: bytes) -> str:
    return hashlib.sha256(key.encode() + b"\0" + image + b"\0" + caption).hexdigest()


# -- children: one reader run each --------------------------------------------------------------------

def child_ours(args) -> None:
    import boto3  # noqa: F401 - imported before the clock starts, as each peer's library is

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
    # LitData hands raw bytes out as memoryviews, which a worker cannot pickle into the
    # DataLoader's queue: its feeder thread prints "cannot pickle memoryview objects" and the
    # batch never arrives (the 240 s hang at 2 workers without decode). In workers they become
    # bytes, the copy pickling makes anyway (ours and webdataset hand bytes out).
    to_bytes = args.workers > 0 and not decode

    class Photos(StreamingDataset):
        def __getitem__(self, index):
            s = super().__getitem__(index)
            if decode:
                s["image"], s["caption"] = decode_pil(s["image"], s["caption"])
            elif to_bytes:
                s["image"], s["caption"] = bytes(s["image"]), bytes(s["caption"])
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


def _get_part(client, part) -> bytes:
    b, k, o, n = part
    body = client.get_object(Bucket=b, Key=k, Range=f"bytes={o}-{o + n - 1}")["Body"]  # past the end: to it
    chunks = []
    while chunk := body.read(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


class _FloorParts:
    """The floor's parts as a DataLoader dataset: worker w fetches parts w, w + workers, ... with
    ``FLOOR_CONNECTIONS // workers`` GETs at once and hands each part's bytes through the
    DataLoader, as every reader with workers hands its samples (pickled into a queue)."""

    def __init__(self, parts: list, client, connections: int):
        self.parts, self.client, self.connections = parts, client, connections

    def __iter__(self):
        from concurrent.futures import ThreadPoolExecutor

        from torch.utils.data import get_worker_info

        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        with ThreadPoolExecutor(self.connections) as pool:
            yield from pool.map(lambda part: _get_part(self.client, part), self.parts[w::n])


def child_floor(args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    spec = json.loads(Path(args.spec).read_text())
    parts = [(b, k, o, min(FLOOR_PART, size - o)) for b, k, size in spec["floor"] for o in range(0, size, FLOOR_PART)]
    workers = int(args.workers or 0)
    if workers:
        # Imported before the clock, as ours is.
        from torch.utils.data import DataLoader, IterableDataset

        class Parts(_FloorParts, IterableDataset):
            pass
    t0, c0 = time.perf_counter(), _cpu_s()
    # Its client is made on the clock, as every reader's is (0.1 s: the S3 service model); the
    # readers' own lists of what to read (manifests, key indexes, index.json) are not the floor's.
    # With workers it is made before they are forked and used only by them (as ours makes theirs).
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    if args.discover:
        # "floor with discovery": first one round of GETs of the objects any reader of these tars
        # must read to learn what to read (ours' manifests, all at once), then the same parts:
        # what ours pays before its first range, and the floor above does not.
        with ThreadPoolExecutor(FLOOR_CONNECTIONS) as pool:
            list(pool.map(lambda bk: _get_part(client, (*bk, 0, 1 << 30)), spec["discover"]))
        if workers:  # forked workers must not share the pooled sockets it used: a client of their own, as ours makes
            client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    if workers:
        loader = DataLoader(Parts(parts, client, max(1, FLOOR_CONNECTIONS // workers)), batch_size=None,
                            num_workers=workers)
        total = sum(len(b) for b in loader)
    else:
        with ThreadPoolExecutor(FLOOR_CONNECTIONS) as pool:
            total = sum(len(b) for b in pool.map(lambda part: _get_part(client, part), parts))
    _result(samples=spec["samples"], wall=time.perf_counter() - t0, cpu=_cpu_s() - c0, bytes=total)
