"""Run every benchmark in bench/ and write one report, bench/RESULTS.md.

    python bench/run_all.py [--only NAME ...] [--skip NAME ...] [--args NAME="--flag value" ...]
                            [--timeout 900] [--out bench/RESULTS.md] [--readme README.md] [--full]

Every ``bench/bench_*.py`` is found by glob and run in its own process, one after another, from
the repository root, with the quick arguments below (``--full``: each benchmark's own defaults;
``--args NAME=...`` replaces them for one benchmark). A benchmark in the house style (see
bench/README.md) prints its tables (ours and the peer side by side, with the ratio) and one
``PASS: <target> (<measured>)`` or ``MISS: ...`` line per target; this script keeps the output and
collects those lines. The report holds the machine (CPU model, cores, memory, Python, torch and
the libraries compared, load, date, commit), a summary of every target, and each benchmark's
output. A block of README.md between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` is
replaced by the summary, so the README's numbers are the report's. A benchmark that fails or
times out is reported as such; the others still run. Exit status 0 unless a benchmark failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

# Quick-ish arguments: the whole report in well under 15 minutes on 2 cores (data generation
# included the first time; each benchmark caches its data in its work folder).
QUICK_ARGS: dict[str, list[str]] = {
    "bench_shard_write": ["--size-mb", "256", "--repeat", "3"],
    "bench_loader_sync": ["--repeat", "7", "--pipeline-repeat", "5"],
    "bench_manifest_parse": ["--no-tracemalloc"],
    "bench_mp4_index": ["--repeat", "3"],
    # The quadratic form it is compared with takes ~5 s at 1,000 sources, ~18 s at 2,000.
    "bench_mixture_counts": ["--before-max", "1000"],
    # The coordinator at the 10 M samples (1-2 min, plus 1 GB of synthetic table written
    # once) and the 1 vs 2 workers build of 12,000 photographs: its own defaults.
    "bench_build_scale": [],
    # 30 4K photographs (generated and built once, ~2 min), 3 alternating rounds of 4 rows.
    "bench_decode": ["--rounds", "3"],
    # The 3,000 photographs (~345 MB of image + caption tars), 2 rounds, the LitData
    # virtualenv (CPU torch, then litdata) made once beforehand. At 800 (a run of 0.3-0.5 s) the
    # start (client, manifests, key indexes, forking workers) was a third of a 2-worker run, and
    # the floor itself lost 20% handing its bytes through 2 workers.
    "bench_remote_read": ["--samples", "3000", "--rounds", "2", "--baseline"],
}
TARGET_LINE = re.compile(r"^(PASS|MISS):\s*(.*)$")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
MAX_OUTPUT_LINES = 200


@dataclass
class Run:
    name: str
    command: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    output: str = ""
    targets: list[tuple[str, str, str]] = field(default_factory=list)  # (PASS|MISS, target, measured)

    @property
    def status(self) -> str:
        if self.returncode is None:
            return "timed out"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"


def discover() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("bench_*.py"))


def parse_targets(output: str) -> list[tuple[str, str, str]]:
    out = []
    for line in output.splitlines():
        m = TARGET_LINE.match(line.strip())
        if not m:
            continue
        verdict, text = m.groups()
        # "<target> (<measured>)": the last parenthesised group is what was measured.
        target, measured = text, ""
        if text.endswith(")") and " (" in text:
            depth = 0
            for i in range(len(text) - 1, -1, -1):
                depth += {")": 1, "(": -1}.get(text[i], 0)
                if depth == 0:
                    target, measured = text[:i].rstrip(), text[i + 1 : -1]
                    break
        out.append((verdict, target, measured))
    return out


def run_one(name: str, args: list[str], timeout: float, folder: Path = BENCH) -> Run:
    cmd = [sys.executable, str(folder / f"{name}.py"), *args]
    run = Run(name, cmd)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        run.returncode, run.output = proc.returncode, proc.stdout + (proc.stderr if proc.returncode else "")
    except subprocess.TimeoutExpired as exc:
        run.output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    run.seconds = time.perf_counter() - t0
    # Child processes' loggers (a Dagster code server's, say) colour their lines; RESULTS.md is
    # Markdown, where the escape codes show as noise.
    run.output = ANSI_ESCAPE.sub("", run.output)
    run.targets = parse_targets(run.output)
    return run


def _first_line(cmd: list[str], default: str = "?") -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip() or default
    except (OSError, subprocess.SubprocessError):
        return default


def machine() -> list[tuple[str, str]]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")).split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = []
    for mod in ("torch", "webdataset", "pyarrow", "numpy", "PIL", "av"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - a missing library is reported, not fatal
            versions.append(f"{mod} -")
    commit = _first_line(["git", "rev-parse", "--short", "HEAD"])
    dirty = _first_line(["git", "status", "--porcelain", "--untracked-files=no"], "")
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return [
        ("CPU", cpu),
        ("cores", f"{os.cpu_count()} logical, {usable} usable by this process"),
        ("memory", mem),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", platform.python_version()),
        ("libraries", ", ".join(versions)),
        ("load average at start", " ".join(f"{x:.2f}" if isinstance(x, float) else x for x in load)),
        ("date", dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")),
        ("commit", commit + (" (with uncommitted changes)" if dirty else "")),
    ]


@dataclass
class Carried:
    """A benchmark not run this time: its summary rows and section, as the previous report has them."""

    name: str
    rows: list[str]
    section: list[str]


SUMMARY_ROW = re.compile(r"^\| `(bench_\w+)` \|")
SECTION = re.compile(r"^## `(bench_\w+)`$")


def previous_sections(report_text: str) -> dict[str, Carried]:
    """Each benchmark's summary rows and section in a report this script wrote."""
    found: dict[str, Carried] = {}
    current: Carried | None = None
    for line in report_text.splitlines():
        m = SECTION.match(line)
        if m:
            current = found.setdefault(m.group(1), Carried(m.group(1), [], []))
        elif line.startswith("## "):
            current = None
        if current is not None:
            current.section.append(line)
        row = SUMMARY_ROW.match(line)
        if row and current is None:
            found.setdefault(row.group(1), Carried(row.group(1), [], [])).rows.append(line)
    for c in found.values():
        while c.section and not c.section[-1].strip():
            c.section.pop()
    return {name: c for name, c in found.items() if c.rows and c.section}


def summary_table(runs: list[Run], carried: Sequence[Carried] = ()) -> list[str]:
    lines = ["| benchmark | target | measured | result |", "|---|---|---|---|"]
    for c in carried:
        lines += c.rows
    for r in runs:
        if not r.targets:
            lines.append(f"| `{r.name}` | - | {r.status}, no PASS/MISS lines | - |")
        for verdict, target, measured in r.targets:
            cell = lambda s: s.replace("|", "\\|")  # noqa: E731
            lines.append(f"| `{r.name}` | {cell(target)} | {cell(measured)} | **{verdict}** |")
    return lines


def report(runs: list[Run], mach: list[tuple[str, str]], total: float, carried: Sequence[Carried] = ()) -> str:
    out = ["# Benchmark results", "",
           "Written by `python bench/run_all.py` (do not edit by hand: run it again). Each benchmark runs our",
           "path and the peer's side by side on the same data; see bench/README.md for what each measures.",
           "Ratios are the comparable figures; absolute times move with the machine and its load.", "",
           "## Machine", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in mach]
    passed = sum(v == "PASS" for r in runs for v, _, _ in r.targets)
    count = sum(len(r.targets) for r in runs)
    out += ["", "## Targets", "", f"{passed} of {count} targets met; {len(runs)} benchmarks in {total / 60:.1f} min.", ""]
    if carried:
        kept = sum(len(c.rows) for c in carried)
        kept_passed = sum(row.rstrip().endswith("**PASS** |") for c in carried for row in c.rows)
        names = ", ".join(f"`{c.name}`" for c in carried)
        out += [f"Not run this time, carried unchanged from the previous report (their sections say when and how "
                f"they ran): {names}, {kept_passed} of {kept} targets met.", ""]
    out += summary_table(runs, carried)
    out += [line for c in carried for line in ["", *c.section]]
    for r in runs:
        cmd = " ".join(shlex.quote(c) for c in ["python", f"bench/{r.name}.py", *r.command[2:]])
        out += ["", f"## `{r.name}`", "", f"`{cmd}`: {r.status} in {r.seconds:.0f} s", ""]
        lines = r.output.rstrip().splitlines()
        if len(lines) > MAX_OUTPUT_LINES:
            lines = [f"... ({len(lines) - MAX_OUTPUT_LINES} earlier lines left out)", *lines[-MAX_OUTPUT_LINES:]]
        out += ["```", *lines, "```"]
    return "\n".join(out) + "\n"


def update_readme(readme: Path, runs: list[Run], mach: list[tuple[str, str]], carried: Sequence[Carried] = ()) -> bool:
    if not readme.is_file():
        return False
    text = readme.read_text()
    if START not in text or END not in text:
        return False
    m = dict(mach)
    block = [START, "", f"From `bench/RESULTS.md` ({m['date']}, {m['CPU']}, {m['cores']}, commit {m['commit']}):", "",
             *([f"Carried from the report before (not run then): {', '.join(f'`{c.name}`' for c in carried)}.", ""]
               if carried else []),
             *summary_table(runs, carried), "", END]
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + "\n".join(block) + tail)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=[], help="run only benchmarks whose name contains one of these")
    ap.add_argument("--skip", nargs="*", default=[], help="leave out benchmarks whose name contains one of these")
    ap.add_argument("--args", action="append", default=[], metavar='NAME="ARGS"',
                    help="arguments for one benchmark instead of the quick ones, e.g. bench_mp4_index='--repeat 5'")
    ap.add_argument("--full", action="store_true", help="each benchmark's own default arguments")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per benchmark (default 900)")
    ap.add_argument("--out", type=Path, default=BENCH / "RESULTS.md")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README whose bench block is replaced")
    args = ap.parse_args(argv)

    overrides: dict[str, list[str]] = {}
    for item in args.args:
        name, _, value = item.partition("=")
        overrides[name.removesuffix(".py")] = shlex.split(value)
    names = [n for n in discover()
             if (not args.only or any(s in n for s in args.only)) and not any(s in n for s in args.skip)]
    mach = machine()
    t0 = time.perf_counter()
    runs = []
    for name in names:
        bench_args = overrides.get(name, [] if args.full else QUICK_ARGS.get(name, []))
        print(f"[run_all] {name} {' '.join(bench_args)}", flush=True)
        r = run_one(name, bench_args, args.timeout)
        runs.append(r)
        verdicts = ", ".join(v for v, _, _ in r.targets) or "no targets"
        print(f"[run_all] {name}: {r.status} in {r.seconds:.0f} s ({verdicts})", flush=True)
    total = time.perf_counter() - t0
    # A benchmark left out keeps its rows and section from the last report, so a partial run
    # refreshes what it ran without hiding what it did not.
    before = previous_sections(args.out.read_text()) if args.out.is_file() else {}
    carried = [before[n] for n in discover() if n not in names and n in before]
    args.out.write_text(report(runs, mach, total, carried))
    # The README shows a report covering every benchmark, or nothing new.
    whole = {r.name for r in runs} | {c.name for c in carried} == set(discover())
    print(f"[run_all] wrote {args.out}" + (f" and the bench block of {args.readme}"
                                          if whole and update_readme(args.readme, runs, mach, carried) else ""))
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
