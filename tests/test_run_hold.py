"""Issue 34 part 1: a Dagster build run holds its source's output for the whole run, not per step.

Found on the second day: between two steps of a run (a write task holds no lock; nor does
the gap between steps) a ``pid-shard`` of the same output took the lock and interleaved with the
run. Now the run's hold (``sharding/run_hold.py``) refuses it, naming the run, for a folder
output and an ``s3://`` one; it lets go when the run ends (its last step, a step that fails
for good or is interrupted, or ``run_holds_sensor``), and a lost run's hold expires.

The runs are launched as the UI launches them (GraphQL, the daemon's run queue, run workers);
``pid-shard`` is a real process.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from pid_platform.defs.automation.run_holds import run_holds_sensor
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.run_hold import S3_HOLD_REL, RunHold, RunHoldForStep, hold_place
from tests.support.dagster_runs import load_defs
from tests.support.machines import pid_shard
from tests.support.seaweedfs import SeaweedS3, raw_and_output_buckets
from tests.support.ui_launch import (
    launch,
    launchpad_params,
    run_messages,
    terminate,
    ui_workspace,
    wait_done,
)
from tests.test_dagster_run_outcomes import (  # noqa: F401 - ui_home: the prepared instance fixture
    CANCELED,
    FAILURE,
    SOURCE,
    SUCCESS,
    _hide_a_file,
    _hold_first_shard,
    _wait_for,
    ui_home,
)

NO_PAUSE = {"PID_PAUSE_AT": ""}  # the run worker holds at a pause point; the CLI must not


def _cli(tmp_path: Path, raw_root: Path, output: str, machine: str = "cli", *extra: str):
    return pid_shard(tmp_path, machine, "--input-dir", str(raw_root / SOURCE), "--output-dir", output,
                     "--num-workers", "1", *extra, env=NO_PAUSE, check=False)


def _manifests(root: Path) -> list[Path]:
    return sorted(root.rglob("wdinfo.json"))


def _refused_naming(res, run_id: str, output: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert f"{output} is being built by Dagster run {run_id} (source_build, source {SOURCE})" in res.stderr, \
        res.stderr
    assert "Wait for that run to end" in res.stderr and "Runs page" in res.stderr, res.stderr


def _tick_run_holds_sensor(instance: dg.DagsterInstance) -> str:
    defs = load_defs()
    with dg.build_sensor_context(instance=instance, definitions=defs, resources=defs.resources) as tick:
        return run_holds_sensor(tick).skip_message


# --- Runs, as the UI starts them ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.usefixtures("ui_home")
def test_a_pid_shard_between_two_steps_of_a_run_is_refused_naming_it_until_the_run_is_cancelled(
    raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reached, go = _hold_first_shard(tmp_path, monkeypatch)
    monkeypatch.setenv("PID_PAUSE_TIMEOUT_S", "20")  # the cancelled writer thread gives up then
    output = str(out_root / SOURCE)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run = launch(context, launchpad_params("source_build", SOURCE, write_tasks=1, max_shard_size_mb=0.25))
        # Its write task is under way (it holds no lock: the tasks of one plan run side by side).
        _wait_for(reached, context, run, timeout_s=180)
        _refused_naming(_cli(tmp_path, raw_root, output), run, output)
        assert _manifests(out_root) == []  # the CLI committed nothing
        terminate(context, run)
        assert wait_done(instance, run, 120) == CANCELED
        _tick_run_holds_sensor(instance)  # if the interrupted step did not release it itself
        assert hold_place(output).read() is None
    assert _cli(tmp_path, raw_root, output).returncode == 0
    assert _manifests(out_root)


@pytest.mark.slow
@pytest.mark.usefixtures("ui_home")
def test_a_pid_shard_of_an_s3_output_mid_run_is_refused_and_builds_once_the_run_succeeded(
    s3_env: SeaweedS3, photo_drop_template: Path, raw_root: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = raw_and_output_buckets(s3_env, photo_drop_template, monkeypatch, "hold")
    monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / "work"))
    output = f"s3://hold-out/built/{SOURCE}"
    reached, go = _hold_first_shard(tmp_path, monkeypatch)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run = launch(context, launchpad_params("source_build", SOURCE, write_tasks=1, max_shard_size_mb=0.25))
        _wait_for(reached, context, run, timeout_s=180)
        held = json.loads(client.get_object(Bucket="hold-out", Key=f"built/{SOURCE}/{S3_HOLD_REL}")["Body"].read())
        assert (held["run_id"], held["source"]) == (run, SOURCE)
        _refused_naming(_cli(tmp_path, raw_root, output), run, output)
        go.write_text("")
        assert wait_done(instance, run, 300, context) == SUCCESS
    # The run's last step let go of the output: the CLI builds it (its own settings: a re-shard).
    assert hold_place(S3Output(output)).read() is None
    res = _cli(tmp_path, raw_root, output)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("ui_home")
def test_a_run_that_ends_before_its_last_step_is_let_go_by_the_sensor(
    raw_root: Path, out_root: Path, tmp_path: Path,
) -> None:
    """Materialize of sample_set alone: the run succeeds without the manifests step that lets
    go; until the sensor's tick sees it ended, the output stays the run's."""
    output = str(out_root / SOURCE)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run = launch(context, launchpad_params("source_build", SOURCE, assets=["sample_set"]))
        assert wait_done(instance, run, 300, context) == SUCCESS
        _refused_naming(_cli(tmp_path, raw_root, output), run, output)
        said = _tick_run_holds_sensor(instance)
        assert said == f"released the holds of ended runs: {SOURCE} ({run[:8]}, success)", said
        assert _tick_run_holds_sensor(instance) == "no ended run still held its output"
    res = _cli(tmp_path, raw_root, output)
    assert res.returncode == 0, res.stderr


@pytest.mark.usefixtures("ui_home")
def test_the_sensor_keeps_the_hold_of_a_run_waiting_between_two_of_its_steps(out_root: Path) -> None:
    """Between two steps (the next one queued for pool slots, say) no step of the run renews its
    hold: each tick renews the hold of a source's running build run, so it outlives its TTL while
    the run lives; a hold of a run that is not running is left to expire or be released."""
    output = str(out_root / SOURCE)
    with dg.DagsterInstance.get() as instance:
        run = create_run_for_test(instance, job_name="source_build", status=dg.DagsterRunStatus.STARTED,
                                  tags={"dagster/partition": SOURCE})
        _hold(output, run.run_id, renewed_ago=50.0, ttl_s=60.0)  # 10 s from expiring
        said = _tick_run_holds_sensor(instance)
        assert said.endswith(f"renewed the holds of running runs: {SOURCE} ({run.run_id[:8]})"), said
        hold = hold_place(output).read()[0]
        assert hold.run_id == run.run_id and time.time() - hold.renewed < 5, hold
        # Another run's hold on the output (not this source's running run) is not renewed.
        hold_place(output).store.delete(hold_place(output).key)
        _hold(output, "0123abcd-other", renewed_ago=50.0, ttl_s=60.0)
        before = hold_place(output).read()[0]
        assert "renewed" not in _tick_run_holds_sensor(instance)
        assert hold_place(output).read()[0] == before


@pytest.mark.slow
@pytest.mark.usefixtures("ui_home")
def test_a_step_that_fails_for_good_lets_go_of_the_output_at_once(
    raw_root: Path, out_root: Path, tmp_path: Path,
) -> None:
    """No sensor tick here: the failed write task's own step lets go, and the CLI builds."""
    output = str(out_root / SOURCE)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        staged = launch(context, launchpad_params("source_build", SOURCE, ["sample_set"]))
        assert wait_done(instance, staged, 300, context) == SUCCESS
        image, real = _hide_a_file(raw_root)  # a staged sample's file gone: its write task fails for good
        failed = launch(context, launchpad_params("source_build", SOURCE, ["twin_tar_shards"], write_tasks=1))
        assert wait_done(instance, failed, 300, context) == FAILURE
        assert any(f"took over the hold of run {staged}" in m for m in run_messages(instance, failed))
        assert hold_place(output).read() is None
    shutil.rmtree(image)
    real.rename(image)
    assert _cli(tmp_path, raw_root, output).returncode == 0


# --- The hold as a CLI meets it -------------------------------------------------------------------

def _hold(output, run_id: str = "0123abcd-run", *, renewed_ago: float = 0.0, ttl_s: float = 60.0) -> None:
    """A run's hold as its step writes it (renewed ``renewed_ago`` seconds ago)."""
    with RunHoldForStep(output, run_id, "source_build", SOURCE, ttl_s=ttl_s,
                        now=lambda: time.time() - renewed_ago):
        pass


@pytest.fixture(params=["folder", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, object]:
    """The output a test's CLI builds: a folder, or a prefix of a bucket of its own."""
    if request.param == "folder":
        out = tmp_path / "out" / SOURCE
        return str(out), out
    bucket = s3_bucket_for(request.getfixturevalue("s3_env"), request.node.nodeid)
    url = f"s3://{bucket}/built/{SOURCE}"
    return url, S3Output(url)


def s3_bucket_for(s3: SeaweedS3, nodeid: str) -> str:
    return s3.make_bucket(f"hold-{hashlib.sha256(nodeid.encode()).hexdigest()[:16]}")


def test_a_live_hold_refuses_pid_shard_plan_and_task_naming_the_run(
    where: tuple[str, object], raw_root: Path, tmp_path: Path,
) -> None:
    url, output = where
    _hold(output)
    for extra in ((), ("plan",), ("task", "--index", "0", "--of", "1")):
        args = [*extra, "--input-dir", str(raw_root / SOURCE), "--output-dir", url, "--num-workers", "1"]
        res = pid_shard(tmp_path, "cli", *args, env=NO_PAUSE, check=False)
        assert res.returncode == 2, (extra, res.stderr)
        assert f"{url} is being built by Dagster run 0123abcd-run (source_build, source {SOURCE})" in res.stderr
        assert hold_place(output).where in res.stderr  # what to delete if that run is gone
    if isinstance(output, Path):
        assert not output.exists()


def test_an_expired_hold_does_not_block(where: tuple[str, object], raw_root: Path, tmp_path: Path) -> None:
    url, output = where
    _hold(output, renewed_ago=61.0, ttl_s=60.0)  # a run lost without its end seen
    assert _cli(tmp_path, raw_root, url).returncode == 0


@pytest.mark.parametrize("body, says", [
    (b"{not json", "not valid JSON"),
    (b'{"run_hold_version": 1, "run_id": "r", "job": "j", "source": "s", "taken": 1, "renewed": 1, "ttl_s": 1e400}',
     "1e400 is out of the range of a float"),
    (b'{"run_hold_version": 1, "run_id": "r", "job": "j", "source": "s", "taken": 1, "renewed": 1, "ttl_s": 1}',
     "ttl_s = 1, not a number in [10, 604800]"),
    (b'{"run_hold_version": 2}', "run_hold_version = 2, not 1"),
    (b'{"run_hold_version": 1, "run_id": "r", "job": "j", "source": "s", "taken": 1, "renewed": 1, '
     b'"ttl_s": 60, "owner": "x"}', "unknown key 'owner'"),
])
def test_a_malformed_hold_is_refused_naming_the_file(
    where: tuple[str, object], raw_root: Path, tmp_path: Path, body: bytes, says: str,
) -> None:
    url, output = where
    place = hold_place(output)
    place.store.put(place.key, body)
    res = _cli(tmp_path, raw_root, url)
    assert res.returncode == 2, res.stderr
    assert place.where in res.stderr and says in res.stderr and "delete the file" in res.stderr, res.stderr


def test_a_run_s_own_later_step_renews_the_hold_and_another_run_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out" / SOURCE
    _hold(out, "run-a")
    first = hold_place(out).read()[0]
    with RunHoldForStep(out, "run-a", "source_build", SOURCE, ttl_s=60.0) as later:
        assert later.record == RunHold("run-a", "source_build", SOURCE, first.taken, later.record.renewed, 60.0)
    from pid_platform.sharding.run_hold import HeldByRunError

    with pytest.raises(HeldByRunError, match="Dagster run run-a"):
        RunHoldForStep(out, "run-b", "source_build", SOURCE).__enter__()
    # A run the instance knows has ended is taken over.
    with RunHoldForStep(out, "run-b", "source_build", SOURCE, may_take_over=lambda r: r == "run-a") as taken:
        assert taken.took_over is not None and taken.took_over.run_id == "run-a"
    assert hold_place(out).read()[0].run_id == "run-b"


def test_steps_of_one_run_side_by_side_keep_renewing_the_hold(where: tuple[str, object]) -> None:
    """Write tasks of one run renew the hold each from its own process: one's renewal changes the
    ETag the other last wrote, and must not end the other's renewals."""
    _url, output = where
    with RunHoldForStep(output, "run-a", "source_build", SOURCE, ttl_s=60.0) as one, \
            RunHoldForStep(output, "run-a", "source_build", SOURCE, ttl_s=60.0, now=lambda: time.time() + 5) as two:
        assert two.record is not None
        assert one._renew_once()  # after the other's write: renewed still
        assert hold_place(output).read()[0] == one.record  # its renewal is the one there now
        hold_place(output).store.delete(hold_place(output).key)  # released (the run's last step)
        assert not one._renew_once()  # a released hold is not brought back
        assert hold_place(output).read() is None
