"""One S3 client factory for the whole project (``loader.io.s3_client``)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from loader.io.config import StreamConfig
from loader.io.s3_client import S3AccessError, S3Settings, s3_client, s3_errors
from tests.support.seaweedfs import SeaweedS3

REPO = Path(__file__).resolve().parents[1]
PROJECT_DIRS = ("loader", "pid_platform", "examples", "bench")
FACTORY = Path("loader/io/s3_client.py")
# Every way boto3 (or dagster-aws) hands out a client or a session.
MAKERS = re.compile(
    r"boto3\.(client|resource|Session|session\.Session)\(|\.client\(\s*['\"]s3['\"]|"
    r"\bget_client\(|\bget_s3_client\(|^\s*import boto3|^\s*from boto3(\.\w+)* import"
)


def test_no_module_outside_the_factory_makes_an_s3_client_or_session() -> None:
    offenders = []
    for folder in PROJECT_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel == FACTORY:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if MAKERS.search(line):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], "make S3 clients with loader.io.s3_client.s3_client(S3Settings(...)):\n" + "\n".join(offenders)


def test_the_grep_catches_a_client_made_by_hand() -> None:
    for line in ('import boto3', 'c = boto3.client("s3")', 's = boto3.session.Session()', 'x.client("s3", endpoint_url=e)',
                 'resource.get_client()'):
        assert MAKERS.search(line), line


def test_one_client_per_settings_and_environment(s3_env: SeaweedS3) -> None:
    a = s3_client(S3Settings(max_attempts=3))
    assert s3_client(S3Settings(max_attempts=3)) is a
    assert s3_client(S3Settings(max_attempts=1)) is not a
    # A stream config is one more way to say the same settings: a loader's streams share a client.
    assert s3_client(StreamConfig()) is s3_client(S3Settings.for_stream(StreamConfig()))
    assert a.meta.endpoint_url == s3_env.endpoint_url
    assert s3_env.make_bucket("factory-one") in [b["Name"] for b in a.list_buckets()["Buckets"]]


def test_frozen_credentials_sign_without_the_environment(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = S3Settings(max_attempts=1).frozen_credentials()
    assert frozen.endpoint_url == s3_env.endpoint_url and s3_env.secret_key not in repr(frozen)
    copy = pickle.loads(pickle.dumps(frozen))
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    s3_env.make_bucket("factory-frozen")
    s3_client(copy).head_bucket(Bucket="factory-frozen")


def test_errors_say_what_to_check(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = S3Settings(max_attempts=1)
    with (pytest.raises(S3AccessError, match="bucket 'factory-none' does not exist at http://127.0.0.1"),
          s3_errors(settings, "listing s3://factory-none/", "factory-none")):
        s3_client(settings).list_objects_v2(Bucket="factory-none")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    s3_env.make_bucket("factory-creds")
    with (pytest.raises(S3AccessError, match=r"refused the request \(SignatureDoesNotMatch.*AWS_ACCESS_KEY_ID"),
          s3_errors(settings, "listing s3://factory-creds/", "factory-creds")):
        s3_client(settings).list_objects_v2(Bucket="factory-creds")
    down = S3Settings(endpoint_url="http://127.0.0.1:1", max_attempts=1)
    with (pytest.raises(S3AccessError, match="cannot connect to S3 at http://127.0.0.1:1"),
          s3_errors(down, "listing s3://x/", "x")):
        s3_client(down).list_objects_v2(Bucket="x")
