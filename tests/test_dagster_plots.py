"""The PNG plots in materialization metadata: real PNGs, embedded as Markdown data URIs, with
the numbers they draw checked against the build (the PNGs are saved under the test's folder)."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import dagster as dg
import pytest
from PIL import Image

from pid_platform.defs.latest import latest_materialization
from pid_platform.demo import pid_demo as demo
from pid_platform.demo.sample_data import make_sample_source

DATA_URI = re.compile(r"^!\[[^\]]+\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)$")
DATASET = demo.LEROBOT_DATASET


def _png(value: dg.MetadataValue, save_as: Path) -> Image.Image:
    assert isinstance(value, dg.MarkdownMetadataValue)
    match = DATA_URI.match(value.md_str)
    assert match, value.md_str[:80]
    data = base64.b64decode(match.group(1))
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) < 120_000
    save_as.write_bytes(data)
    image = Image.open(io.BytesIO(data))
    assert image.size == (576, 288)  # 6.4 x 3.2 in at 90 dpi
    return image


def _latest(instance: dg.DagsterInstance, asset: str, partition: str) -> dict:
    return dict(latest_materialization(instance, asset, partition).asset_materialization.metadata)


def test_plots_of_a_source_and_a_lerobot_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DAGSTER_HOME", "PID_RAW_ROOT", "PID_OUTPUT_ROOT", "PID_LEROBOT_ROOT"):
        monkeypatch.setenv(name, "unset-by-test")
    monkeypatch.delenv("PID_LEROBOT_PUBLISH", raising=False)
    make_sample_source(tmp_path / "demo" / "raw" / "photos", photos=("astronaut", "chelsea"),
                       ratios=((1, 1), (16, 9), (3, 4)), with_problems=True)
    demo.ensure_sample_lerobot(tmp_path / "demo" / "lerobot", episode_lengths=(6, 9, 4), episodes_per_file=2,
                               size=(64, 48))
    assert demo.main(["--root", str(tmp_path), "--workers", "1"]) == 0
    plots = tmp_path / "plots"
    plots.mkdir()
    with dg.DagsterInstance.from_config(str(tmp_path / ".dagster_home")) as instance:
        intake = _latest(instance, "sample_set", "photos")
        _png(intake["aspect_ratio_histogram"], plots / "aspect_ratios.png")
        _png(intake["dropped_by_reason_plot"], plots / "dropped.png")
        shards = _latest(instance, "twin_tar_shards", "photos")
        _png(shards["shard_sizes_plot"], plots / "shard_sizes.png")
        sidecar = _latest(instance, "mp4_sidecar", DATASET)
        _png(sidecar["episode_lengths_plot"], plots / "episode_lengths.png")
        _png(sidecar["episode_bytes_plot"], plots / "episode_bytes.png")


def test_episode_bytes_add_up_to_the_video_samples(tmp_path: Path) -> None:
    from loader.lerobot.meta import LeRobotMeta
    from loader.lerobot.sidecar import build_sidecar, read_sidecar
    from pid_platform.defs.lerobot.assets import episode_stats

    demo.ensure_sample_lerobot(tmp_path, episode_lengths=(6, 9, 4), episodes_per_file=2, size=(64, 48))
    meta = LeRobotMeta.load(str(tmp_path / DATASET))
    out = tmp_path / "sidecar.npz"
    build_sidecar(meta, out, repo_id="local/x", revision=None, data_root=str(tmp_path / DATASET), workers=1)
    with read_sidecar(out) as sc:
        lengths, per_camera = episode_stats(meta, sc)
        samples = {f["path"]: f["sample_count"] for f in sc.manifest["files"]}
        total = sum(int(sc.arrays(rel)["sample_sizes"].sum()) for rel in samples)
    assert lengths == {"0": 6, "1": 9, "2": 4}
    assert sorted(per_camera) == sorted(meta.video_keys) and len(per_camera) == 2
    # Every sample of every MP4 belongs to exactly one episode: nothing counted twice or lost.
    assert sum(sum(v.values()) for v in per_camera.values()) == total
    assert all(b > 0 for v in per_camera.values() for b in v.values())


def test_shard_sizes_plot_has_one_colour_per_bucket_in_mib(tmp_path: Path) -> None:
    from matplotlib.colors import to_hex

    from pid_platform.defs.plots import shard_sizes_figure, shard_sizes_png

    labels = ["3:4", "3:4", "1:1", "16:9", "16:9", "16:9"]
    sizes = [0.2, 0.25, 0.1, 0.24, 0.05, 0.3]
    fig = shard_sizes_figure(sizes, labels, 0.25, title="photos: shard sizes")
    ax = fig.axes[0]
    bars = [to_hex(p.get_facecolor()) for p in ax.patches]
    legend = ax.get_legend()
    entries = {t.get_text(): to_hex(h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles,
                                                                         strict=True)}
    assert list(entries) == ["3:4", "1:1", "16:9"] and len(set(entries.values())) == 3  # one colour per bucket
    assert bars == [entries[b] for b in labels]  # and each bar has its bucket's colour
    assert "MiB" in ax.get_ylabel() and "MB" not in ax.get_ylabel().replace("MiB", "")
    assert any(t.get_text() == "bound 0.25 MiB" for t in ax.texts)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["3:4", "1:1", "16:9"]  # each bucket named once
    png = shard_sizes_png(sizes, labels, 0.25, title="photos: shard sizes")
    (tmp_path / "shard_sizes.png").write_bytes(png)
    assert Image.open(io.BytesIO(png)).size == (576, 288)
