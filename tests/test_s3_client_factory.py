"""One S3 client factory for the whole project (``loader.io.s3_client``); that nothing else
makes clients is checked by tests/test_formats_ownership.py."""

from __future__ import annotations

import pickle

import pytest

from loader.io.config import StreamConfig
from loader.io.s3_client import S3AccessError, S3Settings, s3_client, s3_errors
from tests.support.seaweedfs import SeaweedS3


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


def test_the_region_comes_from_aws_region_as_in_every_aws_sdk(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 reads AWS_DEFAULT_REGION and the profile, not the SDKs' standard AWS_REGION: a
    reader told its bucket's region that way signed for us-east-1. Ours honours it, a region
    in the settings wins, and a worker's frozen settings carry it."""
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert s3_client(S3Settings(max_attempts=2)).meta.region_name == "eu-west-3"
    assert S3Settings(max_attempts=2).frozen_credentials().region == "eu-west-3"
    assert s3_client(S3Settings(max_attempts=2, region="ap-south-1")).meta.region_name == "ap-south-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert s3_client(S3Settings(max_attempts=2)).meta.region_name == "eu-west-3"  # the standard order


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
