"""One build of an ``s3://`` output at a time across machines (issue 18 part 7): the build lease
``<output>/.pid-build/lease.json`` (``pid_platform/sharding/commit/lease.py``), against a real
SeaweedFS. Each build is a real ``pid-shard`` process with its own ``HOME`` and
``PID_WORK_ROOT`` (as on another machine), held at a pause point while the other one runs."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

from loader.formats.version_pointer import POINTER_NAME
from pid_platform.sharding.commit.lease import (
    LEASE_REL,
    RENEW_ENV,
    TTL_ENV,
    BuildLease,
    BuildLeaseHeldError,
    BuildLeaseLostError,
    LeaseSettings,
)
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.errors import BuildError
from tests.conftest import SOURCE
from tests.support.paused_procs import pid_shard
from tests.support.s3_objects import keys, pointer
from tests.support.seaweedfs import SeaweedS3

HOST = socket.gethostname()[:100]


def machine(tmp_path: Path, name: str, **env: str) -> dict[str, str]:
    """The environment of a build on its own machine: its own HOME and work root."""
    (tmp_path / name / "home").mkdir(parents=True)
    return {"HOME": str(tmp_path / name / "home"), "PID_WORK_ROOT": str(tmp_path / name / "work"), **env}


def build(raw_root: Path, url: str) -> list[str]:
    return pid_shard("--input-dir", str(raw_root / SOURCE), "--output-dir", url, "--max-shard-size-mb", "0.25",
                     "--num-workers", "1")


def lease_doc(client, bucket: str) -> dict:
    return json.loads(client.get_object(Bucket=bucket, Key=f"photos/{LEASE_REL}")["Body"].read())


def test_a_second_build_is_refused_naming_the_holder_and_runs_once_the_first_is_done(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-refused")
    url = f"s3://{bucket}/photos"
    a = procs(build(raw_root, url), tmp_path / "a", "publish:start", machine(tmp_path, "ma"))
    a.wait_reached("publish:start")
    held = lease_doc(client, bucket)
    assert (held["host"], held["pid"]) == (HOST, a.proc.pid) and held["version"]
    b = procs(build(raw_root, url), tmp_path / "b", env=machine(tmp_path, "mb"))
    assert b.finish() == 2
    err = b.stderr()
    assert "Traceback" not in err
    assert f"another build of {url} is running: {HOST} pid {a.proc.pid} took its lease" in err
    assert f"version {held['version']}" in err and "wait for it to finish" in err and "expires at" in err
    assert b.stdout() == ""
    assert lease_doc(client, bucket)["token"] == held["token"]  # the refused build left it alone
    a.release("publish:start")
    assert a.finish() == 0, a.stderr()
    assert f"pid {a.proc.pid}" in pointer(client, bucket, "photos")["built_by"]
    assert keys(client, bucket, "photos/.pid-build") == []  # released
    again = procs(build(raw_root, url), tmp_path / "b2", env=machine(tmp_path, "mb2"))
    assert again.finish() == 0, again.stderr()


def test_a_holder_killed_with_kill_9_on_another_machine_blocks_only_until_its_lease_expires(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-killed")
    url = f"s3://{bucket}/photos"
    # Long enough that the refused build (a fresh process, slow on a loaded machine) runs before it expires.
    short = {TTL_ENV: "12", RENEW_ENV: "2"}
    a = procs(build(raw_root, url), tmp_path / "a", "publish:start", machine(tmp_path, "ma", **short))
    a.wait_reached("publish:start")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    stale = lease_doc(client, bucket)
    assert stale["pid"] == a.proc.pid
    # As if it had run on another machine: whether that process lives cannot be seen from here.
    stale["host"] = "other-machine"
    client.put_object(Bucket=bucket, Key=f"photos/{LEASE_REL}", Body=json.dumps(stale).encode())
    # Before it goes stale the dead holder's lease still stops a build, which says when.
    b = procs(build(raw_root, url), tmp_path / "b", env=machine(tmp_path, "mb", **short))
    assert b.finish() == 2
    assert f"other-machine pid {a.proc.pid}" in b.stderr() and "expires at" in b.stderr()
    assert time.time() < stale["expires"], "the refused build ran after the lease expired: the test proves nothing"
    time.sleep(max(0.0, stale["expires"] - time.time()) + 0.5)
    c = procs(build(raw_root, url), tmp_path / "c", env=machine(tmp_path, "mc", **short))
    assert c.finish() == 0, c.stderr()
    assert f"took over the lease of other-machine pid {a.proc.pid}, which went stale" in c.stderr()
    assert f"pid {c.proc.pid}" in pointer(client, bucket, "photos")["built_by"]
    assert keys(client, bucket, "photos/.pid-build") == []


def test_a_renewed_lease_outlives_its_ttl(s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-renewed")
    url = f"s3://{bucket}/photos"
    ttl = 4.0  # renewed every second: a loaded machine may stall the renewing thread a moment
    short = {TTL_ENV: str(ttl), RENEW_ENV: "1"}
    a = procs(build(raw_root, url), tmp_path / "a", "publish:start", machine(tmp_path, "ma", **short))
    a.wait_reached("publish:start")
    first = lease_doc(client, bucket)
    time.sleep(3 * ttl)  # held far past the TTL, renewed meanwhile
    now = lease_doc(client, bucket)
    assert now["token"] == first["token"] and now["started"] == first["started"]
    assert now["expires"] > first["started"] + 3 * ttl and now["expires"] > time.time()
    b = procs(build(raw_root, url), tmp_path / "b", env=machine(tmp_path, "mb", **short))
    assert b.finish() == 2
    assert f"{HOST} pid {a.proc.pid} took its lease" in b.stderr()
    a.release("publish:start")
    assert a.finish() == 0, a.stderr()
    assert f"pid {a.proc.pid}" in pointer(client, bucket, "photos")["built_by"]


def test_a_holder_whose_lease_was_taken_stops_before_the_switch(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs
) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-stolen")
    url = f"s3://{bucket}/photos"
    a = procs(build(raw_root, url), tmp_path / "a", "publish:before-switch", machine(tmp_path, "ma"))
    a.wait_reached("publish:before-switch")  # every object is up and checked
    # Another build takes the lease (as one does after the holder stalled past its TTL).
    t = time.time()
    thief = {"lease_version": 1, "host": "other-machine", "pid": 4242, "token": "f" * 32, "started": t,
             "renewed": t, "expires": t + 600, "ttl_s": 600.0, "version": None}
    client.put_object(Bucket=bucket, Key=f"photos/{LEASE_REL}", Body=json.dumps(thief).encode())
    a.release("publish:before-switch")
    assert a.finish() == 2
    err = a.stderr()
    assert "Traceback" not in err
    assert "this build lost its lease" in err and "now held by other-machine pid 4242" in err
    assert "without switching the pointer" in err
    assert POINTER_NAME not in keys(client, bucket, "photos")  # nothing published
    assert lease_doc(client, bucket) == thief  # the other build's lease stays


@pytest.mark.parametrize(("env", "match"), [
    ({TTL_ENV: "soon"}, "PID_LEASE_TTL_S='soon': give a number of seconds"),
    ({TTL_ENV: "0"}, "ttl_s = 0.0: give 2 to 86400 seconds"),
    ({TTL_ENV: "0.5"}, "ttl_s = 0.5: give 2 to 86400 seconds"),
    ({TTL_ENV: "10", RENEW_ENV: "6"}, r"renew_s = 6.0: give 1 to 5 seconds .*twice per TTL \(renew_s <= ttl_s / 2\)"),
    ({TTL_ENV: "nan"}, "PID_LEASE_TTL_S='nan': give a number of seconds"),
])
def test_lease_settings_are_checked_naming_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(BuildError, match=match):
        LeaseSettings.from_env(env)


def test_lease_settings_default_and_override() -> None:
    assert LeaseSettings.from_env({}) == LeaseSettings(600.0, None)
    assert LeaseSettings.from_env({}).renew_every_s == 200.0
    assert LeaseSettings.from_env({TTL_ENV: "30", RENEW_ENV: "5"}).renew_every_s == 5.0


REFUSED: list[str] = []


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: object):
        yield self.data


def _refuse_if_none_match(request, **_: object):
    """A server without If-None-Match on PUT: it answers 501, as S3-compatible servers that lack
    a header do (every other request reaches the real server)."""
    from botocore.awsrequest import AWSResponse

    if request.method == "PUT" and "If-None-Match" in request.headers:
        REFUSED.append(request.url)
        body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NotImplemented</Code>"
                b"<Message>A header you provided implies functionality that is not implemented</Message></Error>")
        return AWSResponse(request.url, 501, {"Content-Type": "application/xml"}, _Body(body))
    return None


def test_without_if_none_match_the_lease_is_taken_by_read_write_and_read_back(s3_env: SeaweedS3) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-no-if-none-match")
    output = S3Output(f"s3://{bucket}/photos")
    events = output.store().client.meta.events  # one cached client per settings
    events.register_first("before-send.s3.PutObject", _refuse_if_none_match, unique_id="no-if-none-match")
    try:
        with BuildLease(output, LeaseSettings(ttl_s=30)) as first:
            held = lease_doc(client, bucket)
            assert held["token"] == first.record.token and held["pid"] == first.record.pid
            with pytest.raises(BuildLeaseHeldError, match=f"{HOST} pid {held['pid']} took its lease"):
                BuildLease(output, LeaseSettings(ttl_s=30)).acquire()
            first.check()  # renewals (If-Match) work as with the header
            assert REFUSED, "the server stand-in never refused If-None-Match: the fallback was not tested"
        assert keys(client, bucket, "photos/.pid-build") == []
        # An expired lease is taken over with If-Match on its ETag, the header not needed.
        stale = BuildLease(output, LeaseSettings(ttl_s=30))
        stale.acquire()
        later = BuildLease(output, LeaseSettings(ttl_s=30), now=lambda: time.time() + 60)
        later.acquire()
        assert lease_doc(client, bucket)["token"] == later.record.token != stale.record.token
        with pytest.raises(BuildLeaseLostError, match="this build lost its lease"):
            stale.check()
        later.release()
        assert keys(client, bucket, "photos/.pid-build") == []
    finally:
        events.unregister("before-send.s3.PutObject", unique_id="no-if-none-match")
