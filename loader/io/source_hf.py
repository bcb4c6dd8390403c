"""``hf://datasets/<org>/<name>[@<revision>]/<path>``: the Hub's ``resolve`` endpoint, read over HTTP."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import quote, unquote

from .config import StreamConfig
from .source_http import HttpSource

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
_REPO_TYPES = {"datasets": "dataset", "models": "model", "spaces": "space"}


@dataclass(frozen=True)
class HfPath:
    repo_type: str   # "dataset", "model" or "space"
    repo_id: str     # "<org>/<name>"
    revision: str    # branch, tag, commit or "refs/pr/N"
    path: str        # file inside the repo


def parse_hf_url(url: str) -> HfPath:
    """Parse ``hf://datasets/org/name@rev/path``; the revision may be %-encoded (``refs%2Fpr%2F1``)."""
    if not url.startswith("hf://"):
        raise ValueError(f"not an hf:// URL: {url}")
    parts = url[len("hf://"):].split("/")
    if len(parts) < 4 or parts[0] not in _REPO_TYPES or not all(parts[1:4]):
        raise ValueError(
            f"cannot parse {url!r}: expected hf://datasets/<org>/<name>[@<revision>]/<path>"
        )
    name, _, revision = parts[2].partition("@")
    return HfPath(
        repo_type=_REPO_TYPES[parts[0]],
        repo_id=f"{parts[1]}/{name}",
        revision=unquote(revision) or "main",
        path="/".join(parts[3:]),
    )


def hf_endpoint(config: StreamConfig) -> str:
    return (config.hf_endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


_URL_PREFIX = {"dataset": "datasets/", "space": "spaces/", "model": ""}


def resolve_url(url: str, config: StreamConfig) -> str:
    # Built here, not with huggingface_hub.hf_hub_url: that one swaps in `endpoint` only when its
    # template (frozen from HF_ENDPOINT at import time) still starts with the default endpoint.
    p = parse_hf_url(url)
    rev = quote(p.revision or "main", safe="")
    return f"{hf_endpoint(config)}/{_URL_PREFIX[p.repo_type]}{p.repo_id}/resolve/{rev}/{quote(p.path)}"


def hf_token(config: StreamConfig) -> str | None:
    if config.hf_token:
        return config.hf_token
    from huggingface_hub import get_token

    return get_token()


def hf_source(url: str, config: StreamConfig) -> HttpSource:
    token = hf_token(config)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # The token lives only in the request headers; urllib3 drops it on a cross-host redirect (CDN).
    return HttpSource(resolve_url(url, config), config, headers=headers, display_url=url)
