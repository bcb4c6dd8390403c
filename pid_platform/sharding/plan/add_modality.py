"""A modality folder added to a built source: its tars against the committed plan, nothing re-cut.

Twin tars are a column store: when the new intake holds exactly the committed plan's keys, with
their files of every committed modality unchanged, and a file of the new modality for each, the
build keeps the committed plan (same shards, same member order) and writes only the new
modality's tars; every committed tar is reused untouched (``write/tars.py``: the same file
locally, left in place on S3). The size bound then holds for the modalities the plan was cut
with, which ``plan_cut.json`` (state) and the manifests (``plan_modalities``) record.

Keys of the committed plan the new folder lacks are the setting
``new_modality_missing_keys``: ``reshard`` (the default) drops them with a full re-shard, as
any other change of the samples does; ``keep`` keeps them in the committed plan without a
member of the new modality (their committed files must be unchanged; index mode skips them,
zip mode refuses such a shard when it reads the new modality).

``keep`` output is for our reader only. The new modality's tars then hold fewer members than
their twins, and PiD's reader zips member streams by position: it would pair different keys and
never read the tail of a short shard, and nothing in the manifest fields it reads shows this.
The manifests a PiD job reads are the absolute (or URL) roots, so ``keep`` is refused with them
(``refuse_keep_for_positional_readers``): as settings before any work (``tasks.run.run_build``), and
for an output that kept keys when its manifests are written or their roots rewritten. (The other
way, a placeholder member per missing key, would change the tar contract; not taken.)
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyarrow as pa

from loader.formats.atomic import atomic_write_bytes
from pid_platform.sharding.compute import pc
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.intake.listing import flat, stems
from pid_platform.sharding.intake.task import Sample
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.plan.shard_plan import KEEP, ShardingConfig, ShardPlan, plan_shards
from pid_platform.sharding.plan.tables import read_plans, samples_modalities
from pid_platform.sharding.state_doc import load_state_doc, read_state_doc
from pid_platform.sharding.storage import FileEntry, SourceStore

log = logging.getLogger(__name__)
PLAN_CUT = "plan_cut.json"  # in the state folder, only for a plan that was not cut with all its modalities


@dataclass(frozen=True)
class PlanCut:
    """How a plan relates to its modalities when some were added after it was cut."""

    plan_modalities: tuple[str, ...]  # the modalities the plan (and its size bound) was cut with
    added_modalities: tuple[str, ...]  # written against it afterwards, not counted in the bound
    reused_modalities: tuple[str, ...]  # this build's: whose tars the committed version already holds
    keys_without: int = 0  # keys kept without a file of an added modality (``keep``)


def load_plan_cut(folder: Path) -> PlanCut | None:
    """The plan cut recorded in ``folder``'s state (None: its plan was cut with every modality)."""
    try:
        path = Path(folder) / STATE_DIR / PLAN_CUT
        doc = load_state_doc(path.read_bytes(), path)
        return PlanCut(tuple(doc["plan_modalities"]), tuple(doc["added_modalities"]),
                       tuple(doc["reused_modalities"]), int(doc.get("keys_without", 0)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShardingConfigError(f"{Path(folder) / STATE_DIR / PLAN_CUT}: unreadable ({exc}); delete "
                                  f"{STATE_DIR}/ of that folder and rebuild") from None


def save_plan_cut(folder: Path, cut: PlanCut | None) -> None:
    path = Path(folder) / STATE_DIR / PLAN_CUT
    if cut is None:
        path.unlink(missing_ok=True)  # an earlier, unfinished build of this staging folder may have left one
    else:
        atomic_write_bytes(path, json.dumps(asdict(cut), sort_keys=True, indent=1).encode())


def _same_file(a: FileEntry, b: FileEntry) -> bool:
    return (a.name, a.size, a.fingerprint) == (b.name, b.size, b.fingerprint)


def _still_listed(store: SourceStore, source: str, kept: list[Sample], modalities: tuple[str, ...]) -> bool:
    """Whether each of ``kept`` (committed samples the new intake dropped) still has its committed
    files, unchanged: a listing of those modalities, nothing read; only ``kept``'s files are
    looked up in it (it may hold millions)."""
    for m in modalities:
        want = [(s.basename, s.files[m]) for s in kept if m in s.files]
        if not want:
            continue
        files = store.list_files(source, m).files
        # The last file of a basename in name order, as a later entry of a dict would win.
        backwards = pc.index_in(pa.array([b for b, _ in want], pa.string()),
                                value_set=flat(stems(files["name"]))[::-1]).to_pylist()
        for (_, f), back in zip(want, backwards, strict=True):
            listed = None if back is None else files.slice(files.num_rows - 1 - back, 1).to_pylist()[0]
            if listed is None or not _same_file(FileEntry(m, **listed), f):
                return False
    return True


def refuse_keep_for_positional_readers(manifest_root: str, where: str, *, config: ShardingConfig | None = None,
                                       cut: PlanCut | None = None) -> None:
    """Refuse (``ShardingConfigError``) manifest roots other than relative for ``keep``: the
    setting ``config``, or an output whose plan ``cut`` kept keys without a modality."""
    if manifest_root == "relative":
        return
    kept = cut is not None and cut.keys_without > 0
    if not kept and (config is None or config.new_modality_missing_keys != KEEP):
        return
    what = (f"{cut.keys_without} keys are kept without a member of {list(cut.added_modalities)}" if kept and cut
            else "new_modality_missing_keys is keep")
    raise ShardingConfigError(
        f"{where}: manifest root {manifest_root!r} with new_modality_missing_keys: keep: {what}, so the new "
        "modality's tars hold fewer members than their twins, and PiD's reader (which reads absolute or URL "
        "roots) zips members by position and would pair different keys. Keep relative roots and read it with "
        "the loader's index mode, or set new_modality_missing_keys: reshard")


def _committed_config(final: Path) -> ShardingConfig | None:
    try:
        doc = read_state_doc(Path(final) / STATE_DIR / "sharding.json")
        return None if doc is None else ShardingConfig(**doc)
    except (OSError, ValueError, TypeError, ShardingConfigError):
        return None


def may_extend(final: Path, modalities: list[str], config: ShardingConfig) -> bool:
    """Whether a build of ``modalities`` with ``config`` may extend the committed plan of
    ``final`` (``extend_committed_plan`` decides), from its settings and the plan's schema alone:
    a build that adds no modality folder cuts its plan as columns and never reads this one."""
    committed_config = _committed_config(final)
    plan = Path(final) / STATE_DIR / "plan.parquet"
    if committed_config is None or not plan.is_file():
        return False
    if replace(committed_config, new_modality_missing_keys=config.new_modality_missing_keys) != config:
        return False  # other settings: the plan is cut again
    try:
        have = set(samples_modalities(plan))  # plan.parquet has the samples table's columns
    except (OSError, ValueError):
        return False
    # A plan extended before stays the plan while its samples stay (a repair, other roots), so the
    # keys it kept are not dropped by a rebuild that adds nothing.
    return bool(have) and have <= set(modalities) and bool(set(modalities) - have or load_plan_cut(final))


def extend_committed_plan(
    store: SourceStore, source: str, final: Path, samples: list[Sample], modalities: list[str],
    config: ShardingConfig,
) -> tuple[list[ShardPlan], PlanCut] | None:
    """The committed plan of ``final`` with the added modalities' files, when the new intake
    (``samples``, ``modalities``) only added modality folders to it; None otherwise (a full plan)."""
    if not may_extend(final, modalities, config):
        return None
    # may_extend: the committed settings are ``config``'s but for new_modality_missing_keys.
    committed = read_plans(Path(final) / STATE_DIR / "plan.parquet", config.part_size)
    if not committed:
        return None
    have = tuple(committed[0].modalities)
    added = tuple(sorted(set(modalities) - set(have)))
    previous = load_plan_cut(final)
    by_basename = {s.basename: s for s in samples}
    kept: list[Sample] = []
    matched = 0
    for p in committed:
        for c in p.samples:
            n = by_basename.get(c.basename)
            if n is None:
                kept.append(c)
                continue
            if (n.key, n.width, n.height, n.bucket) != (c.key, c.width, c.height, c.bucket) or not all(
                    m in c.files and _same_file(n.files[m], c.files[m]) for m in have):
                return None  # a committed file changed (or a key lacked a modality before): re-cut
            matched += 1
    if matched != len(samples):
        return None  # new samples: they need shards of their own
    if kept:
        if config.new_modality_missing_keys != KEEP:
            log.info("%s: %d keys of the committed plan lack a file of %s: a full re-shard drops them "
                     "(new_modality_missing_keys: reshard)", source, len(kept), list(added) or "a modality")
            return None
        if not _still_listed(store, source, kept, have):
            return None
    plan_modalities = previous.plan_modalities if previous else have
    mods = tuple(sorted(modalities))
    # Each sample as the newest listing has it (the same files) where it has one.
    plans = [ShardPlan(p.bucket, p.index, p.relpath, tuple(by_basename.get(c.basename, c) for c in p.samples),
                       mods) for p in committed]
    cut = PlanCut(plan_modalities, tuple(sorted(set(mods) - set(plan_modalities))), have, len(kept))
    log.info("%s: modalities %s added to the committed plan of %d shards: only their tars are written%s",
             source, list(added), len(plans), f"; {len(kept)} keys kept without them" if kept else "")
    return plans, cut


def plan_build(
    store: SourceStore, source: str, final: Path, samples: list[Sample], modalities: list[str],
    config: ShardingConfig,
) -> tuple[list[ShardPlan], PlanCut | None]:
    """The plan of a build: the committed one extended (``extend_committed_plan``) when only
    modality folders were added, else the plan cut from ``samples``."""
    extended = extend_committed_plan(store, source, final, samples, modalities, config)
    if extended is not None:
        return extended
    return plan_shards(samples, modalities, config), None
