"""The shard list of a mixture: the mixture's order, dealt to ranks and workers as one source's.

Only ``order`` differs from ``ShardlistBasic``: ``EpochPlan`` cuts the mixture's positions
into batches and deals them (``loader/wds/epoch_plan.py``), and ``ResumableLoader`` keeps its
usual state (epoch, position, stretches ahead), so a mixture resumes at any world size and
worker count exactly as one source does. The definition travels in the state (``definition``):
a state taken with another one is refused, naming what changed.
"""

from __future__ import annotations

from typing import Any

from loader.mixture.order import MixtureOrder, Part
from loader.mixture.sources import MixtureSources
from loader.wds.epoch_plan import EpochPlan
from loader.wds.shardlists import PlannedBatch, ShardlistBasic


class MixtureShardlist(ShardlistBasic):
    def __init__(self, sources: MixtureSources, **kwargs: Any):
        super().__init__(sources.table.counts, chunk_size=sources.chunk_size, **kwargs)
        self.sources = sources
        mix = sources.mixture
        self.per_epoch = mix.counts(sources.sizes)
        self.parts = [Part(off, sources.table.counts[off:off + n], c)
                      for off, n, c in zip(sources.offsets, sources.shard_counts, self.per_epoch, strict=True)]
        self.source_names = tuple(s.label for s in mix.sources)
        if sum(self.per_epoch) == 0:
            raise mix.error("gives no sample per epoch", "give some source a repeat or choose above 0")

    def order(self, epoch: int) -> MixtureOrder:  # type: ignore[override]
        return MixtureOrder(self.parts, seed=self.seed, epoch=epoch, shuffle=self.shuffle, layout=self.layout)

    def epoch_size(self) -> int:
        return sum(self.per_epoch)

    def planned_batch(self, plan: EpochPlan, epoch: int, k: int, skip: int) -> PlannedBatch:
        positions, pads = plan.positions(self.rank.group_id, k, skip)
        shards, members, repeats, sources = plan.order.locate(positions)  # type: ignore[attr-defined]
        return PlannedBatch(epoch, k, skip, shards, members, pads, sources=sources, repeats=repeats,
                            source_names=self.source_names)

    def definition(self) -> dict:
        mix = self.sources.mixture
        return {
            "name": mix.name,
            "sources": [{"name": s.label, **s.to_json(), "samples": n, "per_epoch": c, "fingerprint": fp}
                        for s, n, c, fp in zip(mix.sources, self.sources.sizes, self.per_epoch,
                                               self.sources.fingerprints, strict=True)],
            "samples_per_epoch": sum(self.per_epoch),
        }

    def definition_changes(self, saved: dict | None) -> str:
        return definition_changes(self.definition(), saved)


def definition_changes(mine: dict, saved: dict | None) -> str:
    """How a resume state's mixture definition differs from ``mine`` ('' if not): the twin-tar
    and the LeRobot mixtures both refuse a state taken with another definition, naming this."""
    if saved is None:
        return f"the state is for one source list, this loader reads the mixture {mine['name']!r}"
    if not isinstance(saved, dict) or not isinstance(saved.get("sources"), list):
        return f"{saved!r} is not a mixture definition"
    was = {s.get("name"): s for s in saved["sources"] if isinstance(s, dict)}
    now = {s["name"]: s for s in mine["sources"]}
    changes = [f"source {n!r} added" for n in now if n not in was]
    changes += [f"source {n!r} removed" for n in was if n not in now]
    for n, s in now.items():
        old = was.get(n)
        if old is None:
            continue
        for field in ("weight", "repeat", "choose", "samples", "per_epoch"):
            if old.get(field) != s.get(field):
                changes.append(f"source {n!r} {field} {old.get(field)!r} -> {s.get(field)!r}")
        if old.get("fingerprint") != s.get("fingerprint"):
            changes.append(f"source {n!r} manifests changed (fingerprint {old.get('fingerprint')!r} -> "
                           f"{s.get('fingerprint')!r})")
    if not changes and [s.get("name") for s in saved["sources"]] != list(now):
        changes.append(f"sources reordered {[s.get('name') for s in saved['sources']]} -> {list(now)}")
    if not changes and saved.get("samples_per_epoch") != mine["samples_per_epoch"]:
        changes.append(f"samples_per_epoch {saved.get('samples_per_epoch')!r} -> {mine['samples_per_epoch']!r}")
    return "; ".join(changes)
