"""examples/train_policy.py as a user runs it: torchrun, 2 ranks, gloo, DataLoader workers. Killed
with SIGKILL (every process of it) after a checkpoint, started again with the same command, it
finishes; and counting the steps of the last checkpoint before the kill plus the steps after the
restart, every LeRobot frame / every twin-tar key was trained on exactly once per epoch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from pid_platform.sharding.pipeline import build_source
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import open_source_store
from tests.support.dist import _loopback_ifname, run_distributed
from tests.support.lerobot_data import LEROBOT_V3_EPISODES
from tests.support.process_tree import kill_process_tree, wait_until_gone

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "examples" / "train_policy.py"
REPO_ID = "local/arm"
EPOCHS = 2
SEED = 5
KILL_AFTER_STEP = 3      # the first checkpoint at or after this step triggers the kill
STEP_DELAY_S = 0.3       # so that the kill lands mid-run even on a fast machine
START_TIMEOUT_S = 180.0  # generous: the runners' 2 cores are shared
FINISH_TIMEOUT_S = 240.0
# data kind -> (batch size, DataLoader workers per rank, checkpoint every)
CASES = {"lerobot": (4, 2, 3), "twin-tars": (3, 2, 3)}


@pytest.fixture(scope="module")
def twin_tars(tmp_path_factory: pytest.TempPathFactory, photo_drop_template: Path) -> Path:
    out = tmp_path_factory.mktemp("train-twin-tars") / "photos"
    build_source(open_source_store(str(photo_drop_template)), "photos", out, ShardingConfig(shard_size=3))
    return out


def reference(rank: int, world_size: int, kind: str, root: str, batch_size: int, workers: int) -> dict:
    """What each of 2 ranks must train on per epoch, from the loaders themselves (not the script)."""
    if kind == "lerobot":
        from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader

        ds = StreamingLeRobotDataset(REPO_ID, root=root, seed=SEED)
        loader = make_loader(ds, batch_size=batch_size, num_workers=workers)
        return {"batches": len(loader), "samples": ds.samples_per_rank(workers), "ids": None}
    from loader.wds.pipeline import build_dataset, make_loader

    loader = make_loader(build_dataset(root, modalities=["image"], seed=SEED, batch_size=batch_size, decode=None),
                         num_workers=workers)
    batches = list(loader)
    return {"batches": len(batches), "samples": sum(len(b["__key__"]) for b in batches),
            "ids": [k for b in batches for k, pad in zip(b["__key__"], b["__pad__"].tolist(), strict=True) if not pad]}


def launch(cmd: list[str], env: dict[str, str], output: Path) -> subprocess.Popen:
    with open(output, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True)


def checkpoint_steps(folder: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in folder.glob("ckpt-*.pt"))


def latest_checkpoint(folder: Path) -> dict:
    step = checkpoint_steps(folder)[-1]
    ckpt = torch.load(folder / f"ckpt-{step:08d}.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == step
    return ckpt


def wait_for_checkpoint(folder: Path, min_step: int, proc: subprocess.Popen, output: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        done = [s for s in checkpoint_steps(folder) if s >= min_step]
        if done:
            return done[0]
        if proc.poll() is not None:
            pytest.fail(f"the job exited ({proc.returncode}) before a checkpoint at step {min_step}:\n"
                        + output.read_text()[-6000:])
        time.sleep(0.02)
    kill_process_tree(proc.pid)
    proc.wait()
    pytest.fail(f"no checkpoint at step >= {min_step} within {START_TIMEOUT_S}s:\n" + output.read_text()[-6000:])


def trained_history(log: Path) -> tuple[list[dict], list[int]]:
    """The step records a rank's training counts, and where each restart resumed from: a run's
    records after the step its successor resumed from were lost with the kill."""
    runs: list[tuple[int, list[dict]]] = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            runs.append((record["resumed_from_step"], []))
        elif "step" in record and "ids" in record:
            runs[-1][1].append(record)
    kept: list[dict] = []
    for i, (_, records) in enumerate(runs):
        until = runs[i + 1][0] if i + 1 < len(runs) else None
        kept.extend(r for r in records if until is None or r["step"] <= until)
    return kept, [start for start, _ in runs]


@pytest.mark.parametrize("kind", list(CASES))
def test_killed_job_resumes_and_trains_on_each_sample_once_per_epoch(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    batch_size, workers, every = CASES[kind]
    root = request.getfixturevalue("lerobot_v3_root" if kind == "lerobot" else "twin_tars")
    ref = run_distributed(reference, world_size=2, args=(kind, str(root), batch_size, workers), timeout=120,
                          env={"HF_LEROBOT_HOME": str(tmp_path / "reference-home")})
    # The same batches on every rank (DDP); LeRobot ranks of whole episodes may hold different samples.
    assert ref[0]["batches"] == ref[1]["batches"]
    total_steps = EPOCHS * ref[0]["batches"]

    ckpt_dir = tmp_path / "ckpt"
    output = tmp_path / "job.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_LEROBOT_HOME": str(tmp_path / "lerobot-home"), "OMP_NUM_THREADS": "1"}
    if (ifname := _loopback_ifname()) is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(SCRIPT),
           "--data", kind, "--root", str(root), "--checkpoint-dir", str(ckpt_dir), "--epochs", str(EPOCHS),
           "--batch-size", str(batch_size), "--num-workers", str(workers), "--checkpoint-every", str(every),
           "--log-every", "2", "--seed", str(SEED), "--step-delay-s", str(STEP_DELAY_S)]
    if kind == "lerobot":
        cmd += ["--repo-id", REPO_ID]

    first = launch(cmd, env, output)
    wait_for_checkpoint(ckpt_dir, KILL_AFTER_STEP, first, output)
    groups = kill_process_tree(first.pid)
    first.wait(timeout=30)
    assert first.returncode == -9
    assert wait_until_gone(groups, 10.0) == [], f"processes of the killed job survive in groups {groups}"
    resumed_from = latest_checkpoint(ckpt_dir)["step"]
    assert KILL_AFTER_STEP <= resumed_from < total_steps, "the kill must land mid-run, or it proves nothing"
    for rank in range(2):
        assert '"done"' not in (ckpt_dir / f"samples-rank{rank}.jsonl").read_text()

    second = launch(cmd, env, output)
    try:
        rc = second.wait(timeout=FINISH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_process_tree(second.pid)
        second.wait()
        pytest.fail(f"the resumed job did not finish in {FINISH_TIMEOUT_S}s:\n" + output.read_text()[-6000:])
    assert rc == 0, output.read_text()[-6000:]
    if kind == "lerobot":   # the progress lines carry the loader's batch-wait percentiles
        assert re.search(r"batch wait p50/p95/p99 [\d.]+/[\d.]+/[\d.]+ ms", output.read_text())
    final = latest_checkpoint(ckpt_dir)
    assert final["step"] == total_steps and final["epoch"] == EPOCHS

    histories = []
    for rank in range(2):
        history, starts = trained_history(ckpt_dir / f"samples-rank{rank}.jsonl")
        assert starts == [0, resumed_from]
        assert [r["step"] for r in history] == list(range(1, total_steps + 1))
        histories.append(history)
    for epoch in range(EPOCHS):
        per_rank = [[r for r in h if r["epoch"] == epoch] for h in histories]
        ids = [[i for r in records for i in r["ids"]] for records in per_rank]
        assert [len(x) for x in ids] == [ref[0]["samples"], ref[1]["samples"]], f"epoch {epoch}: samples per rank"
        if kind == "lerobot":
            frames = range(sum(LEROBOT_V3_EPISODES))
            # Each rank trains on its own episodes; padding repeats frames of those only, marked.
            assert not set(ids[0]) & set(ids[1]), f"epoch {epoch}: a frame trained on by both ranks"
            real = sorted(i for records in per_rank for r in records
                          for i, pad in zip(r["ids"], r["pad"], strict=True) if not pad)
            assert real == list(frames), f"epoch {epoch}: frames not trained on exactly once"
        else:
            real = Counter(i for records in per_rank for r in records
                           for i, pad in zip(r["ids"], r["pad"], strict=True) if not pad)
            expected = Counter(ref[0]["ids"] + ref[1]["ids"])
            assert len(expected) == 32 and set(expected.values()) == {1}
            assert real == expected, f"epoch {epoch}: keys not trained on exactly once"


@pytest.mark.parametrize("kind", list(CASES))
def test_kill_9_of_the_trainer_leaves_no_dataloader_worker(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # One plain process (no torchrun) with 2 DataLoader workers, killed alone: nothing else sends
    # its workers a signal, so only their own death-with-the-parent can end them.
    from tests.support.procs import descendants, wait_gone

    root = request.getfixturevalue("lerobot_v3_root" if kind == "lerobot" else "twin_tars")
    ckpt_dir = tmp_path / "ckpt"
    output = tmp_path / "job.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_LEROBOT_HOME": str(tmp_path / "lerobot-home"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--data", kind, "--root", str(root), "--checkpoint-dir", str(ckpt_dir),
           "--epochs", "50", "--batch-size", "2", "--num-workers", "2", "--checkpoint-every", "1000",
           "--step-delay-s", "0.2"]
    if kind == "lerobot":
        cmd += ["--repo-id", REPO_ID]
    job = launch(cmd, env, output)
    log = ckpt_dir / "samples-rank0.jsonl"
    workers: set[int] = set()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        # Training has begun (a step is logged) and both workers run.
        while time.monotonic() < deadline and not (len(workers) == 2 and log.exists() and '"step"' in log.read_text()):
            if job.poll() is not None:
                pytest.fail(f"the trainer exited ({job.returncode}) before its first step:\n" + output.read_text()[-6000:])
            workers = descendants(job.pid)
            time.sleep(0.05)
        assert len(workers) == 2, f"expected 2 DataLoader workers, found {sorted(workers)}:\n{output.read_text()[-3000:]}"
    finally:
        job.kill()
        job.wait()
    # PyTorch's own watchdog would notice the dead parent only after 5 s, and only if the worker
    # were idle; the kernel kills ours at once.
    left = wait_gone(workers, timeout=3.0)
    assert not left, f"DataLoader workers {sorted(left)} still run 3 s after kill -9 of their trainer"


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_policy_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_leaves_padding_repeats_out_of_the_loss() -> None:
    ex = _example()
    torch.manual_seed(0)
    pad = torch.tensor([False, True, False, True])
    real = ~pad

    lerobot = object.__new__(ex.LeRobotTask)
    lerobot.cameras = ["observation.images.front"]
    stats = {k: (torch.zeros(3), torch.ones(3)) for k in ("observation.state", "action")}
    policy = ex.TinyPolicy(lerobot.cameras, stats)
    batch = {"observation.images.front": torch.rand(4, 3, 8, 8), "observation.state": torch.randn(4, 3),
             "action": torch.randn(4, 3), "__pad__": pad}
    twin = object.__new__(ex.TwinTarTask)
    net = ex.AspectNet()
    twin_batch = {"letterboxed": torch.rand(4, 3, 32, 32), "log_aspect": torch.randn(4), "__pad__": pad}
    for task, model, b, target in ((lerobot, policy, batch, "action"), (twin, net, twin_batch, "log_aspect")):
        without = {k: v[real] for k, v in b.items()}
        garbage = {**b, target: b[target].clone()}
        garbage[target][pad] = 1e6   # a repeat's target must not move the loss at all
        assert torch.allclose(task.loss(model, garbage), task.loss(model, {**without, "__pad__": pad[real]}))
        only_pads = {**b, "__pad__": torch.ones(4, dtype=torch.bool)}
        loss = task.loss(model, only_pads)
        loss.backward()
        assert loss.item() == 0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
        model.zero_grad(set_to_none=True)
        assert task.pads(b) == pad.tolist()
