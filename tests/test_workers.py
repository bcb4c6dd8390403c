"""loader.workers: DataLoader workers that die with their parent (the kill tests themselves, with a
real trainer of each reader, are in test_examples_training.py)."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loader.workers import WorkerInit, worker_init

REPO = Path(__file__).resolve().parents[1]
PR_GET_PDEATHSIG = 2

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _pdeathsig() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    out = ctypes.c_int(0)
    assert libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(out), 0, 0, 0) == 0
    return out.value


class _Report(IterableDataset):
    """Each worker yields (its id, its parent-death signal, what the user's init recorded)."""

    def __iter__(self):
        info = get_worker_info()
        yield torch.tensor([info.id, _pdeathsig(), int(os.environ.get("USER_INIT_RAN", "-1"))])


def _user_init(worker_id: int) -> None:
    os.environ["USER_INIT_RAN"] = str(worker_id)


def test_workers_get_sigkill_on_parent_death_and_the_users_init_still_runs() -> None:
    loader = DataLoader(_Report(), batch_size=None, num_workers=2, worker_init_fn=worker_init(_user_init))
    rows = sorted(tuple(t.tolist()) for t in loader)
    assert rows == [(0, int(signal.SIGKILL), 0), (1, int(signal.SIGKILL), 1)]
    # Under the spawn and forkserver start methods the init travels pickled.
    again = pickle.loads(pickle.dumps(worker_init(_user_init)))
    assert isinstance(again, WorkerInit) and again.user_fn is _user_init


def test_wrapping_twice_runs_the_users_init_once() -> None:
    once = worker_init(worker_init(_user_init))
    assert isinstance(once, WorkerInit) and once.user_fn is _user_init
    with pytest.raises(TypeError, match="worker_init_fn must be callable"):
        worker_init("not a function")  # type: ignore[arg-type]


def test_a_parent_already_gone_when_the_signal_is_set_kills_the_child_at_once() -> None:
    # The race the check closes: the expected parent is not the one we have any more.
    code = "from loader.workers import die_with_parent; die_with_parent(parent_pid=1); print('still alive')"
    res = subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGKILL and "still alive" not in res.stdout, res.stdout + res.stderr
