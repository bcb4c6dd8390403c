"""The s3 tasked build (``pid-shard plan | task --index I --of N | commit``) adds a modality folder
as the one-process s3 build does (issue 18 part 10): the plan, every write task and the commit
each run in a work folder of their own (nothing shared but the bucket and the source), and no
image or caption tar is uploaded or copied; the version published is the one-process build's,
its id, its pointer (``uses``) and its bytes included.

The stages run in this process (``shard_main``, each with its own ``--work-dir``) so that the
``S3Requests`` recorder counts every request they make.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pid_platform.cli import shard_main
from tests.conftest import SOURCE
from tests.support.build_data import SMALL_BOUND_MB, build
from tests.support.s3_objects import S3Requests, keys, objects, pointer
from tests.test_add_modality import NEW, items, without_new  # noqa: F401 (the fixture)

HOUSEKEEPING = (".write-probe-", ".pid-claims", ".pid-build")  # the probe, claims, lease and staging


def test_the_s3_tasked_build_adds_a_modality_sending_only_its_tars(
    s3_env, raw_root: Path, without_new: Path, tmp_path: Path,  # noqa: F811
) -> None:
    client = s3_env.client()
    bucket = s3_env.make_bucket("addmod-tasks")
    url, ref_url = f"s3://{bucket}/photos", f"s3://{bucket}/reference"
    src = ["--input-dir", str(raw_root / SOURCE)]
    settings = ["--max-shard-size-mb", str(SMALL_BOUND_MB), "--num-workers", "1"]
    machines = iter(range(1000))

    def work() -> list[str]:  # a machine of its own: a fresh work folder each stage
        return ["--work-dir", str(tmp_path / "machines" / f"m{next(machines)}")]

    def tasked_build() -> None:
        assert shard_main(["plan", *src, "--output-dir", url, *settings, *work()]) == 0
        for i in range(3):
            assert shard_main(["task", "--index", str(i), "--of", "3", *src, "--output-dir", url, "--num-workers",
                               "1", *work()]) == 0
        assert shard_main(["commit", "--output-dir", url, *work()]) == 0

    def one_process() -> None:
        assert shard_main([*src, "--output-dir", ref_url, *settings, "--work-dir", str(tmp_path / "one")]) == 0

    tasked_build()
    one_process()
    v1 = pointer(client, bucket, "photos")["version"]
    assert v1 == pointer(client, bucket, "reference")["version"]
    v1_objects = objects(client, bucket, f"photos/versions/{v1}")
    assert any("/image/" in k for k in v1_objects) and ".pid-build/plan.parquet" in v1_objects

    shutil.move(without_new, raw_root / SOURCE / NEW)
    with S3Requests() as requests:
        tasked_build()
    writes = requests.writes()
    # No image or caption tar was uploaded or copied: only the new modality's tars, key indexes,
    # manifests, settings (and the staging, the claim, the lease and the pointer).
    assert [w for w in writes if "/image/" in w[1] or "/caption/" in w[1]] == []
    sent_tars = sorted(k for _, k in writes if k.endswith(".tar"))
    assert sent_tars and all(f"/{NEW}/" in k and k.startswith(f"photos/versions/{v1}/") for k in sent_tars)
    # The only copies inside the bucket: the commit carrying the staged state into the version.
    assert [k for op, k in writes if op == "CopyObject" and "/.pid-build/" not in k] == []

    p2 = pointer(client, bucket, "photos")
    assert p2["version"] != v1 and p2["uses"] == [v1] and v1 not in p2.get("retired", {})
    v2_objects = objects(client, bucket, f"photos/versions/{p2['version']}")
    assert v2_objects and not any(k.endswith(".tar") for k in v2_objects)
    after_v1 = objects(client, bucket, f"photos/versions/{v1}")
    assert {k: b for k, b in after_v1.items() if k in v1_objects} == v1_objects  # nothing there replaced

    # The one-process build adding the same folder publishes the same version, byte for byte.
    one_process()
    ref = pointer(client, bucket, "reference")
    assert (ref["version"], ref["uses"], ref["manifests"]) == (p2["version"], p2["uses"], p2["manifests"])
    assert objects(client, bucket, f"reference/versions/{ref['version']}") == v2_objects
    assert objects(client, bucket, f"reference/versions/{v1}") == after_v1

    # The loader reads all three modalities by the prefix; the items equal a local build's from scratch.
    scratch = build(raw_root, tmp_path / "scratch")
    mods = ["caption", "image", NEW]
    got = items(url, mods)
    assert len(got) == 32 and got == items(str(scratch.out), mods)
    assert items(url, mods, mode="index") == got
    assert not [k for k in keys(client, bucket, "photos") if k.startswith(".pid-build/staged")]

    # Built again by tasks, unchanged: already served, nothing sent, the same pointer.
    with S3Requests() as requests:
        tasked_build()
    writes = requests.writes()
    assert [w for w in writes if not w[1].split("/")[1].startswith(HOUSEKEEPING)] == []
    assert pointer(client, bucket, "photos") == p2
