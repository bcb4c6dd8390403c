"""Command-line builds without Dagster: the plan, write tasks and commit the Dagster steps run.

``pid-shard`` mirrors the options of PiD's ``scripts/sharding_wds.py`` and adds what PiD lacks:
a seed for the shuffle, a trusted-data flag for pickled embeddings and an S3 endpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from loader.formats.errors import FormatError
from loader.formats.twin_tar import DEFAULT_PART_SIZE, SourceChangedError
from loader.formats.wdinfo import root_base
from loader.io import urls
from loader.io.s3_client import S3Settings
from pid_platform.cli_args import endpoint_url, finite_positive, int_at_least, local_path
from pid_platform.sharding.commit.s3_output import (
    WORK_ROOT_ENV,
    S3Output,
    check_writable,
    is_s3_url,
    read_pointer,
    refuse_other_urls,
)
from pid_platform.sharding.errors import BuildError, OutputNotWritableError
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL, VALIDATE_LEVELS
from pid_platform.sharding.pipeline import BuildSummary, refuse_roots_on_s3
from pid_platform.sharding.plan.shard_plan import MISSING_KEYS_CHOICES, RESHARD, ShardingConfig
from pid_platform.sharding.run_hold import refuse_if_held
from pid_platform.sharding.storage import SourceStore, open_source_store
from pid_platform.sharding.tasks.commit import run_commit
from pid_platform.sharding.tasks.outcomes import TaskOutcome
from pid_platform.sharding.tasks.plan import (
    run_intake_task,
    run_plan,
)
from pid_platform.sharding.tasks.run import run_build
from pid_platform.sharding.tasks.write import run_write_task

EXIT_BUILD_ERROR = 2  # argparse also exits 2 on bad arguments: "your input is wrong"
MAX_EXAMPLES_SHOWN = 3


def split_input_dir(input_dir: str) -> tuple[str, str]:
    """``/raw/photos`` -> (``/raw``, ``photos``); ``s3://b/prefix/photos`` -> (``s3://b/prefix``, ``photos``).

    The build reads a *root* holding sources; PiD's ``--input-dir`` names one source folder.
    """
    if urls.kind(input_dir, allowed=("local", "s3"), what="--input-dir") == "s3":
        rest = urls.split_scheme(input_dir)[1].strip("/")
        if "/" not in rest:
            raise ValueError(
                f"--input-dir {input_dir!r} names a bucket, not a source folder; "
                "use s3://bucket/prefix/source (the folder holding image/, caption/ ...)"
            )
        root, source = rest.rsplit("/", 1)
        return f"s3://{root}", source
    # abspath, not resolve: a linked source folder keeps the name it was given.
    path = Path(os.path.abspath(urls.local_path(input_dir)))
    if path.parent == path:
        raise ValueError(f"--input-dir {input_dir!r} is a filesystem root, not a source folder")
    return str(path.parent), path.name


def check_output_apart(input_root: str, source: str, output_dir: Path | str) -> None:
    """Refuse an output folder that overlaps the input.

    A build replaces its output folder with a new version in which, of the files named like the
    twin-tar layout, only those it planned remain; an output inside (or around) the raw source
    could take raw files with it.
    """
    if urls.is_s3(input_root) or is_s3_url(output_dir):
        if is_s3_url(output_dir):
            src, out = f"{input_root.rstrip('/')}/{source}/", f"{str(output_dir).rstrip('/')}/"
            if src.startswith(out) or out.startswith(src):
                raise OutputNotWritableError(
                    f"--output-dir {output_dir} overlaps --input-dir {src.rstrip('/')}; choose an output "
                    "prefix outside the source"
                )
        return
    output_dir = Path(output_dir)
    src = (Path(input_root) / source).resolve()
    out = output_dir.resolve()
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        raise OutputNotWritableError(
            f"--output-dir {output_dir} overlaps --input-dir {src}; the build removes stale "
            "tars under its output folder, so choose an output folder outside the source"
        )


TASK_COMMANDS = ("plan", "task", "commit")
_TASK_HELP = {
    "plan": "the intake over the whole source (reusing what intake tasks found) and the plan of its shards, "
    "staged beside --output-dir; then run `pid-shard task --index I --of N` for I = 0 .. N-1 and "
    "`pid-shard commit`",
    "task": "one task of the staged build: --stage write (default) writes shard range I of N of the plan "
    "(tars, key indexes, digests, then a completion record); --stage intake validates slice I of N of the "
    "listing (balanced by file bytes), before `pid-shard plan`. A task that finds its record does nothing",
    "commit": "once every write task has its completion record: the manifests, then the swap that publishes "
    "the staged build as --output-dir",
}


def shard_parser(command: str | None = None) -> argparse.ArgumentParser:
    """``pid-shard``'s options; ``command`` (one of ``TASK_COMMANDS``): those of that subcommand."""
    p = argparse.ArgumentParser(
        prog="pid-shard" if command is None else f"pid-shard {command}",
        description=(
            "Shard one raw source (a folder of modality folders: image/, caption/, umt5/ ...) into "
            "twin WebDataset tars with wdinfo.json manifests and parquet key indexes."
            if command is None else _TASK_HELP[command]
        ),
        epilog=None if command is not None else (
            "The same build as tasks for any scheduler: `pid-shard plan ...`, `pid-shard task --index I --of N "
            "...` (once per I, in any processes or machines that see --output-dir), `pid-shard commit ...`; "
            "same options, same bytes. `pid-shard plan --help` says more."
        ),
    )
    if command == "task":
        p.add_argument("--index", type=int_at_least(0), required=True,
                       help="which task this is: 0 .. N-1 (a Slurm array's $SLURM_ARRAY_TASK_ID, a Kubernetes "
                       "indexed Job's $JOB_COMPLETION_INDEX)")
        p.add_argument("--of", type=int_at_least(1, 1_000_000), required=True, dest="of",
                       help="how many tasks share the stage (N); the bytes built do not depend on it")
        p.add_argument("--stage", choices=("write", "intake"), default="write",
                       help="write (default): shard range I of N of the staged plan; intake: slice I of N of "
                       "the source's listing, validated before `pid-shard plan`")
    p.add_argument("--input-dir", required=command != "commit",
                   help="source folder holding the modality folders: a local path or s3://bucket/prefix/source")
    p.add_argument("--output-dir", required=True,
                   help="where the shards and manifests go: a local folder or s3://bucket/prefix (published "
                   "as a new version behind a pointer, see --work-dir)")
    p.add_argument("--max-shard-size-mb", type=finite_positive, default=500.0,
                   help="upper bound on a shard's tars, all modalities together (default: 500)")
    p.add_argument("--shard-size", type=int_at_least(0), default=0,
                   help="fixed samples per shard; 0 (default) bounds shards by --max-shard-size-mb")
    p.add_argument("--part-size", type=int_at_least(1), default=DEFAULT_PART_SIZE,
                   help=f"tars per part_<NNNNNN> folder (default: {DEFAULT_PART_SIZE})")
    p.add_argument("--classify-aspect-ratio", action=argparse.BooleanOptionalAction, default=True,
                   help="put samples in aspect_ratio_<W>_<H> buckets (default: on)")
    p.add_argument("--num-workers", type=int_at_least(1, 1024), default=min(8, os.cpu_count() or 1),
                   help="parallel worker threads for intake, tar writing, key indexes and hashing (image "
                   "decoding, sendfile, parquet and sha256 release the GIL); the output does not depend on it "
                   "(default: CPUs, at most 8)")
    p.add_argument("--shuffle", action="store_true", help="shuffle samples within each bucket before sharding")
    p.add_argument("--seed", type=int_at_least(-(2**63), 2**63 - 1), default=0,
                   help="seed of --shuffle; same seed, same bytes (default: 0)")
    p.add_argument("--new-modality-missing-keys", choices=MISSING_KEYS_CHOICES, default=RESHARD,
                   help="a modality folder added to a built source that lacks some of its keys: 'reshard' drops "
                        "them with a full re-shard, 'keep' keeps them (index mode skips them); one that covers "
                        "every key writes only its own tars either way (default: reshard)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="accept pickled embeddings (.pkl/.pt ...); loading them can run arbitrary code")
    p.add_argument("--validate", choices=VALIDATE_LEVELS, default=VALIDATE_FULL,
                   help="full (default): decode every image, so truncated or corrupt files are dropped; "
                   "header: read size and EXIF orientation from the header only, as PiD does (for sources "
                   "you trust). Part of the build's settings: changing it validates every file again")
    p.add_argument("--revalidate", action="store_true",
                   help="validate every file again instead of reusing the outcomes of earlier builds "
                   "(kept by file identity: size, times and inode, or S3 ETag), and run every step")
    p.add_argument("--repair", action="store_true",
                   help="read every tar of the published output (and every object of an s3:// one) and rewrite or "
                   "re-upload those whose sha256 differs from their manifest's; any rebuild already rewrites a tar "
                   "that is missing or of the wrong size (a listing, no download)")
    p.add_argument("--force", action="store_true",
                   help="build into a non-empty --output-dir that pid-shard did not make (its files are kept)")
    p.add_argument("--s3-endpoint-url", type=endpoint_url, default=None,
                   help="S3 endpoint for s3:// input and output (default: $AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--work-dir", default=None,
                   help="for an s3:// --output-dir: the local folder the build stages in and keeps to reuse "
                   f"unchanged tars (default: ${WORK_ROOT_ENV} or ~/.cache/pid-platform/work, then "
                   "<bucket>/<prefix>)")
    p.add_argument("--manifest-root", default="relative", metavar="relative|absolute|URL",
                   help="root written into each wdinfo.json: 'relative' (default; the manifest's folder, so "
                   "moved data keeps working), 'absolute' (the output folder's absolute path, which PiD's "
                   "reader needs) or the URL the output folder is published at (s3://bucket/prefix); an "
                   "s3:// --output-dir keeps relative roots")
    return p


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


def _reason_lines(counts: dict[str, int], examples: dict[str, list[str]]) -> list[str]:
    lines = []
    for reason, n in sorted(counts.items()):
        ex = examples.get(reason, [])[:MAX_EXAMPLES_SHOWN]
        more = f"  (e.g. {', '.join(ex)})" if ex else ""
        lines.append(f"    {reason:<34} {n:>6}{more}")
    return lines


def format_summary(s: BuildSummary) -> str:
    """Everything the build did and everything it left out, for a terminal."""
    r = s.report
    total_bytes = sum(b.bytes for b in s.buckets.values())
    written = sum(b.written for b in s.buckets.values())
    where = f"{s.published} (staged in {s.out})" if s.published else str(s.out)
    lines = [
        f"pid-shard: source {s.source!r} -> {where}"
        + (": up to date (nothing changed since the committed build; nothing written)" if s.up_to_date else ""),
        f"  modalities: {', '.join(r.modalities)} (image modality: {r.image_modality or 'none'})",
        f"  buckets: {len(s.buckets)}  shards: {s.shards}  samples: {s.samples}  "
        f"bytes: {total_bytes} ({_human_bytes(total_bytes)})",
        f"  intake (validate={s.validate}): files validated: {r.files_validated}  "
        f"outcomes reused: {r.outcomes_reused}",
        f"  shards written: {written}  already up to date: {s.shards - written}",
        *([f"  repaired: {s.damaged_shards} shards had a missing or damaged tar; written again"]
          if s.damaged_shards else []),
        *([f"  repaired: {s.repaired} objects of the published version were missing or damaged; sent again"]
          if s.repaired else []),
        f"    {'bucket':<24} {'shards':>7} {'samples':>8} {'bytes':>14}",
    ]
    for name, b in s.buckets.items():
        lines.append(f"    {name or '(flat)':<24} {b.shards:>7} {b.samples:>8} {b.bytes:>14}")
    lines.append(f"  dropped samples: {r.dropped_total}")
    lines += _reason_lines(dict(r.dropped), r.examples)
    orphans = "  ".join(f"{m}={n}" for m, n in sorted(r.orphans.items()))
    lines.append(f"  orphans per modality: {orphans or 'none'}")
    lines.append(f"  skipped files: {sum(r.skipped_files.values())}")
    lines += _reason_lines(dict(r.skipped_files), r.examples)
    if r.empty_modalities:
        lines.append(f"  empty modality folders (ignored): {', '.join(r.empty_modalities)}")
    if r.key_collisions:
        lines.append(
            f"  key collisions: {r.key_collisions} samples renamed with a digest suffix "
            "(original basenames are in the key index)"
        )
        for ex in r.examples.get("key_collision_renamed", [])[:MAX_EXAMPLES_SHOWN]:
            lines.append(f"    {ex}")
    if s.removed:
        lines.append(f"  files of the previous version the new one dropped: {len(s.removed)}")
    lines.append(f"  manifests: {len(s.manifests)} wdinfo.json")
    for m in s.manifests:
        lines.append(f"    {s.published}/{Path(m).relative_to(s.out).as_posix()}" if s.published else f"    {m}")
    return "\n".join(lines)


class _ShardProgress:
    """A tqdm bar over shards, created on the first report (the total is known only then)."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="shard", desc="twin tars", file=sys.stderr, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_shard(args: argparse.Namespace, root: str, source: str) -> BuildSummary:
    check_output_apart(root, source, urls.without_file_scheme(args.output_dir))
    config = _config_of(args)
    store: SourceStore = open_source_store(root, endpoint_url=args.s3_endpoint_url)
    progress = _ShardProgress()
    try:
        # The tasked build in one process: the plan, write task 0 of 1, the commit.
        return run_build(
            store, source, _output_of(args), config, num_workers=args.num_workers, trust_pickle=args.trust_pickle,
            progress=progress, force=args.force, validate=args.validate, revalidate=args.revalidate,
            manifest_root=args.manifest_root, repair=args.repair, work_root=args.work_dir)
    finally:
        progress.close()


def _config_of(args: argparse.Namespace) -> ShardingConfig:
    return ShardingConfig(
        max_shard_size_mb=args.max_shard_size_mb,
        shard_size=args.shard_size,
        part_size=args.part_size,
        classify_aspect_ratio=args.classify_aspect_ratio,
        shuffle=args.shuffle,
        seed=args.seed,
        new_modality_missing_keys=args.new_modality_missing_keys,
    )


def _output_of(args: argparse.Namespace) -> Path | S3Output:
    """``--output-dir``: a folder, or an s3 output whose bucket took a write (an unreachable or
    refused bucket stops before any work)."""
    if not is_s3_url(args.output_dir):
        return Path(urls.without_file_scheme(args.output_dir))
    output = S3Output(args.output_dir, S3Settings(endpoint_url=args.s3_endpoint_url))
    check_writable(output)
    refuse_roots_on_s3(args.manifest_root, output)
    return output


def _run_task_command(command: str, args: argparse.Namespace, root: str | None, source: str | None) -> str:
    """Run one stage of the tasked build (``sharding/tasks/``: for an s3 output the tasks meet in
    the bucket, each in a work folder of its own machine); return what to print."""
    out = _output_of(args)
    on_s3 = isinstance(out, S3Output)
    if command == "task":
        refuse_if_held(out)  # a task takes no lock or lease (they run side by side); a Dagster run's hold stops it
    if command == "commit":
        summary = run_commit(out, num_workers=args.num_workers, manifest_root=args.manifest_root,
                             work_root=args.work_dir)
        if summary is None:
            pointer = read_pointer(out)
            return (f"pid-shard commit: {out}: nothing staged (the plan found version "
                    f"{pointer.version if pointer else '(none)'} up to date); nothing to do")
        return format_summary(summary)
    assert root is not None and source is not None
    check_output_apart(root, source, args.output_dir if on_s3 else out)
    store = open_source_store(root, endpoint_url=args.s3_endpoint_url)
    settings = dict(num_workers=args.num_workers, work_root=args.work_dir)
    if command == "plan":
        plan = run_plan(store, source, out, _config_of(args), trust_pickle=args.trust_pickle, force=args.force,
                        validate=args.validate, revalidate=args.revalidate, repair=args.repair, **settings)
        head = (f"pid-shard plan: source {source!r} -> {out}: {plan.samples} samples, {plan.shards} shards "
                f"in {len(plan.buckets)} buckets (files validated: {plan.files_validated}  "
                f"outcomes reused: {plan.outcomes_reused})")
        if plan.up_to_date:
            return f"{head}\n  up to date: {out} already serves the version this plan builds; nothing staged" \
                if on_s3 else (f"{head}\n  up to date: the committed build is what this one would publish; nothing "
                               "staged (the tasks and the commit have nothing to do)")
        return (f"{head}\n  staged{f' as version {plan.version} in the bucket' if on_s3 else ''}; next: `pid-shard "
                f"task --index I --of N ...` for I = 0 .. N-1 (any N up to {plan.shards}"
                f"{', on any machines' if on_s3 else ''}), then `pid-shard commit --output-dir {out}`")
    if args.stage == "intake":
        res = run_intake_task(store, source, out, args.index, args.of, trust_pickle=args.trust_pickle,
                              validate=args.validate, revalidate=args.revalidate, force=args.force, **settings)
    else:
        res = run_write_task(store, source, out, args.index, args.of, **settings)
    return _task_outcome_text(res, str(out))


def _task_outcome_text(res: TaskOutcome, out: str) -> str:
    if res.stage == "intake":
        # Not a range: the slices are balanced by bytes over the listing (``balanced_slices``).
        what = f"{res.items} samples ({res.nbytes / 1e6:.1f} MB of files)" if res.items else "no samples"
        did = f"files validated: {res.done}  outcomes reused: {res.reused}"
    else:
        what = f"shards {res.first} .. {res.first + res.items - 1}" if res.items else "no shards"
        did = f"shards written: {res.done}  already up to date: {res.reused}"
        if res.copied:
            did += f"  tars copied inside the bucket: {res.copied}"
    head = f"pid-shard task: {res.stage} task {res.index} of {res.of} of {out}"
    if res.nothing_staged:
        return f"{head}: nothing staged (the plan found the committed build up to date); nothing to do"
    if res.already_done:
        return f"{head}: {what}: already done (completion record {res.record}); nothing to do"
    return f"{head}: {what}: {did}; completion record {res.record}"


def task_main(command: str, argv: Sequence[str]) -> int:
    """``pid-shard plan|task|commit ...``: one stage of the build, for a scheduler to place."""
    parser = shard_parser(command)
    args = parser.parse_args(argv)
    root = source = None
    try:
        if args.input_dir is not None:
            root, source = split_input_dir(args.input_dir)
        refuse_other_urls(args.output_dir, "--output-dir")
        on_s3 = is_s3_url(args.output_dir)
        if on_s3:
            S3Output(args.output_dir)  # a malformed s3:// URL is an argument error
            refuse_roots_on_s3(args.manifest_root, S3Output(args.output_dir))
            if command == "plan" and args.repair:
                raise ValueError("--repair: for an s3:// output run `pid-shard --repair` without a subcommand")
        elif args.work_dir is not None:
            raise ValueError("--work-dir is for an s3:// --output-dir; a local output stages beside itself")
        if args.work_dir is not None:
            local_path("--work-dir", kind="folder")(args.work_dir)  # a URL is never a local folder
        root_base(args.manifest_root, "out")
        if command == "task" and args.index >= args.of:
            raise ValueError(f"argument --index: must be below --of (tasks are 0 .. {args.of - 1}), "
                             f"got --index {args.index} --of {args.of}")
    except ValueError as exc:
        parser.error(str(exc))
    return run_and_print(f"pid-shard {command}", "the task", lambda: _run_task_command(command, args, root, source))


def shard_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands only as the first word: every earlier invocation (options only) means what it did.
    if argv and argv[0] in TASK_COMMANDS:
        return task_main(argv[0], argv[1:])
    parser = shard_parser()
    args = parser.parse_args(argv)
    try:
        root, source = split_input_dir(args.input_dir)
        refuse_other_urls(args.output_dir, "--output-dir")
        if is_s3_url(args.output_dir):
            S3Output(args.output_dir)  # a malformed s3:// URL is an argument error
        elif args.work_dir is not None:
            raise ValueError("--work-dir is for an s3:// --output-dir; a local output stages beside itself")
        if args.work_dir is not None:
            local_path("--work-dir", kind="folder")(args.work_dir)  # a URL is never a local folder
        root_base(args.manifest_root, "out")  # only roots the loader can read back
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --work-dir: {exc}")
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line
    return run_and_print("pid-shard", "the build", lambda: format_summary(run_shard(args, root, source)))


def run_and_print(prog: str, what: str, run: Callable[[], str]) -> int:
    """Run ``run`` and print the text it returns; a build error is one line naming the file and
    the fix, without a traceback (exit 2)."""
    try:
        text = run()
    except (BuildError, FormatError, SourceChangedError) as exc:
        # Named errors already say which file and what to do; a traceback would bury that.
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BUILD_ERROR
    except OSError as exc:
        # The file system refused (disk full, a read-only mount, an output folder that is its own
        # mount point so staging cannot be renamed over it): say so without a traceback.
        print(f"{prog}: error: {exc}; {what} stopped and the published output is unchanged", file=sys.stderr)
        return EXIT_BUILD_ERROR
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `pid-shard ... | head`: the work is done, the reader left early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def rewrite_roots_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pid-rewrite-roots",
        description="Rewrite the root of every wdinfo.json of an existing build (nothing else changes): "
        "absolute roots for a PiD training job, relative ones to move the data freely.",
    )
    p.add_argument("output_dir", type=local_path("the output folder", kind="existing-folder"),
                   help="the build's output folder (pid-shard --output-dir)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--absolute", dest="mode", action="store_const", const="absolute",
                      help="each manifest's folder as an absolute path (what PiD's reader needs)")
    mode.add_argument("--relative", dest="mode", action="store_const", const="relative",
                      help='"." (the manifest\'s folder: the default of a build)')
    mode.add_argument("--url", dest="mode", metavar="URL", type=_root_url,
                      help="the URL the output folder is published at (s3://bucket/prefix): roots below it")
    return p


def _root_url(text: str) -> str:
    try:
        root_base(text, ".")
    except FormatError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not urls.has_scheme(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL; use --absolute or --relative for those")
    return text


def rewrite_roots_main(argv: Sequence[str] | None = None) -> int:
    from pid_platform.sharding.commit.manifest_roots import rewrite_manifest_roots

    args = rewrite_roots_parser().parse_args(argv)
    try:
        changed = rewrite_manifest_roots(args.output_dir, args.mode)
    except (BuildError, FormatError) as exc:
        print(f"pid-rewrite-roots: error: {exc}", file=sys.stderr)
        return EXIT_BUILD_ERROR
    print(f"pid-rewrite-roots: {len(changed)} manifest(s) of {args.output_dir} now have {args.mode} roots")
    for path in changed:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(shard_main())
