"""A tiny but real training job that reads its data through ``loader``, checkpoints, and resumes.

    torchrun --nproc_per_node 2 examples/train_policy.py --data lerobot --root demo/lerobot/so100-pick-demo \\
        --checkpoint-dir /tmp/ckpt-lerobot
    torchrun --nproc_per_node 2 examples/train_policy.py --data twin-tars --root demo/out/photos \\
        --checkpoint-dir /tmp/ckpt-photos
    torchrun --nproc_per_node 2 examples/train_policy.py --data twin-tars --root blend --catalog demo/out \\
        --checkpoint-dir /tmp/ckpt-blend      # a weighted mixture defined in demo/out/catalog.json

* ``--data lerobot``: ``StreamingLeRobotDataset`` over a LeRobot v3 dataset; a small conv encoder
  per camera plus a state MLP predicts the action (MSE).
* ``--data twin-tars``: twin tars through ``loader.wds.pipeline``; each image is letterboxed into
  32x32 (its shape survives as black borders) and a small conv net predicts log(width / height).
  ``--image-size N`` declares ``Resize(N)`` to the loader (``build_dataset(image_transform=)``):
  the images arrive with their shorter side N, a JPEG decoded at a DCT scale instead of whole.

Both loaders give every rank the same number of batches; where a rank has fewer samples they add
repeats, flagged ``__pad__`` in the batch, which the loss leaves out (a batch of repeats only
still takes its DDP step, with no gradient). Launched by torchrun it trains with DDP over gloo
(CPU); run plainly it is one process. Every
``--checkpoint-every`` steps every rank takes the loader's state (a collective) and rank 0 writes
model + optimizer + step + loader state atomically (temp name, fsync, rename). On start the
latest checkpoint in ``--checkpoint-dir`` is resumed, so a job killed at any moment finishes with
each sample trained on exactly once per epoch, counting from the checkpoint it resumed. Each rank
appends what it trained on to ``samples-rank<R>.jsonl`` there (one JSON line per step, flushed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loader.io import urls
from loader.wds.errors import LoaderError

CHECKPOINT_FORMAT = "pid-train-policy/1"
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
KEEP_CHECKPOINTS = 2
LETTERBOX = 32
PROG = "train_policy"
# What bad data or a bad checkpoint raises from the loaders (each message names the file and the fix).
DATA_ERRORS = (LoaderError, ValueError, OSError)


# -- arguments -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, choices=["lerobot", "twin-tars"], help="what --root holds")
    p.add_argument("--root", required=True,
                   help="lerobot: a LeRobot v3 dataset (folder, s3://, http(s)://, hf://); "
                        "twin-tars: a build output folder, wdinfo.json, glob or catalog name")
    p.add_argument("--catalog", help="twin-tars only: the output root (or catalog.json) that resolves a dataset "
                                      "name in --root, e.g. a weighted mixture defined in the catalog")
    p.add_argument("--repo-id", help="lerobot only: the dataset's OWNER/NAME (default: local/<folder name>)")
    p.add_argument("--checkpoint-dir", required=True, type=Path, help="checkpoints and per-rank sample logs")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--image-size", type=int,
                   help="twin-tars only: the images' shorter side in training; declared to the loader as "
                        "loader.wds.image.Resize(N), so a JPEG is decoded at the DCT scale that keeps N, not whole")
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="sleep after each step (slows a demo down enough to interrupt it)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("num_workers", "seed", "step_delay_s"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if args.repo_id is not None and args.data != "lerobot":
        p.error("--repo-id applies to --data lerobot only")
    if args.catalog is not None and args.data != "twin-tars":
        p.error("--catalog applies to --data twin-tars only")
    if args.image_size is not None and args.data != "twin-tars":
        p.error("--image-size applies to --data twin-tars only")
    if args.image_size is not None and args.image_size < LETTERBOX:
        p.error(f"--image-size must be at least the {LETTERBOX}-pixel letterbox, got {args.image_size}")
    # A twin-tars --root may also be a glob or a catalog name (no slash); anything else must exist.
    local = not urls.has_scheme(args.root) and not any(c in args.root for c in "*?[")
    if local and (args.data == "lerobot" or "/" in args.root) and not Path(args.root).exists():
        p.error(f"--root {args.root}: no such file or folder")
    if args.data == "lerobot" and args.repo_id is None:
        args.repo_id = f"local/{Path(args.root.rstrip('/')).name or 'dataset'}"
    return args


# -- models ----------------------------------------------------------------------------------------

def conv_encoder(out_dim: int) -> nn.Module:
    """(B, 3, H, W) in [0, 1] -> (B, out_dim), for any H and W."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, out_dim), nn.ReLU(),
    )


class TinyPolicy(nn.Module):
    """Cameras + robot state -> action: one conv encoder per camera, an MLP over the state.
    State and action are normalised with the dataset's mean and std, as LeRobot's policies do."""

    def __init__(self, cameras: list[str], stats: dict[str, tuple[torch.Tensor, torch.Tensor]], width: int = 64):
        super().__init__()
        self.cameras = cameras
        for key, name in (("observation.state", "state"), ("action", "action")):
            mean, std = stats[key]
            self.register_buffer(f"{name}_mean", mean)
            self.register_buffer(f"{name}_std", std.clamp_min(1e-6))
        state_dim, action_dim = len(stats["observation.state"][0]), len(stats["action"][0])
        self.encoders = nn.ModuleList(conv_encoder(width) for _ in cameras)
        self.state = nn.Sequential(nn.Linear(state_dim, width), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(width * (len(cameras) + 1), width), nn.ReLU(), nn.Linear(width, action_dim))

    def forward(self, images: list[torch.Tensor], state: torch.Tensor) -> torch.Tensor:
        """The normalised action."""
        feats = [enc(img) for enc, img in zip(self.encoders, images, strict=True)]
        state = (state - self.state_mean) / self.state_std
        return self.head(torch.cat([*feats, self.state(state)], dim=1))

    def normalise_action(self, action: torch.Tensor) -> torch.Tensor:
        return (action - self.action_mean) / self.action_std


class AspectNet(nn.Module):
    """A letterboxed image -> log(width / height) of the original."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(conv_encoder(width), nn.Linear(width, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image).squeeze(1)


# -- data ------------------------------------------------------------------------------------------

class Task:
    """One data kind: its loader, its model, and how a batch becomes a loss and sample ids."""

    def __init__(self, loader: Any, model: nn.Module, summary: str):
        self.loader = loader
        self.model = model
        self.summary = summary

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def ids(self, batch: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def pads(self, batch: dict[str, Any]) -> list[bool]:
        return [bool(p) for p in batch["__pad__"]]


def masked_mse(pred: torch.Tensor, target: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """MSE over the samples that are not padding repeats (``pad``: (B,) bool). A batch of repeats
    only gives 0 with a zero gradient, so every rank still takes the step."""
    per_sample = (pred - target).pow(2).reshape(len(pred), -1).mean(dim=1)
    keep = (~pad.to(torch.bool)).to(per_sample.dtype)
    return (per_sample * keep).sum() / keep.sum().clamp_min(1.0)


class LeRobotTask(Task):
    def __init__(self, args: argparse.Namespace, rank: int):
        from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader

        ds = StreamingLeRobotDataset(args.repo_id, root=args.root, seed=args.seed)
        features = ds.meta.features
        missing = [k for k in ("observation.state", "action") if k not in features]
        if missing or not ds.video_keys:
            raise SystemExit(f"{PROG}: error: {args.root} ({args.repo_id}) has no "
                             f"{', '.join(missing) or 'camera (video feature)'}; this policy needs "
                             f"observation.state, action and at least one camera (features: {sorted(features)})")
        workers = ds.num_workers_for(args.num_workers)
        if workers < args.num_workers and rank == 0:
            print(f"{PROG}: --num-workers {args.num_workers} is more than the smallest rank's episodes; "
                  f"using {workers}", flush=True)
        self.cameras = list(ds.video_keys)
        model = TinyPolicy(self.cameras, feature_stats(ds, ("observation.state", "action"), rank))
        super().__init__(make_loader(ds, batch_size=args.batch_size, num_workers=workers), model,
                         f"{args.repo_id}: {ds.num_episodes} episodes, {ds.num_frames} frames, "
                         f"cameras {self.cameras}, {workers} workers per rank")

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        pred = model([batch[c] for c in self.cameras], batch["observation.state"])
        target = (model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model).normalise_action(
            batch["action"])
        return masked_mse(pred, target, batch["__pad__"])

    def ids(self, batch: dict[str, Any]) -> list[Any]:
        return [int(i) for i in batch["index"]]


class TwinTarTask(Task):
    def __init__(self, args: argparse.Namespace, rank: int):
        from loader.wds.image import Resize
        from loader.wds.pipeline import build_dataset, make_loader

        # The resize is declared to the loader (it decodes at that size); the letterbox stays an augment.
        transform = Resize(args.image_size) if args.image_size else None
        ds = build_dataset(args.root, catalog=args.catalog, modalities=["image"], seed=args.seed,
                           image_transform=transform, augment=[letterbox_sample])
        super().__init__(make_loader(ds, batch_size=args.batch_size, num_workers=args.num_workers), AspectNet(),
                         f"{args.root}: {int(sum(ds.shards.counts))} samples in {len(ds.shards.counts)} shards, "
                         f"{args.num_workers} workers per rank")

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return masked_mse(model(batch["letterboxed"]), batch["log_aspect"], batch["__pad__"])

    def ids(self, batch: dict[str, Any]) -> list[Any]:
        return list(batch["__key__"])


def letterbox_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """Shrink the image into a LETTERBOX square, keeping its shape (black borders), and add the
    target: log(width / height) of the decoded image. Runs in the DataLoader workers."""
    from PIL import Image

    image = sample.pop("image").convert("RGB")
    w, h = image.size
    scale = LETTERBOX / max(w, h)
    small = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)
    canvas = Image.new("RGB", (LETTERBOX, LETTERBOX))
    canvas.paste(small, ((LETTERBOX - small.width) // 2, (LETTERBOX - small.height) // 2))
    pixels = torch.frombuffer(bytearray(canvas.tobytes()), dtype=torch.uint8).view(LETTERBOX, LETTERBOX, 3)
    sample["letterboxed"] = pixels.permute(2, 0, 1).float() / 255.0
    sample["log_aspect"] = torch.tensor(math.log(w / h), dtype=torch.float32)
    return sample


def feature_stats(ds: Any, keys: tuple[str, ...], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(mean, std) of each vector feature from the dataset's ``meta/stats.json``; without that
    file, (0, 1) of the feature's size, said once."""
    from loader.io import roots as fs

    stats: dict[str, Any] = {}
    if fs.exists(ds.root, "meta/stats.json"):
        stats = json.loads(fs.read_bytes(ds.root, "meta/stats.json"))
    out = {}
    for key in keys:
        size = int(math.prod(ds.meta.features[key].get("shape") or [1]))
        entry = stats.get(key, {})
        if "mean" in entry and "std" in entry:
            mean, std = torch.tensor(entry["mean"], dtype=torch.float32), torch.tensor(entry["std"], dtype=torch.float32)
            if mean.numel() != size or std.numel() != size:
                raise SystemExit(f"{PROG}: error: {ds.root} meta/stats.json: {key} mean/std have "
                                 f"{mean.numel()}/{std.numel()} values, the feature has {size}")
        else:
            if rank == 0:
                print(f"{PROG}: {ds.root} has no mean/std of {key} in meta/stats.json; training it unnormalised",
                      flush=True)
            mean, std = torch.zeros(size), torch.ones(size)
        out[key] = (mean.reshape(size), std.reshape(size))
    return out


# -- distributed -----------------------------------------------------------------------------------

def init_distributed() -> tuple[int, int]:
    """gloo from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT); else one process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def lockstep(loader: Any) -> Iterator[dict[str, Any]]:
    """The loader's batches while every rank still has one. DDP needs every rank in each step;
    both loaders give every rank the same number of batches, and this checks it each step."""
    it = iter(loader)
    while True:
        batch = next(it, None)
        if distributed():
            have = torch.tensor([int(batch is not None)])
            dist.all_reduce(have)
            if 0 < int(have) < dist.get_world_size():
                raise RuntimeError(f"rank {dist.get_rank()}: ranks ran out of batches at different steps "
                                   f"({int(have)} of {dist.get_world_size()} still have one); DDP needs equal counts")
        if batch is None:
            return
        yield batch


def mean_over_ranks(value: float) -> float:
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


# -- checkpoints -----------------------------------------------------------------------------------

def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_NAME.match(p.name))]
    return sorted(found)


def save_checkpoint(folder: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` so that a reader sees the whole file or none: temp name, fsync, rename."""
    final = folder / f"ckpt-{payload['step']:08d}.pt"
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)
    for _, old in checkpoints(folder)[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)
    return final


def load_latest(folder: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """Rank 0's choice of the latest checkpoint, loaded on every rank (they all read the same file)."""
    found = checkpoints(folder)
    if not distributed() or dist.get_rank() == 0:
        for stale in folder.glob(".ckpt-*.tmp"):  # a write the last run was killed in
            stale.unlink(missing_ok=True)
    choice = [str(found[-1][1]) if found else None]
    if distributed():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    ckpt = torch.load(choice[0], map_location="cpu", weights_only=True)
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"{PROG}: error: {choice[0]} is not a checkpoint of this script "
                         f"(format {ckpt.get('format')!r}); use an empty --checkpoint-dir")
    if ckpt.get("data") != args.data or ckpt.get("root") != args.root:
        raise SystemExit(f"{PROG}: error: {choice[0]} was trained with --data {ckpt.get('data')} "
                         f"--root {ckpt.get('root')}; resume with those or use an empty --checkpoint-dir")
    return ckpt


# -- training --------------------------------------------------------------------------------------

def train(args: argparse.Namespace) -> int:
    rank, world = init_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP checks it too)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    try:
        task: Task = LeRobotTask(args, rank) if args.data == "lerobot" else TwinTarTask(args, rank)
    except DATA_ERRORS as exc:  # the loaders' errors name the file and the fix: say just that
        raise SystemExit(f"{PROG}: error: {type(exc).__name__}: {exc}") from None
    model = task.model
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    ckpt = load_latest(args.checkpoint_dir, args)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        try:
            task.loader.load_state_dict(ckpt["loader"])  # before iterating: continues the epoch exactly
        except DATA_ERRORS as exc:
            raise SystemExit(f"{PROG}: error: cannot resume from the checkpoint in {args.checkpoint_dir}: "
                             f"{type(exc).__name__}: {exc}") from None
        step = int(ckpt["step"])
    trained = nn.parallel.DistributedDataParallel(model) if distributed() else model
    log = open(args.checkpoint_dir / f"samples-rank{rank}.jsonl", "a")  # noqa: SIM115 - closed below
    log.write(json.dumps({"event": "start", "resumed_from_step": step, "world_size": world,
                          "epoch": task.loader.epoch}) + "\n")
    log.flush()
    if rank == 0:
        how = f"resumed at step {step}, epoch {task.loader.epoch}" if ckpt is not None else "from scratch"
        print(f"{PROG}: {args.data} {task.summary}; {world} rank(s), {how}", flush=True)

    def checkpoint() -> None:
        state = task.loader.state_dict()  # a collective: every rank calls it
        if rank == 0:
            save_checkpoint(args.checkpoint_dir, {
                "format": CHECKPOINT_FORMAT, "data": args.data, "root": args.root, "step": step,
                "epoch": task.loader.epoch, "world_size": world, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "loader": state})

    started, samples, loss_value = time.monotonic(), 0, float("nan")
    while task.loader.epoch < args.epochs:
        epoch = task.loader.epoch
        for batch in lockstep(task.loader):
            loss = task.loss(trained, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            ids = task.ids(batch)
            samples += len(ids)  # repeats included: what the loader handed out
            record = {"step": step, "epoch": epoch, "ids": ids, "pad": task.pads(batch)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step % args.log_every == 0:
                loss_value = mean_over_ranks(loss.item())
                if rank == 0:
                    rate = samples / max(time.monotonic() - started, 1e-9)
                    print(f"step {step:6d}  epoch {epoch}  loss {loss_value:.4f}  {rate:.1f} samples/s per rank"
                          f"{wait_summary(task.loader)}", flush=True)
            if step % args.checkpoint_every == 0:
                checkpoint()
            if args.step_delay_s:
                time.sleep(args.step_delay_s)
    checkpoint()  # the final state: a restart finds the run finished
    log.write(json.dumps({"event": "done", "step": step}) + "\n")
    log.close()
    if rank == 0:
        print(f"{PROG}: done: {step} steps, {args.epochs} epochs, {samples} samples per rank in this run, "
              f"last logged loss {loss_value:.4f}; checkpoint {checkpoints(args.checkpoint_dir)[-1][1]}",
              flush=True)
    if distributed():
        dist.destroy_process_group()
    return 0


def wait_summary(loader: Any) -> str:
    """The loader's batch-wait and refill percentiles (LeRobot's troubleshooting compares p95/p99
    batch wait), where the loader reports them."""
    stats = getattr(loader, "stats", None)
    stats = stats() if callable(stats) else {}   # the twin-tar loader's stats is a dict of counters
    if "batch_wait_s_p50" not in stats:
        return ""
    waits = "/".join(f"{stats[f'batch_wait_s_p{q}'] * 1000:.1f}" for q in (50, 95, 99))
    refill = "/".join(f"{stats[f'refill_p{q}']:.2f}" for q in (50, 95, 99))
    return f"  batch wait p50/p95/p99 {waits} ms  refill p50/p95/p99 {refill}"


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
