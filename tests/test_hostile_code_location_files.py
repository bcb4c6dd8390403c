"""Hostile settings files the code location reads when it loads (listed in
``tests/test_hostile_inputs.py``): ``$PID_DATASETS`` and ``$PID_EXECUTOR_CONFIG``.

The webserver, the daemon and every run process load the code location, so each of these must
end in the module's own error naming the file (and the key), in well under a second and a few
MB; ``yaml.safe_load`` turned the 400-byte alias bomb into a 700 MB message, waited forever on
the pipe and let ``UnicodeDecodeError``/``RecursionError``/``TypeError`` out without the file.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from loader.mixture.definition import MixtureError
from pid_platform.defs.datasets.definitions import DATASETS_ENV, dataset_definitions
from pid_platform.defs.executors import EXECUTOR_CONFIG_ENV, ExecutorConfigError, executor_default

TIME_BUDGET_S = 1.0  # measured: milliseconds
MEMORY_BUDGET = 50 * 1024 * 1024

# Nine levels of nine aliases: 9**9 "lol"s once expanded (the 400-byte bomb).
_LAUGHS = b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + b"".join(
    b"%c: &%c [*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c]\n" % ((ord("a") + i + 1,) * 2 + (ord("a") + i,) * 9)
    for i in range(9))

# case -> (content, or None for a FIFO; text the message must hold besides the file)
CASES: dict[str, tuple[bytes | None, str]] = {
    "alias bomb": (_LAUGHS, "anchor"),
    "a FIFO with no writer": (None, "not a regular file"),
    "non-UTF-8": (b"blend: [caf\xe9]\n", "UTF-8"),
    "nesting 30000 deep (libyaml's own limit)": (b"blend: " + b"[" * 30000 + b"]" * 30000, "nesting depth"),
    "nesting 40 deep (ours)": (b"blend: " + b"[" * 40 + b"]" * 40, "blend[0][0]"),
    "mixed-type keys": (b"blend:\n  sources:\n    1: {weight: 1}\n    a: {weight: 1}\n", "blend.sources.1"),
    "mixed-type keys at the top": (b"1: [a]\nceleryx: {}\n", "1"),
}

READERS: dict[str, tuple[str, type[Exception], Callable[[dict[str, str]], object]]] = {
    "PID_DATASETS": (DATASETS_ENV, MixtureError, dataset_definitions),
    "PID_EXECUTOR_CONFIG": (EXECUTOR_CONFIG_ENV, ExecutorConfigError, executor_default),
}


def _measured(read: Callable[[], object]) -> None:
    # A bomb read by yaml.safe_load takes 35 s and 2.5 GB: run it in a thread so a regression
    # fails on time instead of taking the machine with it.
    errors: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    tracemalloc.start()
    start = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIME_BUDGET_S * 5)
    took = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not thread.is_alive(), "the read did not end"
    assert took < TIME_BUDGET_S and peak < MEMORY_BUDGET, (took, peak)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_code_location_settings_file_ends_quickly_in_a_named_error(
        tmp_path: Path, reader: str, case: str) -> None:
    env, error, read = READERS[reader]
    data, names = CASES[case]
    path = tmp_path / "settings.yaml"
    if data is None:
        os.mkfifo(path)
    else:
        path.write_bytes(data)
    with pytest.raises(error) as exc:
        _measured(lambda: read({env: str(path)}))
    message = str(exc.value)
    assert str(path) in message and names in message, message
    assert len(message) < 600


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_folder_or_a_missing_file_is_a_named_error(tmp_path: Path, reader: str) -> None:
    env, error, read = READERS[reader]
    with pytest.raises(error, match="not a regular file"):
        read({env: str(tmp_path)})
    with pytest.raises(error, match=f"{tmp_path / 'gone.yaml'}: cannot read it"):
        read({env: str(tmp_path / "gone.yaml")})


def test_plain_code_location_settings_still_read(tmp_path: Path) -> None:
    datasets = tmp_path / "datasets.yaml"
    datasets.write_text("# comment\nblend:\n  sources:\n    photos: {weight: 0.7}\n    'portraits': {weight: 0.3}\n"
                        "  samples_per_epoch: 50\neverything: [photos, portraits]\n")
    assert dataset_definitions({DATASETS_ENV: str(datasets)}) == {
        "blend": {"sources": {"photos": {"weight": 0.7}, "portraits": {"weight": 0.3}}, "samples_per_epoch": 50},
        "everything": ["photos", "portraits"]}
    as_json = tmp_path / "datasets.json"
    as_json.write_text('{"u": ["photos"]}')
    assert dataset_definitions({DATASETS_ENV: str(as_json)}) == {"u": ["photos"]}
    executor = tmp_path / "executor.yaml"
    executor.write_text("multiprocess:\n  max_concurrent: 2\n")
    assert executor_default({EXECUTOR_CONFIG_ENV: str(executor)}) == {"multiprocess": {"max_concurrent": 2}}
