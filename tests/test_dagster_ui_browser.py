"""The Dagster UI in a real browser: ``dagster dev -w workspace.yaml`` with the project's
instance config, the asset graph opened in headless Chromium, every asset, the partitions and
the checks shown, a materialization launched through the webserver's GraphQL API and watched to
success, and a screenshot of the graph saved under the test's folder."""

from __future__ import annotations

import time
import urllib.parse
from pathlib import Path

import dagster as dg
import pytest

from pid_platform import demo
from tests.support.browser import CHROMEDRIVER, CHROMIUM, headless_chromium, wait_for_text
from tests.support.dagster_dev import DagsterDev

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


def _shown(browser, texts: list[str], what: str, shots: Path) -> None:
    missing = wait_for_text(browser, texts)
    if missing:
        browser.save_screenshot(str(shots / f"missing-{what.replace(' ', '-')}.png"))
    assert missing == [], f"{what}: not shown: {missing} (screenshot in {shots})"


def test_asset_graph_partitions_checks_and_a_launched_run(tmp_path: Path) -> None:
    home = demo.prepare_home(tmp_path / "home")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("sources", SOURCES)
        instance.add_dynamic_partitions("lerobot_datasets", [demo.LEROBOT_DATASET])
    # Empty roots: the discovery sensors (on by default) find nothing to start on their own.
    env = {"PID_RAW_ROOT": str(tmp_path / "raw"), "PID_OUTPUT_ROOT": str(tmp_path / "out"),
           "PID_LEROBOT_ROOT": str(tmp_path / "lerobot")}
    for folder in env.values():
        Path(folder).mkdir()
    shots = tmp_path / "screenshots"
    shots.mkdir()

    with DagsterDev(home, env, tmp_path / "dagster-dev.log") as dev, \
            headless_chromium(tmp_path / "chromium-profile", tmp_path / "chromedriver.log") as browser:
        # The graph draws long names shortened at this zoom ("published..._sidecar"); the catalog
        # lists each in full.
        browser.get(f"{dev.url}{GRAPH}")
        _shown(browser, ["webdataset_build", "lerobot", "catalog", *ASSETS[:-1]], "asset graph", shots)
        browser.save_screenshot(str(shots / "asset-graph.png"))
        browser.get(f"{dev.url}/assets")
        _shown(browser, ASSETS, "asset catalog", shots)

        browser.get(f"{dev.url}/assets/sample_set?view=partitions")
        _shown(browser, SOURCES, "source partitions", shots)
        browser.get(f"{dev.url}/assets/mp4_sidecar?view=partitions")
        _shown(browser, [demo.LEROBOT_DATASET], "dataset partitions", shots)
        browser.get(f"{dev.url}/assets/twin_tar_shards?view=checks")
        _shown(browser, ["twin_tar_keys_match", "shards_within_size_bound"], "checks", shots)

        selector = {"repositoryLocationName": "pid_platform", "repositoryName": "__repository__",
                    "jobName": "catalog_build"}
        launched = dev.graphql(LAUNCH, {"params": {"selector": selector, "runConfigData": {}}})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            status = dev.graphql(STATUS, {"id": run_id})["runOrError"]["status"]
            if status in ("SUCCESS", "FAILURE", "CANCELED"):
                break
            time.sleep(1)
        assert status == "SUCCESS", (status, (tmp_path / "dagster-dev.log").read_text()[-3000:])

        browser.get(f"{dev.url}/runs/{run_id}")
        _shown(browser, ["catalog_build", "Success"], "run page", shots)
        browser.get(f"{dev.url}{GRAPH}")
        _shown(browser, ASSETS[:-1], "asset graph after the run", shots)
        time.sleep(2)  # let the graph settle its layout and the catalog's new state
        browser.save_screenshot(str(shots / "asset-graph-after-run.png"))
    assert (shots / "asset-graph-after-run.png").stat().st_size > 10_000
    assert dev.stop() == []  # already stopped: nothing of dagster dev is left running
