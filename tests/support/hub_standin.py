"""A STAND-IN for the Hugging Face Hub API: a small local HTTP server, NOT the Hub.

No real Hub is reachable offline, so this implements only the few endpoints ``huggingface_hub``
(2.x, ``hf_api.py`` / ``_commit_api.py`` / ``file_download.py``) calls to publish a sidecar on a
dataset's ``lerobot-sidecars`` branch and to read it back:

  GET  /api/datasets/<ns>/<name>[/revision/<rev>]   ``HfApi.dataset_info`` / ``repo_info``
  GET  /api/datasets/<ns>/<name>/refs               ``HfApi.list_repo_refs``
  GET  /api/datasets/<ns>/<name>/commits/<rev>      ``HfApi.list_repo_commits``
  POST /api/datasets/<ns>/<name>/branch/<branch>    ``HfApi.create_branch`` ({"startingPoint": rev}; 409 if it exists)
  POST /api/datasets/<ns>/<name>/preupload/<rev>    ``create_commit`` step 1 (every file answers "regular")
  POST /api/datasets/<ns>/<name>/commit/<rev>       ``create_commit`` step 2 (NDJSON: header + base64 files)
  HEAD|GET /datasets/<ns>/<name>/resolve/<rev>/<path>  ``hf_hub_download`` and ``hf://`` range reads

Anything else answers 501 "not implemented by the Hub stand-in", so a new call made by a newer
``huggingface_hub`` fails loudly instead of being faked silently.

Where it differs from the real Hub (on purpose, to stay small): files are kept in memory, one
full snapshot per commit; every upload is "regular" (inline base64 in the commit), so the LFS and
Xet transfer paths the Hub uses for large binary files are not exercised; commit ids are SHA-1s
of the commit's content, not git object ids; only branches (not tags or PR refs) can be
committed to. Write endpoints require ``Authorization: Bearer <token>`` when a token is set.

Fixture ``hub_standin() -> HubStandIn`` (``.endpoint``, ``.token``, ``.add_dataset(repo_id, files)``,
``.branches(repo_id)``, ``.log(repo_id, rev)``, ``.files(repo_id, rev)``, ``.calls``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest

from tests.support.http_server import _parse_range

STANDIN_USER = "hub-standin"
_REPO = r"(?P<ns>[^/]+)/(?P<name>[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(rf"/api/datasets/{_REPO}/refs"), "_refs"),
    ("GET", re.compile(rf"/api/datasets/{_REPO}/commits/(?P<rev>[^/]+)"), "_commits"),
    ("GET", re.compile(rf"/api/datasets/{_REPO}/revision/(?P<rev>[^/]+)"), "_info"),
    ("GET", re.compile(rf"/api/datasets/{_REPO}"), "_info"),
    ("POST", re.compile(rf"/api/datasets/{_REPO}/branch/(?P<branch>[^/]+)"), "_create_branch"),
    ("POST", re.compile(rf"/api/datasets/{_REPO}/preupload/(?P<rev>[^/]+)"), "_preupload"),
    ("POST", re.compile(rf"/api/datasets/{_REPO}/commit/(?P<rev>[^/]+)"), "_commit"),
    ("GET", re.compile(rf"/datasets/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "_resolve"),
    ("HEAD", re.compile(rf"/datasets/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "_resolve"),
]


def git_blob_sha1(data: bytes) -> str:
    """The id git (and the Hub's ETag for a regular file) gives these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Commit:
    oid: str
    parent: str | None
    files: Mapping[str, bytes] = field(repr=False)
    title: str
    message: str
    date: str


@dataclass
class _Repo:
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    status: int


class HubStandIn:
    """The stand-in's state (repos, commits, branches) and its HTTP server on 127.0.0.1."""

    def __init__(self, token: str | None = "hub-standin-write-token"):
        self.token = token
        self.calls: list[Call] = []
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._clock = 0  # commit dates and ids come from a counter: no wall clock
        self._conns: set[socket.socket] = set()
        owner = self

        class Handler(_Handler):
            standin = owner

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-standin", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> HubStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    # -- what tests call directly -------------------------------------------------------------

    def add_dataset(self, repo_id: str, files: Mapping[str, bytes], *, message: str = "initial commit") -> str:
        """Create dataset ``repo_id`` with one commit on ``main`` holding ``files``; its commit id."""
        with self._lock:
            if repo_id in self._repos:
                raise ValueError(f"{repo_id} exists in the stand-in")
            repo = self._repos[repo_id] = _Repo()
            oid = self._new_commit(repo, None, dict(files), message, "")
            repo.branches["main"] = oid
            return oid

    def commit_files(self, repo_id: str, branch: str, files: Mapping[str, bytes], message: str) -> str:
        """Add a commit to ``branch`` as someone else would (e.g. the dataset's own next version)."""
        with self._lock:
            repo = self._repos[repo_id]
            head = repo.branches[branch]
            oid = self._new_commit(repo, head, {**repo.commits[head].files, **files}, message, "")
            repo.branches[branch] = oid
            return oid

    def branches(self, repo_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._repos[repo_id].branches)

    def log(self, repo_id: str, rev: str) -> list[Commit]:
        """Commits reachable from ``rev``, newest first."""
        with self._lock:
            repo = self._repos[repo_id]
            out, oid = [], self._resolve_rev(repo, rev)
            while oid is not None:
                out.append(repo.commits[oid])
                oid = repo.commits[oid].parent
            return out

    def files(self, repo_id: str, rev: str) -> dict[str, bytes]:
        with self._lock:
            repo = self._repos[repo_id]
            return dict(repo.commits[self._resolve_rev(repo, rev)].files)

    def paths_called(self) -> set[tuple[str, str]]:
        """(method, route name) of every request served, for asserting which endpoints were used."""
        return {(c.method, c.path) for c in self.calls}

    def failed_calls(self) -> list[Call]:
        return [c for c in self.calls if c.status >= 400]

    # -- internals (called with the lock held) --------------------------------------------------

    def _new_commit(self, repo: _Repo, parent: str | None, files: dict[str, bytes], title: str, message: str) -> str:
        self._clock += 1
        h = hashlib.sha1(f"{parent}\0{title}\0{self._clock}".encode())
        for path in sorted(files):
            h.update(f"\0{path}\0{git_blob_sha1(files[path])}".encode())
        oid = h.hexdigest()
        date = f"2024-01-01T00:{self._clock // 60 % 60:02d}:{self._clock % 60:02d}.000Z"
        repo.commits[oid] = Commit(oid, parent, files, title, message, date)
        return oid

    def _repo(self, m: re.Match[str]) -> _Repo:
        repo = self._repos.get(f"{m['ns']}/{m['name']}")
        if repo is None:
            raise HubError(404, f"Repository {m['ns']}/{m['name']} not found (Hub stand-in)", "RepoNotFound")
        return repo

    @staticmethod
    def _resolve_rev(repo: _Repo, rev: str) -> str:
        rev = unquote(rev)
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.commits:
            return rev
        raise HubError(404, f"Invalid rev id: {rev} (Hub stand-in)", "RevisionNotFound")

    def _check_write(self, headers: Mapping[str, str]) -> None:
        if self.token and headers.get("Authorization") != f"Bearer {self.token}":
            raise HubError(401, "Invalid credentials in Authorization header (Hub stand-in)")

    # -- endpoints: (match, headers, body) -> (status, headers, payload) ------------------------

    def _info(self, m, headers, body):
        repo = self._repo(m)
        oid = self._resolve_rev(repo, m.groupdict().get("rev") or "main")
        files = repo.commits[oid].files
        return _json(200, {
            "id": f"{m['ns']}/{m['name']}", "author": m["ns"], "sha": oid, "private": False,
            "disabled": False, "gated": False, "lastModified": repo.commits[oid].date, "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(files)],
        })

    def _refs(self, m, headers, body):
        repo = self._repo(m)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid}
                    for b, oid in sorted(repo.branches.items())]
        return _json(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def _commits(self, m, headers, body):
        repo = self._repo(m)
        out, oid = [], self._resolve_rev(repo, m["rev"])
        while oid is not None:
            c = repo.commits[oid]
            out.append({"id": c.oid, "authors": [{"user": STANDIN_USER}], "date": c.date, "title": c.title,
                        "message": c.message})
            oid = c.parent
        return _json(200, out)

    def _create_branch(self, m, headers, body):
        self._check_write(headers)
        repo = self._repo(m)
        branch = unquote(m["branch"])
        if branch in repo.branches:
            raise HubError(409, f"Reference refs/heads/{branch} already exists (Hub stand-in)")
        start = (json.loads(body or b"{}") or {}).get("startingPoint") or "main"
        repo.branches[branch] = self._resolve_rev(repo, start)
        return _json(200, {})

    def _preupload(self, m, headers, body):
        self._check_write(headers)
        repo = self._repo(m)
        files = repo.commits[self._branch_head(repo, m["rev"])].files
        out = []
        for f in json.loads(body)["files"]:
            old = files.get(f["path"])
            out.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                        "oid": git_blob_sha1(old) if old is not None else None})
        return _json(200, {"files": out, "commitOid": self._branch_head(repo, m["rev"])})

    def _commit(self, m, headers, body):
        self._check_write(headers)
        repo = self._repo(m)
        branch = unquote(m["rev"])
        head = self._branch_head(repo, branch)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line (Hub stand-in)")
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, head):
            raise HubError(412, f"A commit has happened since. Please refresh and try again. (Hub stand-in: "
                                f"parentCommit {header['parentCommit']} != head {head})")
        files = dict(repo.commits[head].files)
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file" and value.get("encoding") == "base64":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
            else:
                raise HubError(501, f"commit operation {line['key']!r} is not implemented by the Hub stand-in")
        oid = self._new_commit(repo, head, files, header.get("summary", ""), header.get("description", ""))
        repo.branches[branch] = oid
        url = f"{self.endpoint}/datasets/{m['ns']}/{m['name']}/commit/{oid}"
        return _json(200, {"success": True, "commitOid": oid, "commitUrl": url, "pullRequestUrl": None})

    def _branch_head(self, repo: _Repo, rev: str) -> str:
        branch = unquote(rev)
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch} (Hub stand-in commits only to branches)",
                           "RevisionNotFound")
        return repo.branches[branch]

    def _resolve(self, m, headers, body):
        repo = self._repo(m)
        oid = self._resolve_rev(repo, m["rev"])
        path = unquote(m["path"])
        data = repo.commits[oid].files.get(path)
        if data is None:
            raise HubError(404, f"Entry not found: {path} (Hub stand-in)", "EntryNotFound")
        base = {"ETag": f'"{git_blob_sha1(data)}"', "X-Repo-Commit": oid, "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream"}
        span = _parse_range(headers.get("Range"), len(data))
        if span == "unsatisfiable":
            return 416, {**base, "Content-Range": f"bytes */{len(data)}"}, b""
        if span is None:
            return 200, base, data
        a, b = span
        return 206, {**base, "Content-Range": f"bytes {a}-{b - 1}/{len(data)}"}, data[a:b]


def _json(status: int, doc: object) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(doc).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    standin: HubStandIn
    timeout = 10

    def setup(self) -> None:
        super().setup()
        with self.standin._lock:
            self.standin._conns.add(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.standin._lock:
            self.standin._conns.discard(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else b""
        path = urlsplit(self.path).path
        route, status, headers, payload = "unrouted", 501, {}, b""
        try:
            for method, pattern, handler in _ROUTES:
                m = pattern.fullmatch(path)
                if m and method == self.command:
                    route = handler.lstrip("_")
                    with self.standin._lock:
                        status, headers, payload = getattr(self.standin, handler)(m, self.headers, body)
                    break
            else:
                raise HubError(501, f"{self.command} {path} is not implemented by the Hub stand-in")
        except HubError as e:
            status, payload = e.status, json.dumps({"error": e.message}).encode()
            headers = {"Content-Type": "application/json", "X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
        self.standin.calls.append(Call(self.command, route if status != 501 else path, status))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD" and payload:
            with contextlib.suppress(OSError):
                self.wfile.write(payload)


@pytest.fixture
def hub_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    """A running Hub STAND-IN, with huggingface_hub allowed online and pointed at it.

    ``HF_HUB_OFFLINE`` is read once when huggingface_hub is imported, so the module constant is
    patched too. ``HF_ENDPOINT`` is set for code that reads the environment at call time (the
    loader's ``hf://`` URLs); huggingface_hub's own ``constants.ENDPOINT`` is left alone, because
    ``hf_hub_url(endpoint=...)`` only swaps in an endpoint when URLs start with the import-time
    one: callers pass ``endpoint=`` explicitly. huggingface_hub 2.x also fetches an "agent
    harness" registry from the real Hub once per process when it builds request headers; that
    telemetry is pre-set to empty so no test ever reaches for the network.
    """
    import huggingface_hub.constants as hf_constants

    server = HubStandIn().start()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_TOKEN", server.token or "")
    try:
        from huggingface_hub.utils import _detect_agent
    except ImportError:  # older huggingface_hub: no such telemetry
        pass
    else:
        monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    try:
        yield server
    finally:
        server.stop()
