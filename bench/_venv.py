"""A peer library's own virtualenv under a benchmark's work folder, made once.

A peer (lerobot, litdata) runs in a virtualenv of its own, so its pins never touch ours: the
benchmark runs its children there (``<venv>/bin/python bench/<bench>.py --child ...``). The
venv is rebuilt only when what it should hold (``stamp``) changes. Install steps run in order:
torch first, from the pinned CPU wheel, so a peer's unpinned ``torch`` requirement is already
met and pip does not fetch a multi-GB CUDA build.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def peer_venv(venv: Path, stamp: dict, installs: Sequence[Sequence[str]], check: str, *,
              after_install: Callable[[Path], None] | None = None, log=print) -> Path:
    """The python of ``venv``, made (or remade) with ``pip install <step>`` for each of
    ``installs``; ``check`` (Python source) must run in it, else SystemExit with its error."""
    py = venv / "bin" / "python"
    stamp_file = venv / ".bench-stamp.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return py
    if venv.exists():
        shutil.rmtree(venv)
    log(f"[venv] creating {venv} ({'; '.join(' '.join(s) for s in installs)}); once")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for step in installs:
        subprocess.run([*pip, *step], check=True)
    if after_install is not None:
        after_install(venv)
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"[venv] the peer does not import in {venv}:\n{out.stderr[-3000:]}")
    stamp_file.write_text(json.dumps(stamp))
    return py
