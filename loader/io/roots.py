"""One file-system layer over a root: a local folder, ``s3://``, ``http(s)://`` or ``hf://``.

``loader.io`` owns roots, file identities and listings (``loader.lerobot.fs`` re-exports this
module under its old name). A *root* is where a dataset lives (``/data/ds``, ``file:///data/ds``,
``s3://bucket/prefix``, ``https://host/ds``, ``hf://datasets/<org>/<name>[@<revision>]``);
a *rel* is a ``/``-separated path inside it (``meta/info.json``). Bytes are read through
``loader.io.open_url``; this module adds what a stream cannot say: whether a file exists, what
its identity is (so a video replaced at the same path is noticed), and listings where the
backend has them.

Identity (``file_identity``):
  local        size + mtime_ns + ctime_ns + inode (ctime cannot be set back by a writer, so
               a same-size rewrite that restores mtime is still caught; the inode catches an
               atomic replace, by rename, within one coarse clock tick)
  s3://        ETag + VersionId from ``head_object``
  hf://        ETag (``X-Linked-Etag`` for LFS files, whose resolve answer redirects to a CDN)
               from a HEAD on the pinned revision's resolve URL
  http(s)://   a strong ETag from a HEAD; without one the identity is not stable
               (``stable=False``) and callers rebuild whatever they derived from the file.

Credentials never appear in a returned string: roots with user info or a query string are
refused (credentials belong in the environment or in ``StreamConfig``), and the hf token only
ever travels in a request header.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit
from urllib.request import url2pathname

from . import urls
from .config import StreamConfig
from .errors import StreamError
from .opener import open_url
from .source import redact_url

__all__ = [
    "FileIdentity",
    "exists",
    "file_identities",
    "file_identity",
    "hf_revision",
    "join",
    "check_rel",
    "list_dir",
    "pin_revision",
    "read_bytes",
    "root_kind",
    "url",
]

_MAX_REDIRECTS = 5
_HEAD_RETRIES = 3  # HEAD is idempotent and carries no offset: a plain retry is safe


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one file's bytes: equal identities mean the same bytes (when ``stable``).

    ``fingerprint`` is a short self-describing string (``local:mtime_ns=..;ctime_ns=..;ino=..``,
    ``s3:etag=..;version=..``, ``etag:..``), safe to store in a manifest; ``None`` when the
    backend gave nothing. ``stable=False``: the backend has no trustworthy identity, so
    anything derived from the file must be rebuilt on each open.
    """

    size: int
    fingerprint: str | None
    stable: bool


# -- roots and paths ---------------------------------------------------------------------------

def root_kind(root: str | os.PathLike[str]) -> str:
    """``"local"``, ``"s3"``, ``"http"`` or ``"hf"``; anything else raises ValueError."""
    root = os.fspath(root)
    scheme = urls.scheme(root)
    if scheme in ("", "file"):
        return "local"
    if scheme in ("http", "https"):
        return "http"
    if scheme in ("s3", "hf"):
        return scheme
    raise ValueError(
        f"unsupported dataset root {redact_url(root)!r}: use a local path, file://, s3://bucket/prefix, "
        "http(s)://host/path or hf://datasets/<org>/<name>[@<revision>]"
    )


def _check_root(root: str) -> str:
    kind = root_kind(root)
    if kind in ("http", "s3", "hf"):
        parts = urlsplit(root)
        if "@" in parts.netloc or parts.query or parts.fragment:
            raise ValueError(
                f"dataset root {redact_url(root)!r} carries user info, a query or a fragment; "
                "put credentials in the environment (AWS_*, HF_TOKEN) or in StreamConfig, "
                "never in the URL"
            )
    if kind == "hf":
        # Validates the repo part; a sub-folder after the repo is allowed.
        _hf_parse(root, "x")
    return kind


def check_rel(rel: str) -> str:
    """A relative path from metadata must stay inside the root: no '..', no absolute paths."""
    if not rel or rel.startswith("/") or "\\" in rel:
        raise ValueError(f"bad path inside a dataset root: {rel!r} (want a relative 'a/b/c' path)")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad path inside a dataset root: {rel!r} (empty, '.' or '..' segment)")
    return rel


def _local_root(root: str) -> str:
    if root.lower().startswith("file://"):
        return url2pathname(urlsplit(root).path)
    return root


def check_root(root: str | os.PathLike[str]) -> str:
    """The kind of ``root`` (as ``root_kind``), after the checks every reader makes: a ValueError
    for an unsupported scheme, credentials, a query or a fragment in it, or a malformed hf:// root."""
    return _check_root(os.fspath(root))


def join(root: str | os.PathLike[str], rel: str) -> str:
    """``root`` + ``rel`` in the root's own syntax (a path for local roots, a URL otherwise)."""
    root = os.fspath(root)
    kind = _check_root(root)
    check_rel(rel)
    if kind == "local":
        return os.path.join(_local_root(root), *rel.split("/"))
    return root.rstrip("/") + "/" + rel


def url(root: str | os.PathLike[str], rel: str) -> str:
    """What ``loader.io.open_url`` takes for ``rel`` under ``root`` (no credentials in it)."""
    return join(root, rel)


# -- reading ------------------------------------------------------------------------------------

def read_bytes(root: str | os.PathLike[str], rel: str, *, config: StreamConfig | None = None) -> bytes:
    """The whole file; FileNotFoundError (naming it) when it is missing."""
    with open_url(url(root, rel), config=config) as f:
        return f.read()


def exists(root: str | os.PathLike[str], rel: str, *, config: StreamConfig | None = None) -> bool:
    """Whether ``rel`` is a file under ``root`` (a HEAD / head_object / stat; no body is read)."""
    try:
        _stat(os.fspath(root), rel, config or StreamConfig())
    except FileNotFoundError:
        return False
    return True


def file_identity(root: str | os.PathLike[str], rel: str, *,
                  config: StreamConfig | None = None) -> FileIdentity:
    """Size and fingerprint of ``rel``; FileNotFoundError when it is missing."""
    return _stat(os.fspath(root), rel, config or StreamConfig())


def file_identities(root: str | os.PathLike[str], rels: Iterable[str], *,
                    config: StreamConfig | None = None, workers: int = 8) -> dict[str, FileIdentity]:
    """``file_identity`` for many files; remote backends ask ``workers`` at a time."""
    root = os.fspath(root)
    rels = list(rels)
    config = config or StreamConfig()
    if _check_root(root) == "local" or workers <= 1 or len(rels) <= 1:
        return {rel: _stat(root, rel, config) for rel in rels}
    with ThreadPoolExecutor(max_workers=min(workers, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda r: _stat(root, r, config), rels), strict=True))


def list_dir(root: str | os.PathLike[str], rel: str = "", *,
             config: StreamConfig | None = None) -> list[str]:
    """Sorted names (files and folders) directly inside ``rel``; ``[]`` when it does not exist.

    Local folders and s3:// prefixes can be listed; http(s):// and hf:// raise
    NotImplementedError (callers then probe known names in order instead).
    """
    root = os.fspath(root)
    kind = _check_root(root)
    if rel:
        check_rel(rel.rstrip("/"))
    if kind == "local":
        path = os.path.join(_local_root(root), *[p for p in rel.split("/") if p])
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    if kind == "s3":
        return _s3_list(root, rel, config or StreamConfig())
    raise NotImplementedError(f"{kind} roots cannot be listed ({redact_url(root)}); probe names instead")


_COMMIT = re.compile(r"[0-9a-f]{40}")


def pin_revision(root: str | os.PathLike[str], *, probe: str = "meta/info.json",
                 config: StreamConfig | None = None) -> str:
    """An ``hf://`` root at a branch or tag, rewritten to the commit it points at now.

    Reads after this see one snapshot even if the branch moves meanwhile (the Hub names the
    commit in ``X-Repo-Commit`` on a resolve HEAD of ``probe``). Other roots, roots already at
    a commit, and servers that do not name the commit come back unchanged.
    """
    root = os.fspath(root)
    if _check_root(root) != "hf":
        return root
    p = _hf_parse(root, probe)
    if _COMMIT.fullmatch(p.revision):
        return root
    from .source_hf import hf_token, resolve_url

    config = config or StreamConfig()
    token = hf_token(config)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    display = url(root, probe)
    head = _http_head(resolve_url(display, config), headers, config, display=display)
    commit = head.headers.get("x-repo-commit", "")
    if not _COMMIT.fullmatch(commit):
        return root
    # hf://<type>/<org>/<name>[@rev][/sub]: replace the revision, keep any sub-folder.
    kind, org, name_rev, *sub = root[len("hf://"):].rstrip("/").split("/")
    name = name_rev.partition("@")[0]
    return "/".join([f"hf://{kind}", org, f"{name}@{commit}", *sub])


def hf_revision(root: str | os.PathLike[str]) -> str | None:
    """The revision an ``hf://`` root names (``main`` when none); None for other roots."""
    root = os.fspath(root)
    return _hf_parse(root, "x").revision if _check_root(root) == "hf" else None


# -- backends -----------------------------------------------------------------------------------

def _stat(root: str, rel: str, config: StreamConfig) -> FileIdentity:
    kind = _check_root(root)
    if kind == "local":
        path = join(root, rel)
        try:
            st = os.stat(path)
        except NotADirectoryError:  # a parent is a file: as missing as can be
            raise FileNotFoundError(errno.ENOENT, "not found", path) from None
        if not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
        return FileIdentity(size=st.st_size, stable=True,
                            fingerprint=f"local:mtime_ns={st.st_mtime_ns};ctime_ns={st.st_ctime_ns};ino={st.st_ino}")
    if kind == "s3":
        return _s3_head(url(root, rel), config)
    if kind == "hf":
        return _hf_head(root, rel, config)
    return _http_stat(root, rel, config)


def _s3_bucket(s3_url: str, config: StreamConfig) -> tuple[Any, str]:
    from .objects import S3Objects
    from .s3_client import S3Settings

    bucket, key = urls.split_s3(s3_url)
    return S3Objects(f"s3://{bucket}", S3Settings.for_stream(config)), key


def _s3_head(s3_url: str, config: StreamConfig) -> FileIdentity:
    # Errors are the storage layer's: a missing object or bucket is a FileNotFoundError, a
    # refusal a PermissionError, each naming the URL.
    store, key = _s3_bucket(s3_url, config)
    head = store.head(key)
    etag, version = head.etag, head.version
    fingerprint = None if not etag else f"s3:etag={etag}" + (f";version={version}" if version else "")
    return FileIdentity(size=head.size, fingerprint=fingerprint, stable=bool(etag))


def _s3_list(root: str, rel: str, config: StreamConfig) -> list[str]:
    store, key = _s3_bucket(root.rstrip("/"), config)
    prefix = "/".join(p for p in (key.strip("/"), rel.strip("/")) if p)
    return store.list_names(prefix + "/" if prefix else "")


def _hf_parse(root: str, rel: str):
    from .source_hf import parse_hf_url

    return parse_hf_url(root.rstrip("/") + "/" + rel)


@dataclass
class _Head:
    status: int
    headers: dict[str, str]   # lower-case names
    target: str


def _http_head(target: str, headers: dict[str, str], config: StreamConfig, *, display: str,
               follow_linked: bool = False) -> _Head:
    """HEAD ``target``, following redirects by hand (at most five).

    ``follow_linked=False`` stops at a redirect that already carries ``X-Linked-Etag``: the Hub
    answers a resolve HEAD for an LFS file that way, and the CDN behind it need not be asked.
    Authorization is dropped on a hop to another host.
    """
    import urllib3
    from urllib3.exceptions import HTTPError

    from .source_http import _pool

    timeout = urllib3.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s)
    retries = urllib3.Retry(total=_HEAD_RETRIES, connect=_HEAD_RETRIES, read=_HEAD_RETRIES,
                            status=_HEAD_RETRIES, redirect=False, backoff_factor=config.backoff_base_s,
                            status_forcelist=(429, 500, 502, 503, 504), raise_on_status=False,
                            raise_on_redirect=False)
    origin = urlsplit(target).netloc
    hdrs = {**headers, "Accept-Encoding": "identity"}
    for _ in range(_MAX_REDIRECTS + 1):
        try:
            resp = _pool().request("HEAD", target, headers=hdrs, retries=retries, timeout=timeout,
                                   redirect=False, preload_content=False)
        except (HTTPError, OSError) as e:
            raise StreamError(f"{display}: HEAD failed: {type(e).__name__}: {e}") from None
        try:
            head = _Head(resp.status, {k.lower(): v for k, v in resp.headers.items()}, target)
        finally:
            resp.drain_conn()
            resp.release_conn()
        if head.status in (301, 302, 303, 307, 308) and "location" in head.headers:
            if not follow_linked and "x-linked-etag" in head.headers:
                return head
            target = urljoin(target, head.headers["location"])
            if urlsplit(target).netloc != origin:
                hdrs = {k: v for k, v in hdrs.items() if k.lower() != "authorization"}
            continue
        if head.status in (404, 410):
            raise FileNotFoundError(errno.ENOENT, f"not found (HTTP {head.status})", display)
        if head.status in (401, 403):
            raise PermissionError(errno.EACCES, f"access denied (HTTP {head.status}); check the credentials",
                                  display)
        if head.status != 200:
            raise StreamError(f"{display}: unexpected HTTP {head.status} for HEAD")
        return head
    raise StreamError(f"{display}: more than {_MAX_REDIRECTS} redirects")


def _http_size(head: _Head, source: Any, display: str) -> int:
    for name in ("x-linked-size", "content-length"):
        value = head.headers.get(name, "")
        if value.isdigit():
            return int(value)
    # No length in the HEAD answer (chunked): ask for one byte and read the total from Content-Range.
    opened = source.open(0, 1, None)
    if opened is not None:
        opened.body.close()
        if opened.size is not None:
            return opened.size
    raise StreamError(f"{display}: the server gives no size (no Content-Length, no Content-Range)")


def _http_identity(head: _Head, source: Any, display: str) -> FileIdentity:
    etag = head.headers.get("x-linked-etag") or head.headers.get("etag")
    # A weak ETag (W/"..") promises equivalent content, not the same bytes; byte offsets into an
    # MP4 need the same bytes, so it does not count as a stable identity.
    stable = bool(etag) and not etag.startswith("W/")
    size = _http_size(head, source, display)
    return FileIdentity(size=size, fingerprint=f"etag:{etag}" if etag else None, stable=stable)


def _http_stat(root: str, rel: str, config: StreamConfig) -> FileIdentity:
    from .source_http import HttpSource

    target = url(root, rel)
    head = _http_head(target, {}, config, display=target)
    return _http_identity(head, HttpSource(target, config), target)


def _hf_head(root: str, rel: str, config: StreamConfig) -> FileIdentity:
    from .source_hf import hf_source, hf_token, resolve_url

    display = url(root, rel)
    token = hf_token(config)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    head = _http_head(resolve_url(display, config), headers, config, display=display)
    return _http_identity(head, hf_source(display, config), display)
