"""The Dagster UI in a real browser: ``dagster dev -w workspace.yaml`` with the project's
instance config, the asset graph opened in headless Chromium, every asset, the partitions and
the checks shown, runs launched through the webserver's GraphQL API and watched to success (the
catalog; a re-shard of one source with the config the launchpad pre-fills, one setting changed),
and screenshots saved under the test's folder."""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

import dagster as dg
import pytest
import yaml

from pid_platform.demo import pid_demo as demo
from pid_platform.demo.sample_data import make_sample_source
from pid_platform.sharding.settings import SETTINGS_NAME
from tests.support.browser import CHROMEDRIVER, CHROMIUM, headless_chromium, wait_for_text
from tests.support.dagster_dev import DagsterDev
from tests.support.dagster_runs import build_catalog, build_source, load_defs, tars, use_roots

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                       reason="needs Debian's chromium and chromium-driver (./dev test installs them)"),
]

ASSETS = ["sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests", "dataset_catalog", "mp4_sidecar",
          "published_mp4_sidecar"]
SOURCES = ["photos", "portraits"]
LAUNCH = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""
# The global lineage with every group expanded (the UI's own `expanded` query parameter).
GRAPH = "/asset-groups?expanded=" + urllib.parse.quote(",".join(
    f"global@global:{g}" for g in ("webdataset_build", "catalog", "lerobot")))
STATUS = """query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }"""
# What the launchpad pre-fills: the webserver's default config of the job.
PREFILLED = """query($selector: PipelineSelector!) { runConfigSchemaOrError(selector: $selector) {
  __typename ... on RunConfigSchema { rootDefaultYaml } ... on PythonError { message } } }"""
LOCATION = {"repositoryLocationName": "pid_platform", "repositoryName": "__repository__"}
OPERATOR_SETTINGS = "max_shard_size_mb: 1\nseed: 7\n"  # what the operator set before
AUTOMATION_RUNS = """query($filter: RunsFilter) { runsOrError(filter: $filter) { __typename
  ... on Runs { results { runId status assetSelection { path } } } } }"""
CATALOG_CHECKS = """query { assetNodeOrError(assetKey: {path: ["dataset_catalog"]}) { __typename
  ... on AssetNode { assetChecksOrError { __typename ... on AssetChecks {
    checks { name executionForLatestMaterialization { status } } } } } } }"""


def _wait_for_run(dev: DagsterDev, run_id: str, log: Path, timeout_s: float) -> None:
    deadline, status = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        status = dev.graphql(STATUS, {"id": run_id})["runOrError"]["status"]
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        time.sleep(1)
    assert status == "SUCCESS", (status, log.read_text()[-3000:])


def _catalog_followed(dev: DagsterDev, before: set[str], log: Path, timeout_s: float) -> str:
    """The first run the automation sensor launched for ``dataset_catalog`` that is not in
    ``before``, watched to success."""
    deadline = time.monotonic() + timeout_s
    flt = {"tags": [{"key": "pid/launched_by", "value": "automation"}]}
    while time.monotonic() < deadline:
        runs = dev.graphql(AUTOMATION_RUNS, {"filter": flt})["runsOrError"]["results"]
        new = [r for r in runs if r["runId"] not in before
               and ["dataset_catalog"] in [a["path"] for a in r["assetSelection"] or []]]
        if new:
            _wait_for_run(dev, new[-1]["runId"], log, max(1.0, deadline - time.monotonic()))
            return new[-1]["runId"]
        time.sleep(2)
    raise AssertionError(f"no automation run of dataset_catalog within {timeout_s} s: {log.read_text()[-3000:]}")


def _automation_runs(dev: DagsterDev) -> set[str]:
    flt = {"tags": [{"key": "pid/launched_by", "value": "automation"}]}
    return {r["runId"] for r in dev.graphql(AUTOMATION_RUNS, {"filter": flt})["runsOrError"]["results"]}


def _built_with(out: Path) -> dict:
    return json.loads((out / ".pid-build" / "sharding.json").read_bytes())


def _shown(browser, texts: list[str], what: str, shots: Path) -> None:
    missing = wait_for_text(browser, texts)
    if missing:
        browser.save_screenshot(str(shots / f"missing-{what.replace(' ', '-')}.png"))
    assert missing == [], f"{what}: not shown: {missing} (screenshot in {shots})"


def _snap(browser, url: str, texts: list[str], what: str, shots: Path, name: str) -> None:
    """Open ``url``, wait until ``texts`` show, save a screenshot as ``name``."""
    browser.get(url)
    _shown(browser, texts, what, shots)
    browser.save_screenshot(str(shots / name))


def test_asset_graph_partitions_checks_and_a_launched_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = demo.prepare_home(tmp_path / "home")
    env = {"PID_RAW_ROOT": str(tmp_path / "raw"), "PID_OUTPUT_ROOT": str(tmp_path / "out"),
           "PID_LEROBOT_ROOT": str(tmp_path / "lerobot")}
    for folder in env.values():
        Path(folder).mkdir()
    # One source, built before the UI starts, with settings its operator chose: the discovery
    # sensor (on by default) finds its committed build current and starts nothing of its own.
    source = make_sample_source(tmp_path / "raw" / "photos", photos=("coffee", "astronaut", "chelsea"),
                                ratios=((3, 4),), with_problems=False)
    (source / SETTINGS_NAME).write_text(OPERATOR_SETTINGS)
    use_roots(monkeypatch, tmp_path / "raw", tmp_path / "out")
    with dg.instance_for_test(), dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("sources", SOURCES)
        instance.add_dynamic_partitions("lerobot_datasets", [demo.LEROBOT_DATASET])
        assert build_source(load_defs(), instance, "photos").success
    out = tmp_path / "out" / "photos"
    before = tars(out)
    assert _built_with(out)["shard_size"] == 0
    shots = tmp_path / "screenshots"
    shots.mkdir()

    with DagsterDev(home, env, tmp_path / "dagster-dev.log") as dev, \
            headless_chromium(tmp_path / "chromium-profile", tmp_path / "chromedriver.log") as browser:
        # The graph draws long names shortened at this zoom ("published..._sidecar"); the catalog
        # lists each in full.
        _snap(browser, f"{dev.url}{GRAPH}", ["webdataset_build", "lerobot", "catalog", *ASSETS[:-1]],
              "asset graph", shots, "asset-graph.png")
        browser.get(f"{dev.url}/assets")
        _shown(browser, ASSETS, "asset catalog", shots)

        browser.get(f"{dev.url}/assets/sample_set?view=partitions")
        _shown(browser, SOURCES, "source partitions", shots)
        browser.get(f"{dev.url}/assets/mp4_sidecar?view=partitions")
        _shown(browser, [demo.LEROBOT_DATASET], "dataset partitions", shots)
        browser.get(f"{dev.url}/assets/twin_tar_shards?view=checks")
        _shown(browser, ["twin_tar_keys_match", "shards_within_size_bound"], "checks", shots)

        selector = {**LOCATION, "jobName": "catalog_build"}
        browser.get("about:blank")  # no page polls the webserver while the run works (2 cores)
        launched = dev.graphql(LAUNCH, {"params": {"selector": selector, "runConfigData": {}}})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]
        _wait_for_run(dev, run_id, tmp_path / "dagster-dev.log", 90)
        browser.get(f"{dev.url}/runs/{run_id}")
        _shown(browser, ["catalog_build", "Success"], "run page", shots)
        browser.get(f"{dev.url}{GRAPH}")
        _shown(browser, ASSETS[:-1], "asset graph after the run", shots)
        time.sleep(2)  # let the graph settle its layout and the catalog's new state
        browser.save_screenshot(str(shots / "asset-graph-after-run.png"))

        # Re-shard photos from the launchpad: its pre-filled config, one setting changed.
        _snap(browser, f"{dev.url}/locations/pid_platform/jobs/source_build",
              ["source_build", "sample_set", "twin_tar_shards"], "source_build job", shots, "source-build-job.png")
        before_reshard = _automation_runs(dev)
        browser.get("about:blank")
        reshard_id = _launch_reshard(dev, 2)
        _wait_for_run(dev, reshard_id, tmp_path / "dagster-dev.log", 400)
        _snap(browser, f"{dev.url}/runs/{reshard_id}", ["source_build", "Success"],
              "re-shard run page", shots, "reshard-run.png")
        _snap(browser, f"{dev.url}/assets/twin_tar_shards?partition=photos", ["twin_tar_shards", "photos"],
              "re-sharded asset", shots, "reshard-asset.png")

        # The catalog follows the re-shard on its own (the automation sensor is on in a fresh
        # instance) and its check passes: a green catalog.
        browser.get("about:blank")
        _catalog_followed(dev, before_reshard, tmp_path / "dagster-dev.log", 240)
        node = dev.graphql(CATALOG_CHECKS)["assetNodeOrError"]
        checks = {c["name"]: (c["executionForLatestMaterialization"] or {}).get("status")
                  for c in node["assetChecksOrError"]["checks"]}
        assert checks and set(checks.values()) == {"SUCCEEDED"}, checks
        browser.get(f"{dev.url}{GRAPH}")
        _shown(browser, ASSETS[:-1], "asset graph after the re-shard", shots)
        time.sleep(2)
        browser.save_screenshot(str(shots / "asset-graph-after-reshard.png"))

    # The new tars: two samples a shard; the keys the operator did not touch are as they were.
    assert _built_with(out)["shard_size"] == 2 and _built_with(out)["max_shard_size_mb"] == 1
    assert len(tars(out)) > len(before)
    assert yaml.safe_load((source / SETTINGS_NAME).read_text()) == {
        **yaml.safe_load(OPERATOR_SETTINGS), "shard_size": 2}
    assert (shots / "asset-graph-after-run.png").stat().st_size > 10_000
    assert (shots / "reshard-run.png").stat().st_size > 10_000
    assert dev.stop() == []  # already stopped: nothing of dagster dev is left running


RUN_TIMES = """query($id: ID!) { runOrError(runId: $id) { __typename
  ... on Run { status startTime endTime } } }"""
RELOAD = """mutation { reloadRepositoryLocation(repositoryLocationName: "pid_platform") { __typename } }"""
BLEND = {"sources": {"photos": {"weight": 1.0}}, "samples_per_epoch": 50}
EDITED = {"sources": {"photos": {"weight": 1.0}}, "samples_per_epoch": 120}


def _launch_reshard(dev: DagsterDev, shard_size: int) -> str:
    """A ``source_build`` run of photos from the launchpad's pre-filled config, ``shard_size`` set."""
    schema = dev.graphql(PREFILLED, {"selector": {**LOCATION, "pipelineName": "source_build"}})
    schema = schema["runConfigSchemaOrError"]
    assert schema["__typename"] == "RunConfigSchema", schema
    config = yaml.safe_load(schema["rootDefaultYaml"])
    sharding = config["resources"]["sharding"]["config"]
    assert not {"max_shard_size_mb", "shard_size", "seed"} & set(sharding)  # nothing to restate
    sharding["shard_size"] = shard_size
    params = {"selector": {**LOCATION, "jobName": "source_build"}, "runConfigData": config,
              "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "photos"}]}}
    launched = dev.graphql(LAUNCH, {"params": params})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def test_two_launches_of_one_source_build_one_at_a_time_and_a_datasets_edit_reaches_the_catalog(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two findings of the operator's second day, end to end in the UI: two launchpad re-shards of
    one source 2 s apart used to run at once in one staging folder and break each other (now the
    second waits in the queue until the first has ended, and the UI shows it queued); an edit of
    ``datasets.yaml`` changed ``datasets/blend`` but not ``catalog.json``, which the loader reads
    (now the reload plus the automation sensor's next run write it)."""
    from loader.formats.catalog import read_catalog
    from loader.mixture import Mixture

    home = demo.prepare_home(tmp_path / "home")
    definitions = tmp_path / "datasets.yaml"
    definitions.write_text(yaml.safe_dump({"blend": BLEND}))
    env = {"PID_RAW_ROOT": str(tmp_path / "raw"), "PID_OUTPUT_ROOT": str(tmp_path / "out"),
           "PID_LEROBOT_ROOT": str(tmp_path / "lerobot"), "PID_DATASETS": str(definitions)}
    for name in ("PID_RAW_ROOT", "PID_OUTPUT_ROOT", "PID_LEROBOT_ROOT"):
        Path(env[name]).mkdir()
    source = make_sample_source(tmp_path / "raw" / "photos", photos=("coffee", "astronaut", "chelsea"),
                                ratios=((3, 4),), with_problems=False)
    use_roots(monkeypatch, tmp_path / "raw", tmp_path / "out")
    monkeypatch.setenv("PID_DATASETS", str(definitions))
    with dg.instance_for_test(), dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("sources", ["photos"])
        instance.add_dynamic_partitions("lerobot_datasets", [demo.LEROBOT_DATASET])
        defs = load_defs()
        assert build_source(defs, instance, "photos").success
        assert build_catalog(defs, instance).success
    out_root = tmp_path / "out"
    assert read_catalog(out_root).mixture("blend") == Mixture.from_json("blend", BLEND)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    log = tmp_path / "dagster-dev.log"

    with DagsterDev(home, env, log) as dev, \
            headless_chromium(tmp_path / "chromium-profile", tmp_path / "chromedriver.log") as browser:
        browser.get("about:blank")
        first = _launch_reshard(dev, 2)
        time.sleep(2)
        second = _launch_reshard(dev, 3)
        # While the first works, the second waits in the queue; the runs page shows both.
        deadline, seen_queued = time.monotonic() + 120, False
        while time.monotonic() < deadline:
            a = dev.graphql(RUN_TIMES, {"id": first})["runOrError"]["status"]
            b = dev.graphql(RUN_TIMES, {"id": second})["runOrError"]["status"]
            assert not (a == "STARTED" and b == "STARTED"), "two builds of photos ran at once"
            if a == "STARTED" and b == "QUEUED":
                seen_queued = True
                _snap(browser, f"{dev.url}/runs/{second}", ["Queued", "Run queued"],
                      "queued second run", shots, "second-launch-queued.png")
                _snap(browser, f"{dev.url}/runs", ["Queued"],
                      "runs page with the queued launch", shots, "runs-one-build-at-a-time.png")
                browser.get("about:blank")
                break
            if a in ("SUCCESS", "FAILURE", "CANCELED"):
                break
            time.sleep(0.5)
        assert seen_queued, "the second launch of photos was never seen queued behind the first"
        _wait_for_run(dev, first, log, 400)
        _wait_for_run(dev, second, log, 400)
        times = {r: dev.graphql(RUN_TIMES, {"id": r})["runOrError"] for r in (first, second)}
        assert times[second]["startTime"] >= times[first]["endTime"], times  # one build at a time
        _snap(browser, f"{dev.url}/runs/{second}", ["source_build", "Success"],
              "second run page", shots, "second-launch-done.png")
        # The last committed launch's setting is the source's: each build committed its own.
        assert _built_with(out_root / "photos")["shard_size"] == 3
        assert yaml.safe_load((source / SETTINGS_NAME).read_text())["shard_size"] == 3

        # Edit datasets.yaml, reload the code location (the UI's Reload button), and the
        # automation sensor's next run writes catalog.json.
        before = _automation_runs(dev)
        definitions.write_text(yaml.safe_dump({"blend": EDITED}))
        assert dev.graphql(RELOAD)["reloadRepositoryLocation"]["__typename"] == "WorkspaceLocationEntry"
        browser.get("about:blank")
        deadline = time.monotonic() + 240
        while read_catalog(out_root).mixture("blend") != Mixture.from_json("blend", EDITED):
            assert time.monotonic() < deadline, f"catalog.json never got the edit: {log.read_text()[-3000:]}"
            time.sleep(3)
        _snap(browser, f"{dev.url}/assets/dataset_catalog", ["dataset_catalog", "pid_platform"],
              "catalog after the edit", shots, "catalog-after-datasets-edit.png")
        _snap(browser, f"{dev.url}/assets/datasets/blend", ["blend", "pid_platform"],
              "dataset after the edit", shots, "dataset-blend-after-edit.png")
        assert _automation_runs(dev) - before, "catalog.json was written by no automation run"
    for shot in ("second-launch-queued.png", "second-launch-done.png", "catalog-after-datasets-edit.png"):
        assert (shots / shot).stat().st_size > 10_000
    assert dev.stop() == []
