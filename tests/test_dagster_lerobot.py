"""The LeRobot assets on a real temporary Dagster instance: a real v3 dataset (real encoded video,
as a clean git checkout), its sidecar built and checked, published to a real bare git repo (or a
bucket on the real SeaweedFS server), read back from there and streamed one batch."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest

from loader.lerobot.sidecar import read_sidecar
from loader.lerobot.sidecar.publish_layout import SIDECAR_BRANCH, SIDECAR_DIR
from pid_platform.defs.lerobot import checks as lerobot_checks
from pid_platform.defs.lerobot.partitions import LEROBOT_DATASETS
from pid_platform.defs.lerobot.pools import PUBLISH_POOL, apply_pool_limits
from pid_platform.defs.lerobot.resources import LeRobotResource, git_revision, lerobot_from_env
from pid_platform.lerobot import stream_check
from pid_platform.lerobot.publish import GitTarget, publish_sidecar
from tests.support.dagster_runs import (
    check_metadata,
    check_outcomes,
    dagster_instance,
    load_defs,
    materialized,
    observed,
)
from tests.support.lerobot_data import CAMERAS
from tests.support.publish_data import (
    build,
    commit_on_branch,
    git,
    git_bytes,
    make_source_repo,
    refs,
    serve_partial_clones,
    touch_video,
)
from tests.support.seaweedfs import upload_tree

DATASET = "av1"
JOB = "lerobot_sidecar_build"


@pytest.fixture
def lerobot_env(tmp_path: Path, lerobot_v3_root: Path, monkeypatch: pytest.MonkeyPatch) -> dict:  # noqa: F811
    """PID_LEROBOT_ROOT with one dataset, ``av1``: a clean clone of a bare repo holding the v3
    dataset on ``main``; publishing goes back to that bare repo (``git:<root>/{dataset}.git``)."""
    git_root = tmp_path / "git"
    git_root.mkdir()
    bare, sha = make_source_repo(git_root, lerobot_v3_root, name=f"{DATASET}.git")
    serve_partial_clones(bare)  # as a git host does: publish and read-back fetch trees, not videos
    root = tmp_path / "lerobot"
    root.mkdir()
    git("clone", "--quiet", str(bare), str(root / DATASET))
    (root / "notes").mkdir()  # a folder that is not a dataset
    out = tmp_path / "out"
    monkeypatch.setenv("PID_LEROBOT_ROOT", str(root))
    monkeypatch.setenv("PID_OUTPUT_ROOT", str(out))
    monkeypatch.setenv("PID_LEROBOT_PUBLISH", f"git:{git_root}/{{dataset}}.git")
    monkeypatch.setenv("PID_LEROBOT_REPO_ID", "pid-tests/{dataset}")
    return {"root": root, "out": out, "bare": bare, "sha": sha}


def _run(defs: dg.Definitions, instance: dg.DagsterInstance, **kwargs) -> dg.ExecuteInProcessResult:
    if DATASET not in instance.get_dynamic_partitions(LEROBOT_DATASETS):
        instance.add_dynamic_partitions(LEROBOT_DATASETS, [DATASET])
    return defs.resolve_job_def(JOB).execute_in_process(instance=instance, partition_key=DATASET,
                                                        raise_on_error=False, **kwargs)


def test_sidecar_is_built_checked_and_published_to_the_git_repo(lerobot_env: dict) -> None:
    bare, sha = lerobot_env["bare"], lerobot_env["sha"]
    with dagster_instance() as instance:
        defs = load_defs()
        result = _run(defs, instance)
        assert result.success
        assert check_outcomes(result) == {"mp4_sidecar_is_valid": True, "published_sidecar_streams": True}
        assert check_metadata(result, "mp4_sidecar_is_valid")["problems_count"] == 0
        meta = materialized(result)
        built, published = meta["mp4_sidecar"], meta["published_mp4_sidecar"]

        sidecar = lerobot_env["out"] / "lerobot" / DATASET / "mp4-sidecar.npz"
        assert built["sidecar"] == str(sidecar) and sidecar.is_file()
        assert (built["files"], built["samples"], built["rebuilt"]) == (4, 88, True)
        assert (built["revision"], built["revision_source"]) == (sha, "git HEAD of a clean checkout")
        assert built["repo_id"] == "pid-tests/av1" and built["schema_version"] == 3
        assert built["int64_array_bytes"] == 8 * 5 * 88 + _sync_bytes(sidecar)
        assert 0 < built["compact_index_bytes"] < built["int64_array_bytes"]
        assert built["sidecar_bytes"] == sidecar.stat().st_size
        assert 0 < built["header_bytes"] < built["video_bytes"] and 0 < built["header_fraction"] < 1
        files = built["video_files"]  # a typed table: the UI sorts it and shows the row count
        assert isinstance(files, dg.TableMetadataValue) and built["dagster/row_count"] == 4
        assert {c.name: c.type for c in files.schema.columns}["samples"] == "int"
        first = files.records[0].data
        assert (first["file"], first["codec"], first["width"], first["height"]) == (
            "videos/observation.images.front/chunk-000/file-000.mp4", "av01", 64, 48)

        assert published["published"] is True and published["unchanged"] is False
        assert published["parent"] == sha
        assert refs(bare)["refs/heads/main"] == sha  # the source branch is untouched
        assert refs(bare)[f"refs/heads/{SIDECAR_BRANCH}"] == published["commit"]
        assert git_bytes(bare, SIDECAR_BRANCH, f"{SIDECAR_DIR}/{sha}.npz") == sidecar.read_bytes()

        # The sidecar read back from the branch streamed a batch shaped like the dataset's features.
        streamed = check_metadata(result, "published_sidecar_streams")
        assert streamed["problems_count"] == 0 and streamed["batch_size"] == 4
        assert streamed["sidecar_bytes_fetched"] == sidecar.stat().st_size
        assert streamed["payload_bytes_fetched"] > 0 and streamed["seconds"] > 0
        assert set(streamed["keys"]) == {*CAMERAS, "observation.state", "action", "timestamp", "frame_index",
                                         "episode_index", "index", "task_index", "task", "__pad__"}
        assert "| __pad__ | (4,) bool |" in streamed["shapes"]  # the reader's repeat mask, beside LeRobot's keys
        for camera in CAMERAS:
            assert f"| {camera} | (4, 3, 48, 64) float32 |" in streamed["shapes"]
        assert "| index | (4,) int64 |" in streamed["shapes"] and "| task | 4 str |" in streamed["shapes"]

        # Nothing changed: the sidecar is kept, the publish is a no-op on the same commit.
        again = materialized(_run(defs, instance))
        assert again["mp4_sidecar"]["rebuilt"] is False
        assert (again["published_mp4_sidecar"]["unchanged"], again["published_mp4_sidecar"]["commit"]) == (
            True, published["commit"])


def _sync_bytes(sidecar: Path) -> int:
    # int64 bytes = 8 x (5 per-sample arrays x samples + the sync sample indices).
    with read_sidecar(sidecar) as sc:
        return 8 * sum(len(sc.arrays(rel)["sync_samples"]) for rel in sc.files)


def test_a_failing_check_stops_the_publish(lerobot_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A video replaced between the build and the check (really rewritten on disk): the blocking
    check fails and the publish does not run in that run."""
    real = lerobot_checks.validate_sidecar

    def replaced_meanwhile(*args, **kwargs):
        touch_video(lerobot_env["root"] / DATASET)
        return real(*args, **kwargs)

    monkeypatch.setattr(lerobot_checks, "validate_sidecar", replaced_meanwhile)
    with dagster_instance() as instance:
        result = _run(load_defs(), instance)
        assert not result.success
        assert check_outcomes(result) == {"mp4_sidecar_is_valid": False}
        problems = check_metadata(result, "mp4_sidecar_is_valid")["problems"]
        assert any("changed" in p or "fingerprint" in p for p in problems), problems
        assert set(materialized(result)) == {"mp4_sidecar"}
    assert f"refs/heads/{SIDECAR_BRANCH}" not in refs(lerobot_env["bare"])


def test_publish_none_builds_and_says_nothing_was_published(lerobot_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PID_LEROBOT_PUBLISH", "none")
    with dagster_instance() as instance:
        result = _run(load_defs(), instance)
        assert result.success
        # Not materialized: nothing reads as published; an observation says why.
        assert set(materialized(result)) == {"mp4_sidecar"}
        note = observed(result)["published_mp4_sidecar"]
        assert note["published"] is False and "publishing is off" in note["note"]
        assert instance.get_materialized_partitions(dg.AssetKey("published_mp4_sidecar")) == set()
        assert "published_sidecar_streams" not in check_outcomes(result)  # nothing to stream: not run
    assert set(refs(lerobot_env["bare"])) == {"refs/heads/main"}


def test_an_unpinned_dataset_fails_its_git_publish_without_retries(lerobot_env: dict) -> None:
    checkout = lerobot_env["root"] / DATASET
    (checkout / "meta" / "stats.json").write_text("{}\n")  # an uncommitted change: not pinned
    with dagster_instance() as instance:
        result = _run(load_defs(), instance)
        assert not result.success
        assert materialized(result)["mp4_sidecar"]["revision"] == "(unpinned)"
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "full 40-character commit SHA" in failure.event_specific_data.error.message
        retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
        assert retries == []  # a refusal is final; retrying would not pin anything


def _sensor_tick(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None) -> dg.SensorResult:
    """One tick of lerobot_datasets_sensor, its events and partitions applied as the daemon does."""
    sensor = defs.resolve_sensor_def("lerobot_datasets_sensor")
    # A context manager: the code location's resources include the s3 resource, which is
    # opened and closed like the daemon does.
    with dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                                 resources=defs.resources) as ctx:
        res = sensor(ctx)
    for event in res.asset_events:
        instance.report_runless_asset_event(event)
    for request in res.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return res


def test_sensor_adds_datasets_and_requests_builds_when_they_change(lerobot_env: dict) -> None:
    # sqlite storage: it keeps pool limits (the in-memory one has none), as a deployment does.
    with dg.instance_for_test() as instance:
        defs = load_defs()

        def tick(cursor: str | None) -> dg.SensorResult:
            return _sensor_tick(defs, instance, cursor)

        def observed_versions() -> list[str]:
            records = instance.fetch_observations(dg.AssetKey("lerobot_dataset"), limit=10).records
            return [r.asset_observation.tags["dagster/data_version"] for r in reversed(records)]

        first = tick(None)
        assert [r.partition_key for r in first.run_requests] == [DATASET]  # "notes" is no dataset
        assert instance.get_dynamic_partitions(LEROBOT_DATASETS) == [DATASET]
        assert {p.name: p.limit for p in instance.event_log_storage.get_pool_limits()} == {PUBLISH_POOL: 1}

        assert len(observed_versions()) == 1  # the dataset's version, the source of its sidecar's lineage
        assert tick(first.cursor).run_requests == []  # nothing changed
        assert len(observed_versions()) == 1  # and nothing new observed
        checkout = lerobot_env["root"] / DATASET
        (checkout / "meta" / "info.json").write_bytes((checkout / "meta" / "info.json").read_bytes() + b"\n")
        git("commit", "--quiet", "-am", "touch info.json", cwd=checkout)
        changed = tick(first.cursor)
        assert [r.partition_key for r in changed.run_requests] == [DATASET]
        assert changed.run_requests[0].run_key != first.run_requests[0].run_key
        versions = observed_versions()
        assert len(versions) == 2 and versions[0] != versions[1] and versions[1] in changed.run_requests[0].run_key

        # An operator's own limit is kept.
        instance.event_log_storage.set_concurrency_slots(PUBLISH_POOL, 2)
        tick(changed.cursor)
        assert {p.name: p.limit for p in instance.event_log_storage.get_pool_limits()} == {PUBLISH_POOL: 2}


def test_sensor_builds_what_changed_since_the_last_build_not_the_last_request(lerobot_env: dict) -> None:
    """Keyed by the last sidecar build, as raw_sources_sensor is: a sidecar built outside the
    sensor (pid-demo, the Materialize button) is not built again on the first tick, and a dataset
    set back to an earlier state after a build of the other (A -> B -> A) is built again."""
    with dg.instance_for_test() as instance:
        defs = load_defs()

        def tick(cursor: str | None) -> dg.SensorResult:
            return _sensor_tick(defs, instance, cursor)

        assert _run(defs, instance).success  # built before the sensor's first tick
        assert tick(None).run_requests == []  # no redundant build
        checkout = lerobot_env["root"] / DATASET
        info = checkout / "meta" / "info.json"
        state_a = info.read_bytes()

        def commit(data: bytes, message: str) -> None:
            info.write_bytes(data)
            git("commit", "--quiet", "-am", message, cwd=checkout)
            git("push", "--quiet", "origin", "HEAD", cwd=checkout)  # a revision the repository has

        commit(state_a + b"\n", "state B")
        to_b = tick(None)
        assert [r.partition_key for r in to_b.run_requests] == [DATASET]
        assert _run(defs, instance).success  # B built
        assert tick(to_b.cursor).run_requests == []
        commit(state_a, "back to state A")  # the same files as the first build (a new commit)
        back = tick(to_b.cursor)
        assert [r.partition_key for r in back.run_requests] == [DATASET]
        assert back.run_requests[0].run_key not in {r.run_key for r in to_b.run_requests}
        # While a build of it runs, the dataset is left to that run.
        instance.create_run_for_job(defs.resolve_job_def(JOB), tags={"dagster/partition": DATASET},
                                    status=dg.DagsterRunStatus.STARTED)
        assert tick(None).run_requests == []


def test_publish_pool_lets_one_publish_run_at_a_time(lerobot_env: dict) -> None:
    """With the pool's single slot held by another run, the publish step waits; it runs once freed."""
    with dg.instance_for_test() as instance:
        defs = load_defs()
        assert apply_pool_limits(instance) == {PUBLISH_POOL: 1}
        assert _run(defs, instance).success  # builds the sidecar (and publishes it once)

        storage = instance.event_log_storage
        assert storage.claim_concurrency_slot(PUBLISH_POOL, "another-run", "publish").is_claimed
        done: list[dg.ExecuteInProcessResult] = []
        worker = threading.Thread(target=lambda: done.append(
            _run(defs, instance, asset_selection=[dg.AssetKey("published_mp4_sidecar")])))
        worker.start()
        # The run reaches the pool in its own time (seconds on a loaded machine), then waits there.
        deadline = time.monotonic() + 60
        while storage.get_concurrency_info(PUBLISH_POOL).pending_step_count == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert storage.get_concurrency_info(PUBLISH_POOL).pending_step_count == 1
        time.sleep(1.0)
        assert not done and worker.is_alive()  # blocked on the pool
        storage.free_concurrency_slot_for_step("another-run", "publish")
        worker.join(timeout=60)
        assert done and done[0].success
        assert materialized(done[0])["published_mp4_sidecar"]["unchanged"] is True


def test_publish_retries_transient_failures_in_its_own_pool() -> None:
    with dg.instance_for_test():
        asset = load_defs().resolve_assets_def("published_mp4_sidecar")
    policy = asset.op.retry_policy
    assert policy is not None and (policy.max_retries, policy.backoff) == (3, dg.Backoff.EXPONENTIAL)
    assert asset.op.pool == PUBLISH_POOL


# -- the published sidecar, read back from its target and streamed ------------------------------

def _edit_before_the_read_back(monkeypatch: pytest.MonkeyPatch, edit) -> None:
    """Run ``edit`` (a real change at the target) once, after the publish and right before the
    check reads the sidecar back: as if the publish itself had left that behind."""
    real = stream_check.fetch_published_sidecar
    pending = [edit]

    def fetch_after_edit(*args, **kwargs):
        while pending:
            pending.pop()()
        return real(*args, **kwargs)

    monkeypatch.setattr(stream_check, "fetch_published_sidecar", fetch_after_edit)


def _stream_problems(result: dg.ExecuteInProcessResult) -> list[str]:
    assert not result.success
    assert check_outcomes(result) == {"mp4_sidecar_is_valid": True, "published_sidecar_streams": False}
    assert set(materialized(result)) == {"mp4_sidecar", "published_mp4_sidecar"}
    return check_metadata(result, "published_sidecar_streams")["problems"]


def test_npz_bytes_that_differ_from_the_pointer_fail_the_stream_check(lerobot_env: dict,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bare, sha = lerobot_env["bare"], lerobot_env["sha"]
    npz = f"{SIDECAR_DIR}/{sha}.npz"

    def flip_a_byte() -> None:
        data = bytearray(git_bytes(bare, SIDECAR_BRANCH, npz))
        data[len(data) // 2] ^= 0xFF
        commit_on_branch(bare, SIDECAR_BRANCH, {npz: bytes(data)}, "edit the sidecar by hand")

    _edit_before_the_read_back(monkeypatch, flip_a_byte)
    with dagster_instance() as instance:
        defs = load_defs()
        [problem] = _stream_problems(_run(defs, instance))
        assert problem.startswith("PublishError: ") and f"#{SIDECAR_BRANCH}:{SIDECAR_DIR}/{sha}.json" in problem
        assert f"{sha}.npz has sha256" in problem and "the pointer says" in problem and "publish it again" in problem

        # The next run publishes the built sidecar over the edit, and that streams.
        again = _run(defs, instance)
        assert again.success and materialized(again)["published_mp4_sidecar"]["unchanged"] is False
        assert check_outcomes(again)["published_sidecar_streams"] is True


def test_a_sidecar_of_another_dataset_fails_the_stream_check(lerobot_env: dict, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole, self-consistent publish (pointer and sha256 agree) of a sidecar that does not
    belong to this dataset: only streaming through it catches this."""
    bare, sha = lerobot_env["bare"], lerobot_env["sha"]
    other = build(lerobot_env["root"] / DATASET, tmp_path / "other.npz", revision=sha, repo_id="pid-tests/other")
    _edit_before_the_read_back(monkeypatch, lambda: publish_sidecar(other, GitTarget(str(bare))))
    with dagster_instance() as instance:
        [problem] = _stream_problems(_run(load_defs(), instance))
    assert problem.startswith("SidecarError: ") and "not a usable MP4 sidecar of pid-tests/av1" in problem
    assert "built for repo 'pid-tests/other', not 'pid-tests/av1'" in problem


def test_a_missing_publish_fails_the_stream_check(lerobot_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    bare = lerobot_env["bare"]
    _edit_before_the_read_back(monkeypatch, lambda: git("branch", "--quiet", "-D", SIDECAR_BRANCH, cwd=bare))
    with dagster_instance() as instance:
        [problem] = _stream_problems(_run(load_defs(), instance))
    assert problem.startswith("NothingPublishedError: ") and f"has no branch {SIDECAR_BRANCH}" in problem


def test_s3_publish_is_read_back_and_streamed(tmp_path: Path, s3_env, lerobot_v3_root: Path,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Dataset and sidecar in a bucket on the real SeaweedFS server; then a pointer rewritten
    with a wrong sha256 after the publish."""
    bucket = s3_env.make_bucket(f"lerobot-{uuid.uuid4().hex[:12]}")
    upload_tree(s3_env.client(), lerobot_v3_root, bucket, f"lerobot/{DATASET}")
    monkeypatch.setenv("PID_LEROBOT_ROOT", f"s3://{bucket}/lerobot")
    monkeypatch.setenv("PID_OUTPUT_ROOT", str(tmp_path / "out"))
    monkeypatch.setenv("PID_LEROBOT_PUBLISH", f"s3://{bucket}/lerobot/{{dataset}}")
    monkeypatch.setenv("PID_LEROBOT_REPO_ID", "pid-tests/{dataset}")
    with dagster_instance() as instance:
        defs = load_defs()
        result = _run(defs, instance)
        assert result.success
        assert check_outcomes(result) == {"mp4_sidecar_is_valid": True, "published_sidecar_streams": True}
        streamed = check_metadata(result, "published_sidecar_streams")
        assert streamed["target"] == f"s3://{bucket}/lerobot/{DATASET}" and streamed["batch_size"] == 4
        assert streamed["sidecar_bytes_fetched"] == materialized(result)["published_mp4_sidecar"]["bytes"]

        pointer_key = f"lerobot/{DATASET}/{SIDECAR_DIR}/current.json"  # unpinned: a bucket has no commits

        def wrong_sha() -> None:
            client = s3_env.client()
            doc = json.loads(client.get_object(Bucket=bucket, Key=pointer_key)["Body"].read())
            client.put_object(Bucket=bucket, Key=pointer_key, Body=json.dumps({**doc, "sha256": "0" * 64}).encode())

        _edit_before_the_read_back(monkeypatch, wrong_sha)
        [problem] = _stream_problems(_run(defs, instance))
    assert problem.startswith("PublishError: ") and f"s3://{bucket}/{pointer_key}" in problem
    assert f"the pointer says {'0' * 64}" in problem


def test_resource_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lerobot_v3_root: Path) -> None:  # noqa: F811
    monkeypatch.chdir(tmp_path)
    res = lerobot_from_env({})
    assert (res.root, res.output_root, res.publish_target) == (
        str(tmp_path / "demo/lerobot"), str(tmp_path / "demo/out"), "none")
    assert res.target("x") is None and res.datasets() == []
    res = LeRobotResource(root="s3://b/lerobot", output_root=str(tmp_path), publish_target="hub",
                          repo_id_template="org/{dataset}")
    assert res.data_root("ds") == "s3://b/lerobot/ds" and str(res.target("ds")) == "hub:datasets/org/ds#lerobot-sidecars"
    assert res.revision("ds") == (None, "not a git checkout (a remote root): unpinned")
    with pytest.raises(ValueError, match="plain folder name"):
        res.sidecar_path("../elsewhere")
    copy = Path(shutil.copytree(lerobot_v3_root, tmp_path / "plain"))
    assert git_revision(copy) == (None, "not the top of a git checkout: unpinned")
