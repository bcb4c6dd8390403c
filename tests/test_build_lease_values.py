"""Lease and claim values that must neither hang nor crash a build, and the rerun right after a
``kill -9`` (listed in ``tests/test_hostile_inputs.py``), against a real SeaweedFS and real
processes.

A lease or claim is in a bucket others can write to: ``1e400`` in a number crashed ``pid-shard``
with an ``OverflowError``; ``expires`` ten years ahead blocked the output "until 2036"; a killed
build's lease held its own machine's rerun for the whole TTL although its process was gone.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pid_platform.sharding.commit.claims import (
    CLAIMS_DIR,
    DELETE,
    ClaimWaitTimeout,
    HeldClaim,
    claims_on,
    wait_until_unclaimed,
)
from pid_platform.sharding.commit.holder_process import HolderProcess
from pid_platform.sharding.commit.lease import (
    LEASE_REL,
    RENEW_ENV,
    TTL_ENV,
    BuildLease,
    BuildLeaseError,
    BuildLeaseHeldError,
    LeaseSettings,
)
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.errors import BuildError
from tests.conftest import SOURCE
from tests.support.paused_procs import pid_shard
from tests.support.s3_objects import keys, pointer
from tests.support.seaweedfs import SeaweedS3

HOST = socket.gethostname()[:100]
TEN_YEARS = 10 * 365 * 86400.0


def _put(client, bucket: str, key: str, body: dict | bytes) -> None:
    client.put_object(Bucket=bucket, Key=key, Body=body if isinstance(body, bytes) else json.dumps(body).encode())


def _lease(t: float, **changes) -> dict:
    doc = {"lease_version": 1, "host": "other-machine", "pid": 4242, "token": "f" * 32, "started": t - 5,
           "renewed": t - 5, "expires": t + 595, "ttl_s": 600.0, "version": None}
    return {**doc, **changes}


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("env", "match"), [
    ({TTL_ENV: "1e300"}, "ttl_s = 1e[+]300: give 2 to 86400 seconds"),
    ({TTL_ENV: "86401"}, "ttl_s = 86401.0: give 2 to 86400 seconds"),
    ({TTL_ENV: "60", RENEW_ENV: "1e-9"}, "renew_s = 1e-09: give 1 to 30 seconds"),
    ({TTL_ENV: "9" * 60}, r"PID_LEASE_TTL_S='9{30}.*\(62 characters\): give a number of seconds"),
])
def test_lease_ttl_and_renewal_are_bounded(env: dict[str, str], match: str) -> None:
    with pytest.raises(BuildError, match=match) as exc:
        LeaseSettings.from_env(env)
    assert "PID_LEASE_TTL_S" in str(exc.value)


@pytest.mark.parametrize("ttl", [0.0, 1e300, float("nan"), float("inf")])
def test_a_claims_ttl_is_bounded(s3_env: SeaweedS3, ttl: float) -> None:
    with pytest.raises(BuildError, match="a delete claim's ttl_s = .*: give 1 to 86400 seconds"):
        HeldClaim(S3Output("s3://any/photos"), "v1", DELETE, ttl_s=ttl)


# --------------------------------------------------------------------------- lease values


@pytest.mark.parametrize(("case", "body"), [
    ("1e400 as pid", b'{"lease_version": 1, "host": "h", "pid": 1e400, "token": "t", "started": 1, "renewed": 1, '
                     b'"expires": 2, "ttl_s": 600}'),
    ("1e400 as expires", b'{"lease_version": 1, "host": "h", "pid": 7, "token": "t", "started": 1, "renewed": 1, '
                         b'"expires": 1e400, "ttl_s": 600}'),
    ("NaN as renewed", b'{"lease_version": 1, "host": "h", "pid": 7, "token": "t", "started": 1, "renewed": NaN, '
                       b'"expires": 2, "ttl_s": 600}'),
    ("a 30-digit pid", b'{"lease_version": 1, "host": "h", "pid": 123456789012345678901234567890, "token": "t", '
                       b'"started": 1, "renewed": 1, "expires": 2, "ttl_s": 600}'),
    ("a TTL of 1e300", b'{"lease_version": 1, "host": "h", "pid": 7, "token": "t", "started": 1, "renewed": 1, '
                       b'"expires": 2, "ttl_s": 1e300}'),
    ("a pid that is text", b'{"lease_version": 1, "host": "h", "pid": "7", "token": "t", "started": 1, '
                           b'"renewed": 1, "expires": 2, "ttl_s": 600}'),
    ("a list", b"[1, 2]"),
])
def test_a_lease_with_values_no_build_writes_is_refused_naming_it(s3_env: SeaweedS3, case: str, body: bytes) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket(f"lease-values-{abs(hash(case)) % 10**8}")
    url = f"s3://{bucket}/photos"
    _put(client, bucket, f"photos/{LEASE_REL}", body)
    with pytest.raises(BuildLeaseError) as exc:
        BuildLease(S3Output(url), LeaseSettings(ttl_s=30)).acquire()
    message = str(exc.value)
    assert f"{url}/{LEASE_REL}" in message and "delete it" in message and len(message) < 400, message


def test_a_dead_holders_lease_claiming_ten_years_is_stale_at_its_renewal_plus_ttl(
        s3_env: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-ten-years")
    output = S3Output(f"s3://{bucket}/photos")
    t = time.time()
    _put(client, bucket, f"photos/{LEASE_REL}", _lease(t, renewed=t - 700, expires=t + TEN_YEARS))
    with caplog.at_level(logging.WARNING), BuildLease(output, LeaseSettings(ttl_s=30)) as lease:
        assert lease.record is not None and lease.record.pid != 4242
    assert "took over the lease of other-machine pid 4242, which went stale" in caplog.text
    # A renewal "in ten years" is no lease a process writes: not honoured either.
    _put(client, bucket, f"photos/{LEASE_REL}", _lease(t, renewed=t + TEN_YEARS, expires=t + TEN_YEARS))
    with BuildLease(output, LeaseSettings(ttl_s=30)):
        pass
    assert "lies further ahead than a lease of 600 s can" in caplog.text
    # A live lease of another machine is still honoured, and the message's expiry is its
    # renewal plus its TTL, not the "expires" it claims.
    _put(client, bucket, f"photos/{LEASE_REL}", _lease(t, expires=t + 3 * 86400, ttl_s=900.0))
    with pytest.raises(BuildLeaseHeldError, match=r"other-machine pid 4242 took its lease .* \(in 1[45] min\)"):
        BuildLease(output, LeaseSettings(ttl_s=30)).acquire()


def test_a_lease_of_this_machine_is_taken_over_only_when_its_process_is_gone(
        s3_env: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-this-machine")
    url = f"s3://{bucket}/photos"
    output = S3Output(url)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = HolderProcess.of(sleeper.pid)
        assert me.start is not None and me.on_this_machine(), "no /proc here: the test proves nothing"
        t = time.time()
        mine = _lease(t, host=me.host, pid=me.pid, boot=me.boot, pidns=me.pidns, pid_start=me.start)
        _put(client, bucket, f"photos/{LEASE_REL}", mine)
        with pytest.raises(BuildLeaseHeldError, match=f"{HOST} pid {sleeper.pid} took its lease .* That process is still "
                                                      "running on this machine"):
            BuildLease(output, LeaseSettings(ttl_s=30)).acquire()
        # Another machine's boot, or a record without one: it cannot be judged from here.
        for other in ({"boot": "another-boot"}, {"boot": None}, {"pidns": me.pidns + 1}):
            _put(client, bucket, f"photos/{LEASE_REL}", {**mine, **other})
            with pytest.raises(BuildLeaseHeldError):
                BuildLease(output, LeaseSettings(ttl_s=30)).acquire()
        # The same pid with another start time: the holder died and its pid was reused.
        _put(client, bucket, f"photos/{LEASE_REL}", {**mine, "pid_start": me.start - 1})
        with caplog.at_level(logging.WARNING), BuildLease(output, LeaseSettings(ttl_s=30)):
            pass
        assert f"took over the lease of {HOST} pid {sleeper.pid}, whose process is gone" in caplog.text
    finally:
        sleeper.kill()
        sleeper.wait()
    caplog.clear()
    _put(client, bucket, f"photos/{LEASE_REL}", mine)  # its pid is free now
    with caplog.at_level(logging.WARNING), BuildLease(output, LeaseSettings(ttl_s=30)):
        pass
    assert f"took over the lease of {HOST} pid {sleeper.pid}, whose process is gone" in caplog.text
    assert keys(client, bucket, "photos/.pid-build") == []


def test_kill_9_of_pid_shard_and_an_immediate_rerun_resumes_and_publishes(
        s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, procs) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("lease-rerun")
    url = f"s3://{bucket}/photos"
    args = pid_shard("--input-dir", str(raw_root / SOURCE), "--output-dir", url, "--max-shard-size-mb", "0.25",
                     "--num-workers", "1")
    env = {"PID_WORK_ROOT": str(tmp_path / "work")}  # one machine, one work root: the rerun's
    a = procs(args, tmp_path / "a", "publish:before-switch", env)  # default TTL: 600 s
    a.wait_reached("publish:before-switch")  # every object sent and checked
    held = json.loads(client.get_object(Bucket=bucket, Key=f"photos/{LEASE_REL}")["Body"].read())
    assert held["version"] and held["expires"] > time.time() + 500
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    b = procs(args, tmp_path / "b", env=env)
    assert b.finish() == 0, b.stderr()
    assert f"took over the lease of {HOST} pid {a.proc.pid}, whose process is gone" in b.stderr()
    published = pointer(client, bucket, "photos")
    assert published["version"] == held["version"]  # the killed build's version, resumed
    assert f"pid {b.proc.pid}" in published["built_by"]
    assert keys(client, bucket, "photos/.pid-build") == []


# --------------------------------------------------------------------------- claims


def test_a_delete_claim_of_ten_years_does_not_hold_a_build(s3_env: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    client, bucket = s3_env.client(), s3_env.make_bucket("claim-values")
    output = S3Output(f"s3://{bucket}/photos")
    t = time.time()
    base = {"claim_version": 1, "subject": "v1", "purpose": DELETE, "holder": "other-machine pid 4242"}
    _put(client, bucket, f"photos/{CLAIMS_DIR}/v1/delete-a.json", {**base, "expires": t + TEN_YEARS})
    _put(client, bucket, f"photos/{CLAIMS_DIR}/v1/delete-b.json",
         {**base, "expires": t + TEN_YEARS, "renewed": t - 700, "ttl_s": 600})
    _put(client, bucket, f"photos/{CLAIMS_DIR}/v1/delete-c.json",
         b'{"claim_version": 1, "subject": "v1", "purpose": "delete", "holder": "x", "expires": 1e400}')
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        wait_until_unclaimed(output, "v1", DELETE, max_wait_s=30)
    assert time.monotonic() - start < 5
    assert "delete-c.json: 1e400 is out of the range of a float" in caplog.text
    assert [c.live(time.time()) for c in claims_on(output, "v1")] == [False, False]


def test_a_claim_object_of_16_mb_is_not_read_whole(s3_env: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone who can write the bucket can put a huge object among the claims: it is refused as a
    claim after its first 4 KB, not read whole into every build that looks at the claims."""
    import tracemalloc

    client, bucket = s3_env.client(), s3_env.make_bucket("claim-huge")
    output = S3Output(f"s3://{bucket}/photos")
    _put(client, bucket, f"photos/{CLAIMS_DIR}/v1/delete-huge.json", b'{"claim_version": 1, "x": "' + b"a" * (16 << 20))
    assert claims_on(output, "v0") == []  # the S3 client made (its service model is ~10 MB) before counting
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            assert claims_on(output, "v1") == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "delete-huge.json" in caplog.text and "4096" in caplog.text, caplog.text
    assert peak < 4 << 20, peak  # read whole, the object alone is 16 MB


def test_a_wait_for_a_live_claim_is_bounded_and_names_it(s3_env: SeaweedS3) -> None:
    bucket = s3_env.make_bucket("claim-wait")
    output = S3Output(f"s3://{bucket}/photos")
    with HeldClaim(output, "v1", DELETE, holder="cleanup-host pid 77", ttl_s=3), \
            pytest.raises(ClaimWaitTimeout) as exc:
        wait_until_unclaimed(output, "v1", DELETE, max_wait_s=4)  # renewed meanwhile: still live
    message = str(exc.value)
    assert "waited 4 s for the delete claim of cleanup-host pid 77 on v1" in message
    assert f"s3://{bucket}/photos/{CLAIMS_DIR}/v1/delete-" in message


# --------------------------------------------------------------------------- the pointer


@pytest.mark.parametrize(("body", "match"), [
    (b'{"format_version": 1, "version": "0123456789abcdef", "manifests": [], "retired": {"0123": 1e400}}',
     "out of the range of a float"),
    (b'{"format_version": 1, "format_version": 1}', "written twice"),
    (b'{"format_version": NaN}', "NaN is not a JSON number"),
    (b"[" * 100000, "nested too deeply"),
    # A time that is a boolean (or before 1970) is no retirement time: ``true`` was read as 1.0,
    # a version retired in 1970, which garbage collection would delete at once.
    (b'{"format_version": 1, "version": "0123456789abcdef", "manifests": [], "retired": {"0123456789abcdee": true}}',
     "'retired' must map version ids to times"),
    (b'{"format_version": 1, "version": "0123456789abcdef", "manifests": [], "retired": {"0123456789abcdee": -5}}',
     "'retired' must map version ids to times"),
])
def test_a_pointer_with_values_no_build_writes_is_a_format_error_naming_it(body: bytes, match: str) -> None:
    from loader.formats.errors import FormatError
    from loader.formats.version_pointer import parse_pointer

    with pytest.raises(FormatError, match=match) as exc:
        parse_pointer(body, "s3://b/photos/current.json")
    assert "s3://b/photos/current.json" in str(exc.value)
