"""bench/run_all.py: finds the benchmarks, reads their PASS/MISS lines, writes the report and the README block."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_bench_script_is_found(run_all) -> None:
    found = run_all.discover()
    assert {"bench_loader_sync", "bench_shard_write", "bench_manifest_parse", "bench_mp4_index"} <= set(found)
    assert all(name.startswith("bench_") for name in found)
    assert set(run_all.QUICK_ARGS) <= set(found)  # no quick arguments for a benchmark that is gone


def test_target_lines_are_parsed(run_all) -> None:
    out = "\n".join([
        "samples  1.00x",
        "PASS: ours zip >= 2x webdataset (3.873x CPU time, 3.950x wall)",
        "MISS: full pipeline, ours >= 1x webdataset (f(x) 0.9x)",
        "  PASS: no measurement",
        "WARNING: not a target",
    ])
    assert run_all.parse_targets(out) == [
        ("PASS", "ours zip >= 2x webdataset", "3.873x CPU time, 3.950x wall"),
        ("MISS", "full pipeline, ours >= 1x webdataset", "f(x) 0.9x"),
        ("PASS", "no measurement", ""),
    ]


def test_a_bench_that_fails_is_reported_and_the_readme_block_is_replaced(run_all, tmp_path: Path) -> None:
    (tmp_path / "bench_fake.py").write_text("print('PASS: fast (2.0x)')\nraise SystemExit(3)\n")
    (tmp_path / "bench_slow.py").write_text("import time\nprint('MISS: slow (0.1x)', flush=True)\ntime.sleep(30)\n")
    r = run_all.run_one("bench_fake", [], 60, folder=tmp_path)
    assert (r.returncode, r.targets) == (3, [("PASS", "fast", "2.0x")])
    slow = run_all.run_one("bench_slow", [], 2, folder=tmp_path)
    assert slow.status == "timed out" and slow.targets == [("MISS", "slow", "0.1x")]
    mach = run_all.machine()
    text = run_all.report([r, slow], mach, 1.0)
    assert "failed (exit 3)" in text and "timed out" in text and "| `bench_fake` | fast | 2.0x | **PASS** |" in text
    assert dict(mach)["cores"] and dict(mach)["Python"]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run_all.START}\nold numbers\n{run_all.END}\nafter\n")
    assert run_all.update_readme(readme, [r], mach)
    new = readme.read_text()
    assert "old numbers" not in new and "| `bench_fake` | fast | 2.0x | **PASS** |" in new
    assert new.startswith("intro\n") and new.endswith("after\n")


def test_a_partial_run_carries_the_benchmarks_it_left_out_from_the_last_report(run_all, tmp_path: Path) -> None:
    mach = run_all.machine()
    old = run_all.Run("bench_old", ["python", "bench/bench_old.py"], 3.0, 0, "hand table\nMISS: old target (0.9x)\n",
                      [("MISS", "old target", "0.9x")])
    kept = run_all.Run("bench_kept", ["python", "bench/bench_kept.py"], 2.0, 0, "kept table\nPASS: kept (2.0x)\n",
                       [("PASS", "kept", "2.0x")])
    before = run_all.report([kept, old], mach, 1.0)
    carried = run_all.previous_sections(before)
    assert set(carried) == {"bench_kept", "bench_old"}
    assert carried["bench_kept"].rows == ["| `bench_kept` | kept | 2.0x | **PASS** |"]
    assert carried["bench_kept"].section[0] == "## `bench_kept`" and "kept table" in carried["bench_kept"].section
    assert not any("hand table" in line for line in carried["bench_kept"].section)  # sections do not run together

    new = run_all.Run("bench_old", ["python", "bench/bench_old.py"], 3.0, 0, "PASS: old target (1.1x)\n",
                      [("PASS", "old target", "1.1x")])
    text = run_all.report([new], mach, 1.0, [carried["bench_kept"]])
    assert "| `bench_old` | old target | 1.1x | **PASS** |" in text and "0.9x" not in text
    assert "| `bench_kept` | kept | 2.0x | **PASS** |" in text and "kept table" in text
    assert "carried unchanged from the previous report" in text and "1 of 1 targets met" in text
    # Carried again by the next partial run, unchanged.
    assert run_all.previous_sections(text)["bench_kept"] == carried["bench_kept"]
