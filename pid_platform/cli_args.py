"""Argument types shared by the console scripts: each refuses a bad value as an argparse error
(exit 2, the usage and one line naming the option), before any work and never with a traceback.

A string that looks like a URL is never a local path: ``s3://b/x`` given where a folder is
expected must not become the local folders ``s3:/b/x``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from loader.formats.errors import short_repr
from loader.io import urls


def is_url(text: str) -> bool:
    return urls.is_remote(text)


def local_path(what: str, *, kind: str = "any") -> Callable[[str], Path]:
    """An argparse ``type=`` for a local path (``file://`` allowed). ``kind``: ``"folder"`` (a folder,
    or nothing yet), ``"file"`` (a file, or nothing yet), ``"existing-folder"`` or ``"any"``."""

    def parse(text: str) -> Path:
        if is_url(text):
            raise argparse.ArgumentTypeError(
                f"{short_repr(text)} is a URL, and {what} is a local path (a URL is never taken as one); "
                "give a path on this machine")
        if not text or "\0" in text:
            raise argparse.ArgumentTypeError(f"{short_repr(text)} is not a path")
        path = Path(urls.local_path(text)).expanduser()
        if kind in ("folder", "existing-folder") and path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a file, and {what} is a folder")
        if kind == "existing-folder" and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} does not exist (or is not a folder)")
        if kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a folder, and {what} is a file to write; "
                                             "give a file name (e.g. <folder>/mp4-sidecar.npz)")
        if kind in ("folder", "file") and not path.exists():
            parent = next((p for p in path.absolute().parents if p.exists()), None)
            if parent is not None and not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{path}: {parent} is a file, so nothing can be made under it")
            if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
                raise argparse.ArgumentTypeError(f"{path}: {parent} is not writable")
        return path

    return parse


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {short_repr(text)}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {short_repr(text)}")
        return value

    return parse


def finite_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {short_repr(text)}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {short_repr(text)}")
    return value


def endpoint_url(text: str) -> str:
    """An S3 or Hub endpoint: ``http(s)://host[:port][/path]``, with no credentials, query or fragment."""
    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if not urls.is_http(text) or not parts.hostname or not port_ok or " " in text:
        raise argparse.ArgumentTypeError(f"{short_repr(text)} is not an endpoint URL: give http(s)://host[:port]")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            "the endpoint URL carries credentials, a query or a fragment; give a plain http(s)://host[:port] "
            "(credentials go in the environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, HF_TOKEN)")
    return text
