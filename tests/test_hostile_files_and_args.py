"""Hostile settings files, console-script arguments and inputs that escape (listed in
``tests/test_hostile_inputs.py``).

Time bounds are generous (a loaded 2-core machine): reading is measured at milliseconds, the
tests allow seconds; the point is "ends", not "is fast" (speed lives in bench/).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import tracemalloc
from pathlib import Path

import pytest

from loader.formats.catalog import parse_catalog, read_catalog
from loader.formats.errors import FormatError
from loader.lerobot.meta import LeRobotMeta, LeRobotMetaError
from loader.lerobot.streaming import StreamingLeRobotDataset
from loader.wds.errors import ShardReadError
from loader.wds.pipeline import build_dataset, make_loader
from pid_platform.cli import rewrite_roots_main, shard_main
from pid_platform.demo import pid_demo as demo
from pid_platform.lerobot import cli as sidecar_cli
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.settings import SETTINGS_NAME, parse_settings, source_settings
from pid_platform.sharding.storage import LocalSourceStore, S3SourceStore
from tests.support.build_data import SOURCE, build
from tests.support.loader_data import caption_bytes, jpeg_bytes, write_hand_shards

TIME_BUDGET_S = 5.0  # measured: every case below reads in < 10 ms
MEMORY_BUDGET = 32 * 1024 * 1024

# --------------------------------------------------------------------------- sharding.yaml

_LAUGHS = b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + b"".join(
    b"%c: &%c [*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c]\n" % ((ord("a") + i + 1,) * 2 + (ord("a") + i,) * 9)
    for i in range(9))

# case -> (file content, what the message must name besides the file)
HOSTILE_SETTINGS: dict[str, tuple[bytes, str]] = {
    "billion laughs (aliases)": (_LAUGHS, "unknown settings"),
    "alias as a value": (b"seed: &a 5\nshard_size: *a\n", "anchor"),
    "nesting 60000 deep": (b"seed: " + b"[" * 60000, "seed"),
    "nested mapping": (b"seed:\n  a:\n    b: 1\n", "seed"),
    "larger than any settings file": (b"seed: 1\n" + b"#" * (1 << 20), "larger than"),
    "a number of 60000 digits": (b"seed: " + b"9" * 60000, "seed"),
    "shard_size past a count": (b"shard_size: 99999999999999999999", "shard_size"),
    "seed past 64 bits": (b"seed: 18446744073709551616", "seed"),
    "part_size past a count": (b"part_size: 4294967296", "part_size"),
    "max_shard_size_mb 1e999": (b"max_shard_size_mb: 1e999", "max_shard_size_mb"),
    "max_shard_size_mb .nan": (b"max_shard_size_mb: .nan", "max_shard_size_mb"),
    "max_shard_size_mb past 1 TiB": (b"max_shard_size_mb: 1e12", "max_shard_size_mb"),
    "max_shard_size_mb 1e-9": (b"max_shard_size_mb: 1e-9", "max_shard_size_mb"),
    "yes as a boolean": (b"shuffle: yes", "shuffle"),
    "on as a boolean": (b"classify_aspect_ratio: on", "classify_aspect_ratio"),
    "NO as a boolean": (b"shuffle: NO", "shuffle"),
    "010 as octal": (b"part_size: 010", "part_size"),
    "0x10 as hex": (b"seed: 0x10", "seed"),
    "1_000": (b"part_size: 1_000", "part_size"),
    "1:20 as base 60": (b"seed: 1:20", "seed"),
    "a key written twice": (b"seed: 1\nseed: 2\n", "seed is written twice"),
    "a string for a boolean": (b"shuffle: 'true'", "shuffle"),
    "a megabyte-free long string": (b"shuffle: " + b"x" * 60000, "shuffle"),
    "a list for a number": (b"seed: [1, 2]", "seed"),
    "a number for a boolean": (b"shuffle: 1", "shuffle"),
    "true for a number": (b"max_shard_size_mb: true", "max_shard_size_mb"),
    "no value": (b"seed:", "seed"),
    "python tag": (b"seed: !!python/object/apply:os.system ['true']", "seed"),
    "an explicit tag": (b"seed: !!int 5", "seed"),
    "two documents": (b"seed: 1\n---\nseed: 2\n", "more than one YAML document"),
    "bad UTF-8": (b"seed: 1 # caf\xe9\n", "UTF-8"),
    "UTF-16": ("seed: 1\n".encode("utf-16"), "UTF-8"),
    "a NUL byte": (b"seed: 1\x00\n", "not valid YAML"),
    "a list document": (b"- seed\n- 1\n", "mapping of settings"),
    "a complex key": (b"? [a]\n: 1\n", "key"),
    "a merge key": (b"<<: {seed: 1}\n", "<<"),
    "unbalanced flow": (b"seed: [1, 2\n", "seed"),
}


def _settings_of(raw: Path, data: bytes | None = None):
    if data is not None:
        (raw / SOURCE / SETTINGS_NAME).write_bytes(data)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        return source_settings(LocalSourceStore(raw), SOURCE, ShardingConfig())
    finally:
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert took < TIME_BUDGET_S and peak < MEMORY_BUDGET, (took, peak)


@pytest.mark.parametrize("case", sorted(HOSTILE_SETTINGS))
def test_a_hostile_settings_file_ends_quickly_in_a_named_error(raw_root: Path, case: str) -> None:
    data, names = HOSTILE_SETTINGS[case]
    with pytest.raises(ShardingConfigError) as exc:
        _settings_of(raw_root, data)
    message = str(exc.value)
    assert str(raw_root / SOURCE / SETTINGS_NAME) in message and names in message
    assert len(message) < 600 and "\n" not in message.split("(", 1)[0]  # never the value itself, whole


def test_a_settings_file_that_is_huge_pipe_or_folder_is_never_read_whole(raw_root: Path) -> None:
    target = raw_root / SOURCE / SETTINGS_NAME
    with open(target, "wb") as fh:
        fh.truncate(10 * 1024**3)  # 10 GiB, sparse: only the first 64 KiB + 1 are read
    with pytest.raises(ShardingConfigError, match="larger than"):
        _settings_of(raw_root)
    target.unlink()
    os.mkfifo(target)  # no writer: an open without O_NONBLOCK would hang every sensor tick
    with pytest.raises(Exception, match="not a regular file"):
        _settings_of(raw_root)
    target.unlink()
    target.mkdir()
    with pytest.raises(Exception, match="not a regular file"):
        _settings_of(raw_root)


def test_a_settings_object_in_s3_is_read_only_as_far_as_the_cap(s3_env) -> None:
    client = s3_env.client()
    s3_env.make_bucket("hostile-settings")
    for source, body in (("huge", b"seed: 1\n" + b"#" * (8 << 20)), ("empty", b""), ("laughs", _LAUGHS)):
        client.put_object(Bucket="hostile-settings", Key=f"raw/{source}/image/a.jpg", Body=b"x")
        client.put_object(Bucket="hostile-settings", Key=f"raw/{source}/{SETTINGS_NAME}", Body=body)
    store = S3SourceStore("s3://hostile-settings/raw")
    with pytest.raises(ShardingConfigError, match=r"s3://hostile-settings/raw/huge/sharding\.yaml: larger than"):
        source_settings(store, "huge", ShardingConfig())
    assert source_settings(store, "empty", ShardingConfig()).config == ShardingConfig()  # no Range on 0 bytes
    with pytest.raises(ShardingConfigError, match=r"laughs/sharding\.yaml: unknown settings \['a'\]"):
        source_settings(store, "laughs", ShardingConfig())


@pytest.mark.parametrize(("text", "want"), [
    (b"\xef\xbb\xbfshuffle: false\n", {"shuffle": False}),  # a BOM
    (b'"seed": 3\n# a comment\n', {"seed": 3}),
    (b"max_shard_size_mb: 0.25\nseed: -5\nshuffle: True\n", {"max_shard_size_mb": 0.25, "seed": -5, "shuffle": True}),
    (b"---\n", {}), (b"", {}), (b"max_shard_size_mb: 64\n...\n", {"max_shard_size_mb": 64}),
])
def test_plain_settings_files_still_read(text: bytes, want: dict) -> None:
    assert parse_settings(text, "s.yaml") == want


@pytest.mark.parametrize(("field", "value"), [
    ("shard_size", 2**31), ("part_size", 2**40), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("max_shard_size_mb", 2.0**21), ("max_shard_size_mb", 1e-9), ("shard_size", 10**200),
])
def test_sharding_config_refuses_bounds_that_overflow_later(field: str, value) -> None:
    with pytest.raises(ShardingConfigError, match=rf"sharding setting {field}=") as exc:
        ShardingConfig(**{field: value})
    assert len(str(exc.value)) < 300


# --------------------------------------------------------------------------- JSON others wrote

# case -> (the hostile value, put where a number goes, or a whole document; what the error says)
HOSTILE_JSON = {
    "NaN": (b"NaN", "NaN is not a JSON number"),
    "Infinity": (b"-Infinity", "-Infinity is not a JSON number"),
    "1e999": (b"1e999", "out of the range"),
    "nesting 100000 deep": (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "a number of 5000 digits": (b"9" * 5000, "5000 digits"),
    "a key written twice": (None, "written twice"),
    "bad UTF-8": (None, "not UTF-8"),
}


def _json_doc(case: str, valid: bytes, twice: bytes) -> bytes:
    value, _ = HOSTILE_JSON[case]
    if case == "a key written twice":
        return twice
    if case == "bad UTF-8":
        return valid.replace(b"7", b'"caf\xe9"'.decode("unicode_escape").encode("latin1"))
    return valid.replace(b"7", value)


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_a_hostile_catalog_is_a_format_error(tmp_path: Path, case: str) -> None:
    valid = b'{"format_version": 1, "sources": {"photos": {"manifests": [], "total_key_count": 7}}}'
    twice = b'{"sources": {"photos": {"manifests": []}}, "sources": {"other": {"manifests": []}}}'
    (tmp_path / "catalog.json").write_bytes(_json_doc(case, valid, twice))
    start = time.perf_counter()
    with pytest.raises(FormatError, match=r"catalog\.json") as exc:
        read_catalog(tmp_path)
    assert time.perf_counter() - start < TIME_BUDGET_S
    assert HOSTILE_JSON[case][1] in str(exc.value)


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_a_hostile_lerobot_info_json_is_a_meta_error(tmp_path: Path, case: str) -> None:
    valid = b'{"codebase_version": "v3.0", "fps": 7, "features": {}}'
    twice = b'{"codebase_version": "v2.1", "codebase_version": "v3.0", "fps": 30, "features": {}}'
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "info.json").write_bytes(_json_doc(case, valid, twice))
    with pytest.raises(LeRobotMetaError, match=r"info\.json") as exc:
        LeRobotMeta.load(tmp_path)
    assert HOSTILE_JSON[case][1] in str(exc.value)


@pytest.mark.parametrize("fps", [1e300, 10**30, "3" * 100000, -30, 29.97])
def test_an_info_json_fps_out_of_range_is_named_and_cut_short(tmp_path: Path, fps) -> None:
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "info.json").write_text(json.dumps({"codebase_version": "v3.0", "fps": fps, "features": {}}))
    with pytest.raises(LeRobotMetaError, match="fps must be a positive integer") as exc:
        LeRobotMeta.load(tmp_path)
    assert len(str(exc.value)) < 400


# --------------------------------------------------------------------------- catalog entries

@pytest.mark.parametrize("entry", [
    "../elsewhere/wdinfo.json", "a/../../wdinfo.json", "/etc/wdinfo.json", "file:///etc/wdinfo.json",
    "http://evil.example/wdinfo.json", "s3://other-bucket/wdinfo.json", "a\\..\\..\\wdinfo.json", "", 7,
])
def test_a_catalog_entry_that_leaves_the_catalog_is_refused(tmp_path: Path, entry) -> None:
    doc = {"format_version": 1, "sources": {"photos": {"manifests": ["photos/wdinfo.json", entry]}},
           "datasets": {"all": ["photos"]}}
    (tmp_path / "catalog.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"sources\['photos'\]\.manifests\[1\]"):
        read_catalog(tmp_path)
    with pytest.raises(FormatError, match="manifests"):  # the same for a catalog read from a URL
        parse_catalog(json.dumps(doc).encode(), "s3://bucket/out/catalog.json")
    with pytest.raises(Exception, match="manifests"):
        build_dataset("all", catalog=str(tmp_path))


# --------------------------------------------------------------------------- keys of foreign tars


def _tar_with_key(folder: Path, name: str) -> Path:
    keys = [name.split(".jpg")[0], "ok"]
    return write_hand_shards(folder, [{"image": [(f"{k}.jpg", jpeg_bytes(i)) for i, k in enumerate(keys)],
                                       "caption": [(f"{k}.json", caption_bytes(k)) for k in keys]}],
                             index_keys=[keys])


@pytest.mark.parametrize("mode", ["zip", "index"])
@pytest.mark.parametrize("key", ["../x", "/abs", "a/../../x"])
def test_a_path_as_a_key_is_refused_under_format_1(tmp_path: Path, mode: str, key: str) -> None:
    _tar_with_key(tmp_path / "ds", f"{key}.jpg")
    with pytest.raises(ShardReadError, match="format_version 1"):
        list(build_dataset(str(tmp_path / "ds"), mode=mode, decode=None, shuffle=False))
    loader = make_loader(build_dataset(str(tmp_path / "ds"), mode=mode, decode=None, shuffle=False,
                                       shard_error_policy="skip"))
    list(loader)
    assert loader.stats["shard_errors"] == 1


def test_a_path_as_a_key_of_a_pid_written_tar_is_counted(tmp_path: Path) -> None:
    manifest = _tar_with_key(tmp_path / "ds", "/abs.jpg")
    doc = json.loads(manifest.read_text())
    del doc["format_version"]  # PiD's manifests have none: its keys are read as PiD reads them
    manifest.write_text(json.dumps(doc))
    loader = make_loader(build_dataset(str(tmp_path / "ds"), decode=None, shuffle=False))
    assert [s["__key__"] for s in loader] == ["/abs", "ok"]
    assert loader.stats["escaping_keys"] == 1


# --------------------------------------------------------------------------- streaming options


@pytest.mark.parametrize(("kwargs", "option"), [
    ({"episodes": [0, 1.5]}, r"episodes\[1\]"), ({"episodes": [True]}, r"episodes\[0\]"),
    ({"episodes": ["0"]}, r"episodes\[0\]"), ({"episodes": [-1]}, r"episodes\[0\]"),
    ({"episodes": "01"}, "episodes must be a list"), ({"episodes": 3}, "episodes must be a list"),
    ({"delta_timestamps": {"action": [0.0, math.nan]}}, r"delta_timestamps\['action'\]\[1\]"),
    ({"delta_timestamps": {"action": [math.inf]}}, r"delta_timestamps\['action'\]\[0\]"),
    ({"delta_timestamps": {"action": [1e300]}}, r"delta_timestamps\['action'\]\[0\]"),
    ({"delta_timestamps": {"action": [True]}}, r"delta_timestamps\['action'\]\[0\]"),
    ({"delta_timestamps": {"action": 0.1}}, r"delta_timestamps\['action'\] must be a list"),
    ({"delta_timestamps": [0.1]}, "delta_timestamps must map"),
])
def test_streaming_selection_options_are_checked_before_anything_is_read(tmp_path: Path, kwargs, option) -> None:
    with pytest.raises(ValueError, match=option):
        StreamingLeRobotDataset("o/d", root=str(tmp_path / "no-dataset-here"), **kwargs)


# --------------------------------------------------------------------------- console scripts

SHA = "0123456789abcdef0123456789abcdef01234567"
NINES = "<5000 nines>"  # put in by the tests: a test id of 5000 characters helps nobody


def _big(args: list[str]) -> list[str]:
    return [a.replace(NINES, "9" * 5000) for a in args]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _usage_error(capsys, call) -> str:
    """Run ``call`` (a console script's main); it must exit 2 with one error line, no traceback."""
    try:
        code = call()
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def sidecar_args(tmp_path: Path):
    def make(**over: str) -> list[str]:
        args = {"--repo-id": "owner/data", "--revision": SHA, "--data-root": str(tmp_path),
                "--output": str(tmp_path / "sc.npz")} | over
        return [x for kv in args.items() for x in kv]
    return make


@pytest.mark.parametrize(("over", "says"), [
    ({"--repo-id": "data"}, "--repo-id"), ({"--repo-id": "../data"}, "--repo-id"),
    ({"--repo-id": "a/b/c"}, "--repo-id"), ({"--revision": "../../x"}, "--revision"),
    ({"--revision": "/abs"}, "--revision"), ({"--data-root": "ftp://host/x"}, "unsupported dataset root"),
    ({"--data-root": "s3://key:secret@bucket/x"}, "user info"), ({"--data-root": "https://u:p@host/x"}, "user info"),
    ({"--data-root": "hf://datasets/only-one-part"}, "--data-root"), ({"--output": "s3://bucket/sc.npz"}, "URL"),
    ({"--output": "."}, "is a folder"), ({"--workers": "0"}, "--workers"), ({"--workers": NINES}, "--workers"),
    ({"--episodes": "1.5"}, "--episodes"), ({"--s3-endpoint-url": "not a url"}, "endpoint"),
    ({"--hub-endpoint": "https://u:p@hub"}, "credentials"), ({"--max-retries": "-1"}, "--max-retries"),
])
def test_pid_build_mp4_sidecar_refuses_bad_arguments_in_one_line(tmp_path, sidecar_args, capsys, monkeypatch,
                                                                   over, says) -> None:
    monkeypatch.chdir(tmp_path)
    line = _usage_error(capsys, lambda: sidecar_cli.main(_big(sidecar_args(**over))))
    assert line.startswith("pid-build-mp4-sidecar: error:") and says in line and len(line) < 400
    assert not (tmp_path / "s3:").exists()


def test_pid_build_mp4_sidecar_refuses_episodes_the_dataset_lacks(tmp_path, lerobot_v3_root, capsys) -> None:
    args = ["--repo-id", "owner/data", "--revision", SHA, "--data-root", str(lerobot_v3_root),
            "--output", str(tmp_path / "sc.npz"), "--episodes", "0", "99"]
    line = _usage_error(capsys, lambda: sidecar_cli.main(args))
    assert "--episodes [99]: no such episode" in line
    assert not (tmp_path / "sc.npz").exists()


def test_a_refused_connection_fails_within_the_configured_retries(tmp_path: Path, capsys) -> None:
    port = _closed_port()
    args = ["--repo-id", "owner/data", "--revision", SHA, "--data-root", f"http://127.0.0.1:{port}/ds",
            "--output", str(tmp_path / "sc.npz")]
    start = time.perf_counter()
    assert sidecar_cli.main(args) == 1
    took = time.perf_counter() - start
    err = capsys.readouterr().err
    assert "after 3 retries" in err and "Traceback" not in err
    assert took < 20, took  # 3 jittered back-offs (<= 2.1 s); the old defaults spent about 35 s


@pytest.mark.parametrize(("argv", "says"), [
    (["--manifest-root", "ftp://host/x"], "manifest root"),
    (["--manifest-root", "file:///x"], "manifest root"),
    (["--work-dir", "s3://bucket/work"], "URL"),
    (["--s3-endpoint-url", "ftp://x"], "endpoint"),
    (["--seed", NINES], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--num-workers", "99999999999"], "--num-workers"),
    (["--max-shard-size-mb", NINES + "x"], "--max-shard-size-mb"),
])
def test_pid_shard_refuses_bad_arguments_before_any_work(raw_root: Path, tmp_path: Path, capsys, monkeypatch,
                                                         argv, says) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    base = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(out)]
    if "--work-dir" in argv:
        base[-1] = "s3://bucket/out"
    line = _usage_error(capsys, lambda: shard_main(_big([*base, *argv])))
    assert line.startswith("pid-shard: error:") and says in line and len(line) < 400
    assert not out.exists() and not (tmp_path / "s3:").exists()


def test_pid_rewrite_roots_never_takes_a_url_for_a_folder(raw_root: Path, tmp_path: Path, capsys,
                                                          monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for argv, says in [(["s3://bucket/out", "--absolute"], "URL"), ([str(tmp_path / "nope"), "--absolute"], "does not"),
                       ([str(tmp_path), "--url", "ftp://host/x"], "manifest root"),
                       ([str(tmp_path), "--url", "https://u:p@host/x"], "credentials")]:
        line = _usage_error(capsys, lambda argv=argv: rewrite_roots_main(argv))
        assert line.startswith("pid-rewrite-roots: error:") and says in line
    assert not (tmp_path / "s3:").exists()


def test_pid_demo_refuses_bad_folders_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "home" / "dagster.yaml").mkdir(parents=True)
    for argv, says in [(["--root", "s3://bucket/x"], "URL"), (["--root", str(a_file)], "is a file"),
                       (["--root", str(a_file / "below")], "is a file"),
                       (["--prepare-instance", str(a_file)], "is a file"),
                       (["--prepare-instance", "s3://bucket/home"], "URL"),
                       (["--prepare-instance", str(tmp_path / "home")], "Is a directory"),
                       (["--workers", "0"], "--workers")]:
        line = _usage_error(capsys, lambda argv=argv: demo.main(argv))
        assert line.startswith("pid-demo: error:") and says in line
    assert sorted(os.listdir(tmp_path)) == ["a-file", "home"]


def test_a_build_still_reads_a_settings_file_with_every_setting(raw_root: Path, tmp_path: Path) -> None:
    (raw_root / SOURCE / SETTINGS_NAME).write_text(
        "max_shard_size_mb: 0.25\nshard_size: 0\npart_size: 1000\nclassify_aspect_ratio: false\n"
        "shuffle: true\nseed: 7\n")
    settings = _settings_of(raw_root)
    assert settings.config == ShardingConfig(max_shard_size_mb=0.25, part_size=1000, classify_aspect_ratio=False,
                                             shuffle=True, seed=7)
    assert build(raw_root, tmp_path / "out", **{k: getattr(settings.config, k) for k in settings.from_file}).samples


def test_a_sensor_tick_refuses_a_hostile_settings_file_in_its_run(raw_root: Path, tmp_path: Path,
                                                                monkeypatch) -> None:
    from tests.support.dagster_runs import dagster_instance, evaluate_sensor, load_defs, use_roots

    for source, data in (("nested", b"seed: " + b"[" * 60000), ("yes", b"shuffle: yes\n")):
        (raw_root / source / "image").mkdir(parents=True)
        (raw_root / source / "image" / "a.jpg").write_bytes(jpeg_bytes(0))
        (raw_root / source / SETTINGS_NAME).write_bytes(data)
    use_roots(monkeypatch, raw_root, tmp_path / "out")
    with dagster_instance() as instance:
        defs = load_defs()
        start = time.perf_counter()
        result = evaluate_sensor(defs, instance, None)
        assert time.perf_counter() - start < 30  # the tick ends; each file is refused in milliseconds
    # The good source is built with its settings; each hostile one gets a run that fails with the
    # file's error where the operator sees it (issue 15: never a silent skip), tagged with that
    # error, and never a build with settings the file did not clearly say.
    requests = {r.partition_key: r for r in result.run_requests}
    assert sorted(requests) == ["nested", SOURCE, "yes"]
    assert "pid/settings_error" not in requests[SOURCE].tags
    for source in ("nested", "yes"):
        error = requests[source].tags["pid/settings_error"]
        assert SETTINGS_NAME in error and len(error) <= 200
        assert requests[source].tags["pid/config_version"] == "unreadable"
