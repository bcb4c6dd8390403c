"""Hostile inputs and kills: the one list of what each gets.

Cases tested here (``::`` = this module) and where older ones live. "exit 2" is ``pid-shard``'s
named-error exit without a traceback; every drop or skip is counted in a report or in
``loader.stats``. The reader's own checks are listed in docs/formats.md, section 5.

Output folder and build processes
  two builds through ``out`` and ``link-to-out``   BuildInProgressError: one lock on the resolved folder
                                                   (::test_a_build_through_a_link_to_a_folder_being_built_is_refused)
  a second build of the same output                BuildInProgressError (test_build_lock.py)
  a non-empty folder no build made                 ForeignOutputError / exit 2, nothing deleted; --force
                                                   builds and keeps its files (::test_a_folder_no_build_made_...)
  files a user put into a built output             carried into every new version (test_build_publish.py)
  output inside / around the input                 exit 2 (test_cli.py::test_output_inside_the_input_is_refused)
  unwritable output                                exit 2 before any work (test_cli.py, test_build_bad_input.py)
  kill -9 of pid-shard while its pool works        every worker and helper ends (::test_kill_9_of_pid_shard_...)
  kill -9 during a build, at many points           no partial version, rerun byte-identical (test_build_crash.py)
  any build                                        nothing left beside the output; an early failure leaves
                                                   no empty staging folder (::test_a_build_leaves_nothing_...,
                                                   ::test_a_build_that_fails_early_...)
  a process a test leaves running                  the session fails (tests/support/leaks.py, test_leak_check.py)
  kill -9 of a trainer with num_workers=2          its DataLoader workers end within 3 s, twin tars and LeRobot
                                                   (test_examples_training.py::test_kill_9_of_the_trainer_leaves_
                                                   no_dataloader_worker; PR_SET_PDEATHSIG: test_workers.py)
  an orphan that runs on, then ends before the end the session fails too (test_leak_check.py::
                                                   test_dataloader_workers_that_outlive_a_killed_trainer_fail_the_run)

S3 outputs: versions and the pointer (every case reads every sample back with verify="sha256")
  cleanup listed a retired version, a build republishes it before the deletion
                                                   kept: the cleanup reads the pointer again after claiming it
                                                   (test_s3_version_races.py::test_a_cleanup_that_listed_...)
  cleanup runs while a build republishes a retired version
                                                   kept as claimed (test_s3_version_races.py::
                                                   test_a_cleanup_leaves_a_version_a_build_has_claimed)
  a build republishes a version the cleanup is deleting
                                                   the build waits, then uploads it whole
                                                   (test_s3_version_races.py::test_a_build_waits_for_a_cleanup_...)
  kill -9 of a cleanup holding a delete claim      a republishing build waits until the claim expires, then
                                                   uploads what was deleted (test_s3_version_races.py::
                                                   test_a_cleanup_killed_while_deleting_...)
  two builds from two machines (first pointer, existing pointer)
                                                   one publishes, the other exits 2 naming it; conditional PUT
                                                   (test_s3_version_races.py::test_of_two_builds_from_two_machines_...)
  cleanup rewrites the pointer's "retired" while a build is about to switch
                                                   the build switches from the rewritten pointer (still its start)
                                                   (test_s3_version_races.py::test_a_cleanup_forgetting_...)
  bucket emptied / deleted during a build          exit 2 before the switch, no pointer; the next build publishes
                                                   (test_s3_version_races.py::test_a_bucket_emptied_or_deleted_...)
  kill -9 right before the pointer switch          previous version served; the next build takes the dead
                                                   build's lease over at once and finishes its version
                                                   (test_build_s3_output.py::test_a_build_killed_before_the_...)
  kill -9 of pid-shard into s3://, rerun at once   the rerun takes the lease over (same host, boot, pid
                                                   namespace; the pid gone or reused), resumes the killed
                                                   version and publishes it (@ = test_build_lease_values.py:
                                                   @test_kill_9_of_pid_shard_and_an_immediate_rerun_...)
  a lease of a live process on this machine        refused, "still running on this machine"; another boot,
                                                   pid namespace or no identity: refused until stale
                                                   (@test_a_lease_of_this_machine_is_taken_over_only_when_...,
                                                   test_build_lease.py::test_a_second_build_is_refused_...)
  a holder killed on another machine               refused until its lease is stale (test_build_lease.py::
                                                   test_a_holder_killed_with_kill_9_on_another_machine_...)

Lease and claim values (@ = test_build_lease_values.py)
  lease.json: 1e400 in pid / expires, NaN, a 30-digit pid, ttl_s 1e300, a pid as text, a list
                                                   BuildLeaseError naming the file, exit 2, no traceback
                                                   (@test_a_lease_with_values_no_build_writes_is_refused_...)
  expires ten years ahead (dead holder), renewed ten years ahead
                                                   stale at renewed + ttl_s; a deadline > 2 TTLs ahead is not
                                                   honoured (@test_a_dead_holders_lease_claiming_ten_years_...)
  PID_LEASE_TTL_S=1e300 / 86401 / 60 digits, PID_LEASE_RENEW_S=1e-9
                                                   BuildError naming the variable: TTL 2 s..1 day, renewal
                                                   1 s..TTL/2 (@test_lease_ttl_and_renewal_are_bounded,
                                                   test_build_lease.py::test_lease_settings_are_checked_...)
  a claim's ttl_s 0 / 1e300 / nan / inf            BuildError (@test_a_claims_ttl_is_bounded)
  a delete claim expiring in ten years, 1e400 in a claim
                                                   not honoured (a warning names the object); the build does
                                                   not wait (@test_a_delete_claim_of_ten_years_does_not_...)
  a live claim renewed forever                     the wait ends after max_wait_s with ClaimWaitTimeout
                                                   naming the claim (@test_a_wait_for_a_live_claim_is_bounded_...)
  a 16 MB object among the claims                  read no further than 4 KB + 1; not a claim (a warning names
                                                   it) (@test_a_claim_object_of_16_mb_is_not_read_whole)
  current.json: 1e400, NaN, a key twice, nesting   FormatError naming the file
                                                   (@test_a_pointer_with_values_no_build_writes_is_a_format_...)
  a tar deleted from the current version (rebuild, --revalidate, another work folder)
                                                   sent again, "repaired"; reader error names --repair
                                                   (test_build_repair.py::test_a_tar_deleted_from_the_current_s3_...)
  a tar changed in place on S3 / locally (same size, same times)
                                                   pid-shard --repair replaces it (test_build_repair.py::
                                                   test_repair_replaces_an_s3_tar_..., test_repair_rewrites_a_local_...)
  a tar deleted from a local output                rewritten by the next build (test_build_repair.py::
                                                   test_a_tar_deleted_from_a_local_output_is_written_again)
  a new version whose tar the damaged current one lost (it would be copied from there)
                                                   uploaded instead (test_build_repair.py::test_a_new_version_...)

Settings and resume states
  --max-shard-size-mb inf / nan / 1e999            exit 2 with usage, before intake (::test_a_shard_size_bound_...)
  ShardingConfig / Dagster resource out of range   ShardingConfigError naming the field (::test_sharding_settings_...)
  bad option values (0, -1)                        exit 2 with usage (test_cli.py::test_bad_option_values_...)
  resume state: epoch -5, bad position or ahead    ResumeStateError naming the field (::test_resume_states_...)
  the same modalities in another order             resumes (::test_the_same_modalities_in_another_order_resume)
  state from before a rebuild that renamed a sample  ResumeStateError: checksums are in the fingerprint
                                                   (::test_a_resume_state_from_before_a_rebuild_...)
  state of another dataset / seed                  ResumeStateError (test_loader_resume.py::test_resume_state_must_match)

Settings files and other files a sensor or run reads (``~`` = test_hostile_files_and_args.py)
  sharding.yaml: aliases (billion laughs), anchors, tags, nesting 60000 deep, > 64 KiB (a sparse
  10 GiB file, a pipe, a folder), 60000-digit numbers, bounds past what the build can use,
  yes/on/NO, 010, 0x10, 1_000, 1:20, a key twice, two documents, bad UTF-8, UTF-16, NUL, wrong types
                                                   ShardingConfigError naming the file and the key,
                                                   within 5 s (measured < 10 ms) and 32 MB (~test_a_hostile_settings_...,
                                                   ~test_a_settings_file_that_is_huge_pipe_or_folder_...)
  the same in S3 (8 MB, empty, aliases)           read up to the cap only (~test_a_settings_object_in_s3_...)
  a sensor tick over such sources                  requests a run for each that fails naming file and
                                                   key, builds the others; main's tick died of
                                                   RecursionError (~test_a_sensor_tick_refuses_a_hostile_...)
  a BOM, quoted keys, comments, "---"             read (~test_plain_settings_files_still_read)
  ShardingConfig: shard_size 2**31, seed 2**63, 1e-9 / 2 TiB MiB
                                                   ShardingConfigError, value cut short (~test_sharding_config_refuses_...)
  catalog.json / LeRobot info.json: NaN, Infinity, 1e999, a key twice, nesting 100000 deep,
  5000 digits, bad UTF-8                           FormatError / LeRobotMetaError naming the file (~test_a_hostile_catalog_...,
                                                   ~test_a_hostile_lerobot_info_json_...)
  PID_DATASETS and PID_EXECUTOR_CONFIG: an alias bomb, a FIFO with no writer, non-UTF-8, nesting
  30000 (libyaml's limit) and 40 (ours) deep, mixed-type keys (1: beside a:), a folder, a missing file
                                                   MixtureError / ExecutorConfigError naming the file and key,
                                                   < 1 s and < 50 MB each, one strict reader
                                                   (loader/formats/strict_doc.py) for every settings file
                                                   (test_hostile_code_location_files.py::test_a_hostile_code_...)

Mixtures (% = test_mixture_names_and_counts.py)
  a dataset named like a built source, or "all"; a source named "all"
                                                   MixtureError naming both, at definition (catalog build,
                                                   PID_DATASETS load) and when a catalog is read
                                                   (%test_a_dataset_may_not_take_..., %test_all_is_the_builds_...,
                                                   %test_a_catalog_that_gives_a_source_name_...)
  a ./photos folder where the job runs, build_dataset("photos", catalog=...)
                                                   the catalog's photos; "./photos" names the folder
                                                   (%test_a_name_given_with_a_catalog_resolves_there_...)
  a mixture source naming a dataset                refused: a mixture's sources are sources
                                                   (%test_a_mixtures_source_resolves_as_a_source_only)
  repeat=1e308, choose=10**300, samples_per_epoch=10**18, a count past 2**31 - 1
                                                   MixtureError naming the dataset, at definition, one short
                                                   line (%test_counts_that_cannot_fit_an_epoch_...)
  10,000 weighted sources                          counts in milliseconds, linear (timed in
                                                   bench/bench_mixture_counts.py, not in a test)
  a LeRobot mixture source whose episodes select nothing
                                                   MixtureError saying fix 'episodes' (test_lerobot_mixture.py::
                                                   test_an_episode_selection_that_selects_nothing_names_episodes)

Adding a modality (new_modality_missing_keys: keep)
  keep with --manifest-root absolute / a URL, or pid-rewrite-roots of an output that kept keys
                                                   ShardingConfigError (PiD's positional zip would pair
                                                   different keys); reshard builds with absolute roots zip
                                                   matching keys only (test_add_modality.py::
                                                   test_keep_is_refused_to_the_roots_pid_reads_and_reshard_...)

Console scripts (exit 2, one error line, no traceback, nothing made; ~test_pid_*)
  pid-build-mp4-sidecar: repo id without owner, revision with '..', unsupported / credentialed root,
  --output a folder or a URL, missing episodes, bad endpoints
                                                   exit 2 (~test_pid_build_mp4_sidecar_refuses_...)
  a refused connection                             exit 1 after --max-retries (3), in seconds not 35 s
                                                   (~test_a_refused_connection_fails_within_...)
  pid-shard: --manifest-root ftp:// or file://, --work-dir s3://, 5000-digit --seed, bad endpoint
                                                   exit 2 before intake, no local "s3:" folder (~test_pid_shard_refuses_...)
  pid-rewrite-roots s3://..., pid-demo --root s3://... / a file, --prepare-instance on a file
                                                   exit 2, no local "s3:" folder (~test_pid_rewrite_roots_...,
                                                   ~test_pid_demo_refuses_...)

Inputs that escape
  catalog entry "..", absolute, file://, http://, s3://, backslash
                                                   FormatError naming the entry (~test_a_catalog_entry_that_leaves_...)
  tar keys "../x", "/abs" under format_version 1  ShardReadError; counted skip under shard_error_policy="skip"
                                                   (~test_a_path_as_a_key_is_refused_under_format_1)
  the same in a PiD-written tar                    read as PiD reads it, counted in stats["escaping_keys"]
                                                   (~test_a_path_as_a_key_of_a_pid_written_tar_is_counted)
  delta_timestamps NaN / inf / 1e300 / True, episodes 1.5 / True / "0" / -1
                                                   ValueError naming the option, before any read
                                                   (~test_streaming_selection_options_are_checked_...)

Raw files at intake
  pickle named .npy, structured .npy with an object field, object .npy without header spaces,
  pickle of protocol 0-5 named .bin                UnsafeInputError / exit 2 unless --trust-pickle
                                                   (::test_pickle_look_alikes_are_refused_unless_trusted)
  .pkl/.pt embeddings, object .npy                 UnsafeInputError (test_build_bad_input.py, test_cli.py)
  raw float .bin, safetensors starting 0x80, numbers as text, numeric structured .npy
                                                   built (::test_embeddings_that_only_resemble_pickles_are_built)
  .txt caption not UTF-8 (or blank)                dropped: bad_caption (::test_a_txt_caption_that_is_not_utf8_...)
  .json caption not JSON / without prompt          dropped: bad_caption (test_build_bad_input.py)
  truncated / unreadable image, zero-byte file     dropped (test_build_bad_input.py)
  EXIF-rotated JPEG                                bucket and index use the displayed size, the loader returns
                                                   the displayed pixels (::test_decoded_images_are_the_displayed_...)
  dangling link (inside or outside)                skipped: broken_symlink (::test_a_dangling_link_...)
  link out of the source (file or folder)          skipped: symlink_outside_root (test_build_bad_input.py)
  modality folder linked to another                skipped: duplicate_modality (::test_a_modality_folder_linked_...)
  hidden files, ambiguous basenames, non-UTF-8 names, key collisions, orphans
                                                   skipped / dropped / renamed and reported (test_build_bad_input.py)

Manifests and tars at read time
  negative, fractional, misaligned counts; total != sum; root, data_list, key_index or data_keys
  leaving the manifest's folder; format_version 99  ManifestError (FormatError in the build) naming the field
                                                   (::test_the_reader_refuses_manifests_that_break_the_format)
  PiD's absolute root                              read (::test_an_absolute_root_is_still_read)
  a tar with more / fewer samples than its count   CountMismatchError; counted skip under shard_error_policy="skip"
                                                   (::test_a_tar_holding_more_..., ::test_a_tar_holding_fewer_...)
  a tar changed in place (same size)               verify="sha256": ChecksumError / counted skip (::test_verify_...)
  truncated or missing tar                         ShardReadError / counted skip (test_loader_expand.py)
  twins out of sync, missing/duplicate keys        TwinMismatchError or index-mode policies (test_loader_expand.py)
  undecodable member (bad UTF-8 caption, corrupt image)
                                                   DecodeError naming sample and member; on_decode_error="skip"
                                                   skips and counts it with its key (::test_one_undecodable_...)
  pickle members (.pkl, object .npy)               UnsafeDataError unless trusted_data (test_loader_expand.py)
  a pickle in a .bin member                        bytes, never unpickled, trusted or not
                                                   (::test_the_loader_never_unpickles_a_bin_member)

Padding and repeats (LeRobot streaming)
  a 15-frame epoch, 2 workers, one rank           15 items, each frame once, none marked: no padding between
                                                   workers (test_lerobot_stream.py::test_a_15_frame_epoch_...)
  two ranks of unequal episodes                    equal batches; each frame once unmarked, every repeat __pad__
                                                   (test_lerobot_stream.py::test_two_ranks_cover_every_frame_once)
  make_loader(drop_last=True)                      no repeats at all (test_lerobot_stream.py::test_drop_last_...)
  resume with workers of unequal counts            exact (test_lerobot_stream_plan.py::test_worker_steps_pass_...)
  examples/train_policy.py                         repeats leave the loss (both data kinds; a batch of repeats
                                                   only: loss 0, no gradient) (test_examples_training.py::
                                                   test_the_example_leaves_padding_repeats_out_of_the_loss)

Remote reads
  every range answered with an empty 206           counted as a retry: max_retries + 1 requests, then
                                                   RetryBudgetExceeded naming the URL and offset, for
                                                   open_url and the LeRobot RangeFetcher (test_io_streams.py::
                                                   test_http_empty_206_answers_spend_the_retry_budget)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loader.formats.errors import FormatError
from loader.formats.wdinfo import read_wdinfo
from loader.wds.errors import (
    ChecksumError,
    CountMismatchError,
    DecodeError,
    ManifestError,
    ResumeStateError,
)
from loader.wds.pipeline import build_dataset, make_loader
from pid_platform.cli import shard_main
from pid_platform.defs.resources import ShardingResource
from pid_platform.sharding.errors import NoSamplesError, ShardingConfigError, UnsafeInputError
from pid_platform.sharding.output_lock import BuildInProgressError
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from tests.support.build_data import SOURCE, add_sample, build, index_rows, jpeg_bytes, photo
from tests.support.loader_data import caption_bytes, write_hand_shards
from tests.support.loader_data import jpeg_bytes as small_jpeg
from tests.support.procs import descendants, wait_gone

HOLD_LOCK = """
import sys, time
from pid_platform.sharding.output_lock import build_lock
with build_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


# --------------------------------------------------------------------------- output folder


def test_a_build_through_a_link_to_a_folder_being_built_is_refused(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    link = tmp_path / "link-to-out"
    link.symlink_to(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(link)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # Both spellings stage in one folder: the second build must see the first one's lock.
        with pytest.raises(BuildInProgressError, match=rf"pid {holder.pid}"):
            build(raw_root, out)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert list(out.iterdir()) == []


def test_a_folder_no_build_made_is_refused_and_never_emptied(raw_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "theirs"
    foreign = {"image/part_000000/000000.tar": b"someone's tar", "wdinfo.json": b'{"data_keys": []}'}
    for rel, data in foreign.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    argv = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(out), "--num-workers", "1"]
    assert shard_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no .pid-build/" in err and "--force" in err and "empty" in err
    assert {p: (out / p).read_bytes() for p in foreign} == foreign
    # --force builds into it, and still deletes nothing the build did not write.
    assert shard_main([*argv, "--force"]) == 0
    summary = capsys.readouterr().out
    assert "previous version the new one dropped" not in summary
    assert {p: (out / p).read_bytes() for p in foreign} == foreign
    assert sorted(out.glob("aspect_ratio_*/wdinfo.json"))


# --------------------------------------------------------------------------- pickle look-alikes


def _npy_with_header(header: str, payload: bytes) -> bytes:
    """A version 1.0 .npy file with this exact header text (padded as numpy pads it)."""
    pad = (-(10 + len(header) + 1)) % 64
    text = (header + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + payload


def _structured_object_npy() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.zeros(2, dtype=[("a", "f4"), ("nested", [("b", "|O")])]), allow_pickle=True)
    return buf.getvalue()


class _Payload:
    def __reduce__(self):
        return (print, ("pickle ran",))


PICKLE_LOOKALIKES = {
    "protocol-0 pickle named .npy": ("npy", pickle.dumps(np.zeros(3), protocol=0)),
    "structured .npy with a nested object field": ("npy", _structured_object_npy()),
    "object .npy, header 'descr':'|O' without spaces": (
        "npy", _npy_with_header("{'descr':'|O','fortran_order':False,'shape':(1,),}", pickle.dumps([None]))),
    **{f"protocol-{p} pickle named .bin": ("bin", pickle.dumps({"x": [_Payload(), 1.5]}, protocol=p))
       for p in range(6)},
}


@pytest.mark.parametrize("case", sorted(PICKLE_LOOKALIKES))
def test_pickle_look_alikes_are_refused_unless_trusted(raw_root: Path, tmp_path: Path, case: str) -> None:
    ext, data = PICKLE_LOOKALIKES[case]
    emb = raw_root / SOURCE / "umt5"
    (emb / "astronaut-1x1.npy").unlink()
    (emb / f"astronaut-1x1.{ext}").write_bytes(data)
    with pytest.raises(UnsafeInputError, match=rf"umt5/astronaut-1x1\.{ext}: pickle data"):
        build(raw_root, tmp_path / "out")
    assert build(raw_root, tmp_path / "out", trust_pickle=True).samples > 0


NOT_PICKLES = {
    "raw float16 .bin": ("bin", np.linspace(-1, 1, 256, dtype=np.float16).tobytes()),
    "safetensors whose header length starts with 0x80": (
        "bin", (0x280).to_bytes(8, "little") + b'{"__metadata__":{}}'.ljust(0x280)),
    "numbers as text": ("bin", b"1.5,2.0,3.25\n" * 20),
    "structured numeric .npy": ("npy", _npy_with_header(
        "{'descr':[('a','<f4'),('b','<i2')],'fortran_order':False,'shape':(1,),}", bytes(6))),
}


@pytest.mark.parametrize("case", sorted(NOT_PICKLES))
def test_embeddings_that_only_resemble_pickles_are_built(raw_root: Path, tmp_path: Path, case: str) -> None:
    ext, data = NOT_PICKLES[case]
    emb = raw_root / SOURCE / "umt5"
    (emb / "astronaut-1x1.npy").unlink()
    (emb / f"astronaut-1x1.{ext}").write_bytes(data)
    assert build(raw_root, tmp_path / "out").samples > 0


class _MakesDir:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("protocol", [0, 5])
def test_the_loader_never_unpickles_a_bin_member(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pickle-ran"
    payload = pickle.dumps(_MakesDir(marker), protocol=protocol)
    write_hand_shards(tmp_path / "ds", [{"image": [("k.jpg", small_jpeg(0))], "emb": [("k.bin", payload)]}])
    for trusted in (False, True):  # trusted_data covers .pkl/.pt/object .npy, never .bin
        [sample] = list(build_dataset(str(tmp_path / "ds"), trusted_data=trusted, shuffle=False))
        assert sample["emb"] == payload
    assert not marker.exists()


# --------------------------------------------------------------------------- images


def test_decoded_images_are_the_displayed_image_the_bucket_promises(raw_root: Path, tmp_path: Path) -> None:
    # Stored 320x180 (landscape pixels), EXIF orientation 6: displayed 180x320, portrait.
    stored = photo("coffee", (320, 180))
    data = jpeg_bytes(stored, exif_orientation=6)
    add_sample(raw_root, "sideways", image=data)
    out = tmp_path / "out"
    build(raw_root, out)
    [row] = [r for r in index_rows(out) if r["key"] == "sideways"]
    assert (row["bucket"], row["width"], row["height"]) == ("aspect_ratio_9_16", 180, 320)
    ds = str(out / "aspect_ratio_9_16")
    [pil] = [s for s in build_dataset(ds, decode="pil", shuffle=False) if s["__key__"] == "sideways"]
    assert pil["image"].size == (180, 320)
    [raw] = [s for s in build_dataset(ds, decode="bytes", shuffle=False) if s["__key__"] == "sideways"]
    assert raw["image"] == data  # decode="bytes": the file as stored, EXIF and all


# --------------------------------------------------------------------------- kills

REPO = Path(__file__).resolve().parents[1]


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


def test_kill_9_of_pid_shard_leaves_no_worker_behind(raw_root: Path, tmp_path: Path) -> None:
    # 800 more samples: intake checks them in chunks of 64 on worker threads, for a few seconds.
    # The build starts no process (intake, tars, key indexes and hashing run on threads), so
    # nothing can outlive it; the workers are there while it is killed.
    small = jpeg_bytes(photo("rocket", (48, 32)))
    for i in range(800):
        add_sample(raw_root, f"extra-{i:03d}", image=small)
    cmd = [sys.executable, "-m", "pid_platform.cli", "--input-dir", str(raw_root / SOURCE),
           "--output-dir", str(tmp_path / "out"), "--num-workers", "2"]
    proc = subprocess.Popen(cmd, env=os.environ | {"PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staged = tmp_path / ".out.pid-staging"
    started: set[int] = set()
    threads = 0
    deadline = time.monotonic() + 120
    # Kill while intake works (its staging folder is made just before it starts listing).
    while not staged.exists() and proc.poll() is None and time.monotonic() < deadline:
        started |= descendants(proc.pid)
        time.sleep(0.01)
    for _ in range(20):
        started |= descendants(proc.pid)
        threads = max(threads, _threads(proc.pid))
        time.sleep(0.01)
    assert threads >= 3 and proc.poll() is None, "the build ended before the kill; give it more samples"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Killed mid-build: nothing was committed (intake on threads may already be done by now).
    assert not list((tmp_path / "out").rglob("wdinfo.json"))
    assert not wait_gone(started, timeout=10), f"still running 10 s after kill -9 of pid-shard: {sorted(started)}"
    assert started == set()  # no worker process to leave behind in the first place


# --------------------------------------------------------------------------- settings and resume states


@pytest.mark.parametrize("value", ["inf", "nan", "1e999"])
def test_a_shard_size_bound_that_is_not_finite_is_refused_before_intake(
    raw_root: Path, tmp_path: Path, value: str, capsys
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        shard_main(["--input-dir", str(raw_root / SOURCE), "--output-dir", str(out), "--max-shard-size-mb", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--max-shard-size-mb: must be a finite number > 0" in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / ".out.pid-staging").exists()


@pytest.mark.parametrize(("field", "value"), [
    ("max_shard_size_mb", float("inf")), ("max_shard_size_mb", float("nan")), ("max_shard_size_mb", 0),
    ("part_size", 0), ("shard_size", -1), ("part_size", 2.5), ("shuffle", "yes"),
])
def test_sharding_settings_are_checked_where_they_are_defined(field: str, value) -> None:
    with pytest.raises(ShardingConfigError, match=rf"sharding setting {field}="):
        ShardingConfig(**{field: value})
    if not isinstance(value, str | float) or field == "max_shard_size_mb":  # what pydantic lets through
        # The Dagster resource builds the same config, so it gets the same error.
        with pytest.raises(ShardingConfigError, match=rf"sharding setting {field}="):
            ShardingResource(**{field: value}).config()


def _two_modality_set(folder: Path) -> str:
    keys = [f"k{i}" for i in range(6)]
    write_hand_shards(folder, [{"image": [(f"{k}.jpg", small_jpeg(i)) for i, k in enumerate(keys[:3])],
                                "caption": [(f"{k}.json", caption_bytes(k)) for k in keys[:3]]},
                               {"image": [(f"{k}.jpg", small_jpeg(i)) for i, k in enumerate(keys[3:])],
                                "caption": [(f"{k}.json", caption_bytes(k)) for k in keys[3:]]}])
    return str(folder)


def _state_after(spec: str, modalities: list[str], batches: int) -> dict:
    loader = make_loader(build_dataset(spec, modalities=modalities, decode=None, batch_size=2))
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


def test_resume_states_are_checked_field_by_field(tmp_path: Path) -> None:
    spec = _two_modality_set(tmp_path / "ds")
    good = _state_after(spec, ["caption", "image"], 1)
    for bad, field in [({"epoch": -5}, "'epoch'"), ({"epoch": "0"}, "'epoch'"),
                       ({"position": -1}, "'position'"), ({"position": 10**9}, "'position'"),
                       ({"ahead": []}, "'ahead'"), ({"ahead": {"x": [[0, 1]]}}, "'ahead'"),
                       ({"ahead": {"0": [[3, 2]]}}, "'ahead'"), ({"order": None}, "'order'")]:
        loader = make_loader(build_dataset(spec, modalities=["caption", "image"], decode=None, batch_size=2))
        with pytest.raises(ResumeStateError, match=field):
            loader.load_state_dict(good | bad)


def test_the_same_modalities_in_another_order_resume(tmp_path: Path) -> None:
    spec = _two_modality_set(tmp_path / "ds")
    state = _state_after(spec, ["image", "caption"], 1)
    restored = make_loader(build_dataset(spec, modalities=["caption", "image"], decode=None, batch_size=2))
    restored.load_state_dict(state)
    rest = [k for batch in restored for k in batch["__key__"]]
    assert len(rest) == 4 and len(set(rest)) == 4


# --------------------------------------------------------------------------- captions

BAD_UTF8 = b"a caption with a stray \xff\xfe byte"


def test_a_txt_caption_that_is_not_utf8_is_dropped_at_intake(raw_root: Path, tmp_path: Path) -> None:
    captions = raw_root / SOURCE / "caption"
    (captions / "astronaut-1x1.json").unlink()
    (captions / "astronaut-1x1.txt").write_bytes(BAD_UTF8)
    (captions / "chelsea-1x1.json").unlink()
    (captions / "chelsea-1x1.txt").write_text("A cat, in plain text.", encoding="utf-8")
    summary = build(raw_root, tmp_path / "out")
    assert summary.report.examples["bad_caption: caption"] == ["astronaut-1x1"]
    assert "chelsea-1x1" in {r["key"] for r in index_rows(tmp_path / "out")}


def test_one_undecodable_caption_is_skipped_and_counted_under_skip(tmp_path: Path) -> None:
    keys = ["bad", "good1", "good2"]
    write_hand_shards(tmp_path / "ds", [{
        "image": [(f"{k}.jpg", small_jpeg(i)) for i, k in enumerate(keys)],
        "caption": [("bad.txt", BAD_UTF8), ("good1.txt", b"one"), ("good2.txt", b"two")],
    }])
    with pytest.raises(DecodeError, match="'bad'"):
        list(make_loader(build_dataset(str(tmp_path / "ds"), shuffle=False)))
    loader = make_loader(build_dataset(str(tmp_path / "ds"), shuffle=False, on_decode_error="skip"))
    assert [s["__key__"] for s in loader] == ["good1", "good2"]
    assert loader.stats["decode_errors"] == 1 and loader.stats["decode_error_keys"] == {"bad": 1}


# --------------------------------------------------------------------------- nothing beside the output


def test_a_build_leaves_nothing_beside_its_output_folder(raw_root: Path, tmp_path: Path) -> None:
    parent = tmp_path / "shards"
    build(raw_root, parent / "out")
    assert sorted(os.listdir(parent)) == ["out"]  # no .out.pid-lock, no .out.pid-staging


def test_a_build_that_fails_early_leaves_no_empty_staging_folder(raw_root: Path, tmp_path: Path) -> None:
    for jpg in (raw_root / SOURCE / "image").iterdir():
        jpg.write_bytes(b"not a picture")
    parent = tmp_path / "shards"
    with pytest.raises(NoSamplesError):
        build(raw_root, parent / "out")
    assert sorted(os.listdir(parent)) == []


# --------------------------------------------------------------------------- manifests the reader checks


def _six_samples(folder: Path) -> Path:
    """Two shards of three samples (k0-k2, k3-k5), with key indexes; returns the manifest."""
    shards = []
    for part in (range(3), range(3, 6)):
        shards.append({"image": [(f"k{i}.jpg", small_jpeg(i)) for i in part],
                       "caption": [(f"k{i}.json", caption_bytes(f"k{i}")) for i in part]})
    return write_hand_shards(folder, shards)


def _edit(manifest: Path, **changes) -> None:
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(doc | changes))


MANIFEST_LIES = {
    "negative count": ({"data_list_key_count": [-1, 4], "total_key_count": 3}, r"data_list_key_count\[0\] is -1"),
    "total is not the sum": ({"data_list_key_count": [3, 3], "total_key_count": 9}, "total_key_count 9"),
    "fractional count": ({"data_list_key_count": [1.5, 3], "total_key_count": 4.5}, "whole numbers"),
    "root leaves the folder": ({"root": "../sibling"}, "root '../sibling' leaves"),
    "data_list entry climbs out": ({"data_list": ["../../etc/x.tar", "part_000000/000001.tar"]}, "'../../etc/x.tar'"),
    "absolute data_list entry": ({"data_list": ["/etc/x.tar", "part_000000/000001.tar"]}, "'/etc/x.tar'"),
    "key_index entry climbs out": ({"key_index": ["../../x.parquet", None]}, "'../../x.parquet'"),
    "modality name climbs out": ({"data_keys": ["../image", "caption"]}, "data_keys"),
    "future format version": ({"format_version": 99}, "format_version 99 is newer"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_LIES))
def test_the_reader_refuses_manifests_that_break_the_format(tmp_path: Path, case: str) -> None:
    changes, message = MANIFEST_LIES[case]
    manifest = _six_samples(tmp_path / "ds")
    _edit(manifest, **changes)
    with pytest.raises(ManifestError, match=message):
        build_dataset(str(tmp_path / "ds"))
    with pytest.raises(FormatError, match=message):  # one reader: the build's checks refuse it alike
        read_wdinfo(manifest)


def test_an_absolute_root_is_still_read(tmp_path: Path) -> None:
    manifest = _six_samples(tmp_path / "ds")
    _edit(manifest, root=str(manifest.parent.resolve()))
    assert len(list(build_dataset(str(tmp_path / "ds"), decode=None))) == 6


@pytest.mark.parametrize("mode", ["zip", "index"])
@pytest.mark.parametrize("counts", [[2, 3], [3, 2]], ids=["tar-holds-more", "last-tar-holds-more"])
def test_a_tar_holding_more_samples_than_its_count_is_a_shard_error(tmp_path: Path, mode: str, counts) -> None:
    manifest = _six_samples(tmp_path / "ds")
    _edit(manifest, data_list_key_count=counts, total_key_count=5)  # consistent, and a lie
    with pytest.raises(CountMismatchError, match="rebuild the manifest"):
        list(build_dataset(str(tmp_path / "ds"), mode=mode, decode=None, shuffle=False))
    loader = make_loader(build_dataset(str(tmp_path / "ds"), mode=mode, decode=None, shuffle=False,
                                       shard_error_policy="skip"))
    list(loader)
    assert loader.stats["shard_errors"] == 1


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_a_tar_holding_fewer_samples_than_its_count_is_a_shard_error(tmp_path: Path, mode: str) -> None:
    manifest = _six_samples(tmp_path / "ds")
    _edit(manifest, data_list_key_count=[4, 3], total_key_count=7)
    with pytest.raises(CountMismatchError):
        list(build_dataset(str(tmp_path / "ds"), mode=mode, decode=None, shuffle=False))


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_verify_sha256_catches_a_tar_changed_in_place(raw_root: Path, tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    build(raw_root, out, classify_aspect_ratio=False, shard_size=8)
    assert len(list(build_dataset(str(out), verify="sha256", mode=mode, decode=None))) == 32
    tar = out / "image" / "part_000000" / "000001.tar"
    data = bytearray(tar.read_bytes())
    data[2000] ^= 0xFF  # inside the first member's JPEG data: same size, still a valid tar
    tar.write_bytes(bytes(data))
    assert len(list(build_dataset(str(out), mode=mode, decode=None))) == 32  # unnoticed without verify
    with pytest.raises(ChecksumError, match="000001.tar"):
        list(build_dataset(str(out), verify="sha256", mode=mode, decode=None))
    loader = make_loader(build_dataset(str(out), verify="sha256", mode=mode, decode=None,
                                       shard_error_policy="skip"))
    list(loader)
    assert loader.stats["shard_errors"] == 1


# --------------------------------------------------------------------------- smaller ones


def test_a_dangling_link_is_counted_as_broken_wherever_it_points(raw_root: Path, tmp_path: Path) -> None:
    (raw_root / SOURCE / "image" / "dangling.jpg").symlink_to(tmp_path / "elsewhere" / "gone.jpg")
    (raw_root / SOURCE / "caption" / "dangling-too.json").symlink_to("no-such-file.json")
    summary = build(raw_root, tmp_path / "out")
    assert summary.report.skipped_files["broken_symlink"] == 2
    assert "symlink_outside_root" not in summary.report.skipped_files


def test_a_modality_folder_linked_to_another_is_not_a_second_modality(raw_root: Path, tmp_path: Path) -> None:
    (raw_root / SOURCE / "picture").symlink_to(raw_root / SOURCE / "image")
    summary = build(raw_root, tmp_path / "out")
    assert summary.report.modalities == ["caption", "image", "umt5"]
    assert summary.report.skipped_files["duplicate_modality"] == 1
    assert summary.report.examples["duplicate_modality"] == ["picture"]


def test_a_resume_state_from_before_a_rebuild_that_renamed_a_sample_is_refused(
    raw_root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    build(raw_root, out, classify_aspect_ratio=False, shard_size=8)
    state = _state_after(str(out), ["caption", "image"], 1)
    for f in sorted((raw_root / SOURCE).glob("*/chelsea-1x1.*")):  # same counts, a new name
        f.rename(f.with_name(f.name.replace("chelsea-1x1", "chelsea-1x1b")))
    build(raw_root, out, classify_aspect_ratio=False, shard_size=8)
    restored = make_loader(build_dataset(str(out), modalities=["caption", "image"], decode=None, batch_size=2))
    with pytest.raises(ResumeStateError, match="another shard list"):
        restored.load_state_dict(state)
