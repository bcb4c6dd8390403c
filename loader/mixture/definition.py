"""What a weighted mixture is: its sources and how much of each an epoch holds.

A :class:`Mixture` is validated when it is made (in Python, or from a ``catalog.json`` entry,
or from the ``sharding`` resource's ``datasets``): every bad value is one
:class:`MixtureError` naming the dataset, the source and the fix. Nothing here reads data;
:func:`check_modalities` checks a definition against the sources' modalities once they are known
(from the catalog, or from the manifests).

Either every source has a ``weight`` (its share of ``samples_per_epoch``; default: the sum of the
sources' sizes), or each has ``repeat`` (each sample this many times per epoch, fractions
allowed) or ``choose`` (this many samples per epoch); a source with neither counts once
(``repeat=1``), and the epoch is the sum of those counts.

Counts are bounded where they are defined: a source gives at most ``MAX_COUNT`` samples per
epoch (what the schedule's exact keys hold), so ``repeat``, ``choose`` and ``samples_per_epoch``
past what any epoch of these sources could hold are refused naming the dataset, not at
``make_loader``. ``counts`` is linear in the number of sources (10,000 weighted sources: a few
milliseconds; ``bench/bench_mixture_counts.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from loader.formats.errors import short_repr

SOURCE_KEYS = ("weight", "repeat", "choose")
MAX_COUNT = 2**31 - 1  # samples of one source per epoch: the schedule's keys are exact below it
DATASET_KEYS = ("sources", "samples_per_epoch", "modalities", "aspect_ratios")


class MixtureError(ValueError):
    """A mixture definition that cannot be used: names the dataset, the source and the fix."""


def short(value: Any) -> str:
    """A value for a message: ``repeat=1e308`` or a 300-digit count stays one short line."""
    return short_repr(value, 40)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float, Fraction)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Source:
    """One source of a mixture: ``spec`` is anything ``build_dataset`` takes for one source (a
    catalog source name, a manifest, a folder, a glob or a list of those), or for
    ``StreamingLeRobotDataset.mixture`` a LeRobot dataset (a repo id, or
    ``{"repo_id": ..., "root": ...}``). ``name`` is what batches carry in ``__source__``
    (default: ``spec`` when it is one string, a LeRobot spec's ``repo_id``)."""

    spec: Any
    weight: float | None = field(default=None, kw_only=True)
    repeat: float | None = field(default=None, kw_only=True)
    choose: int | None = field(default=None, kw_only=True)
    name: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.name is None:
            spec = self.spec
            label = spec if isinstance(spec, str) else ",".join(spec) if _strings(spec) else None
            if label is None and isinstance(spec, Mapping) and isinstance(spec.get("repo_id"), str):
                label = spec["repo_id"]  # a LeRobot dataset: {"repo_id": ..., "root": ...}
            if label is None:
                raise MixtureError(f"source {spec!r}: give it a name (Source(spec, name='...')); "
                                   "it is what batches carry in __source__")
            object.__setattr__(self, "name", label)

    @property
    def label(self) -> str:
        assert self.name is not None
        return self.name

    def kind(self) -> str | None:
        given = [k for k in SOURCE_KEYS if getattr(self, k) is not None]
        return given[0] if given else None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SOURCE_KEYS if getattr(self, k) is not None}


def _strings(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


@dataclass(frozen=True)
class Mixture:
    """A logical dataset that blends ``sources``: see the module docstring."""

    sources: Sequence[Source]
    samples_per_epoch: int | None = field(default=None, kw_only=True)
    name: str = field(default="mixture", kw_only=True)
    modalities: Sequence[str] | None = field(default=None, kw_only=True)
    aspect_ratios: Sequence[str] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.modalities is not None:
            object.__setattr__(self, "modalities", tuple(self.modalities))
        if self.aspect_ratios is not None:
            object.__setattr__(self, "aspect_ratios", tuple(self.aspect_ratios))
        self._validate()

    def error(self, what: str, fix: str, source: Source | str | None = None) -> MixtureError:
        """The one shape of a definition error: the dataset, the source, what is wrong; the fix."""
        where = f"dataset {self.name!r}"
        if source is not None:
            where += f", source {source.label if isinstance(source, Source) else source!r}"
        return MixtureError(f"{where}: {what}; {fix}")

    def _validate(self) -> None:
        if not self.sources:
            raise self.error("has no sources", "name at least one source")
        seen: set[str] = set()
        for s in self.sources:
            if not isinstance(s, Source):
                raise self.error(f"{s!r} is not a Source", "wrap it: Source(spec, weight=...)")
            if s.label in seen:
                raise self.error("is named twice", "list each source once (give one a name=...)", s)
            seen.add(s.label)
            given = [k for k in SOURCE_KEYS if getattr(s, k) is not None]
            if len(given) > 1:
                raise self.error(f"has both {given[0]!r} and {given[1]!r}", "give one of weight, repeat or choose", s)
            if s.weight is not None and (not _number(s.weight) or s.weight <= 0):
                raise self.error(f"weight {short(s.weight)} is not a number > 0",
                                "give a positive weight (its share of samples_per_epoch), or remove the source", s)
            if s.repeat is not None and (not _number(s.repeat) or not 0 <= s.repeat <= MAX_COUNT):
                raise self.error(f"repeat {short(s.repeat)} is not a number from 0 to {MAX_COUNT}",
                                "give how many times each sample comes per epoch (0.5: half of them, 2: twice)", s)
            if s.choose is not None and (not isinstance(s.choose, int) or isinstance(s.choose, bool)
                                         or not 0 <= s.choose <= MAX_COUNT):
                raise self.error(f"choose {short(s.choose)} is not a whole number from 0 to {MAX_COUNT}",
                                "give how many of its samples each epoch takes", s)
        weighted = [s for s in self.sources if s.weight is not None]
        counted = [s for s in self.sources if s.repeat is not None or s.choose is not None]
        if weighted and counted:
            raise self.error(f"mixes weights with {counted[0].kind()}",
                            "give every source a weight (shares of samples_per_epoch), or every source "
                            "repeat/choose (absolute counts)", counted[0])
        if weighted and len(weighted) < len(self.sources):
            lacking = next(s for s in self.sources if s.weight is None)
            raise self.error("has no weight while the other sources have one",
                            "give every source a weight, or none", lacking)
        spe = self.samples_per_epoch
        if spe is not None:
            if not weighted:
                raise self.error(f"samples_per_epoch={spe!r} is given without weights",
                                "remove samples_per_epoch: with repeat/choose the epoch is the sum of their counts")
            if not isinstance(spe, int) or isinstance(spe, bool) or spe < 1:
                raise self.error(f"samples_per_epoch {short(spe)} is not a whole number >= 1",
                                "give the epoch's length in samples, or leave it out (the sources' total)")
            if spe > MAX_COUNT * len(self.sources):  # some source would give more than MAX_COUNT
                raise self.error(f"samples_per_epoch {short(spe)} cannot fit an epoch of {len(self.sources)} "
                                 f"source(s) (at most {MAX_COUNT} samples each)",
                                 "give a smaller samples_per_epoch, or split the dataset")
        for name, value in (("modalities", self.modalities), ("aspect_ratios", self.aspect_ratios)):
            if value is not None and (not value or not all(isinstance(v, str) and v for v in value)):
                raise self.error(f"{name} {list(value)!r} is not a list of names", f"list the {name}, or leave it out")

    @property
    def weighted(self) -> bool:
        return self.sources[0].weight is not None

    # ------------------------------------------------------------------ counts per epoch

    def counts(self, sizes: Sequence[int]) -> list[int]:
        """Samples per epoch of each source, given each source's size (samples after filters).

        Weights: ``samples_per_epoch`` (default: the sizes' sum) apportioned by largest
        remainder, so the counts sum to it exactly. ``repeat``: ``round(repeat * size)`` (half up);
        ``choose``: as given, at most the source's size."""
        sizes = [int(n) for n in sizes]
        out = self._counts(sizes)
        for s, c in zip(self.sources, out, strict=True):
            if c > MAX_COUNT:
                raise self.error(f"gives {c} samples per epoch, more than the {MAX_COUNT} an epoch can hold of "
                                 "one source", "lower its repeat or the dataset's samples_per_epoch, or split it", s)
        return out

    def _counts(self, sizes: list[int]) -> list[int]:
        for s, n in zip(self.sources, sizes, strict=True):
            if n == 0:
                raise self.error("has no samples", "build it, or remove it from the dataset", s)
            if s.choose is not None and s.choose > n:
                raise self.error(f"choose={s.choose} is more than its {n} samples",
                                f"choose at most {n}, or use repeat={Fraction(s.choose, n)} to repeat samples", s)
        if not self.weighted:
            return [s.choose if s.choose is not None else
                    math.floor(Fraction(s.repeat if s.repeat is not None else 1) * n + Fraction(1, 2))
                    for s, n in zip(self.sources, sizes, strict=True)]
        total = self.samples_per_epoch or sum(sizes)
        # Exact integers: every weight over one common denominator (floats are dyadic, so it is
        # the largest of theirs), then total * w_i // W and its remainder. Linear in the sources
        # (the sum of Fractions, once per source, was quadratic).
        w = [Fraction(s.weight) for s in self.sources]  # type: ignore[arg-type]
        den = math.lcm(*(x.denominator for x in w))
        num = [x.numerator * (den // x.denominator) for x in w]
        whole = sum(num)
        out, rem = zip(*(divmod(total * x, whole) for x in num), strict=True)
        out = list(out)
        by_remainder = sorted(range(len(out)), key=lambda i: (-rem[i], i))
        for i in by_remainder[: total - sum(out)]:
            out[i] += 1
        return out

    # ------------------------------------------------------------------ JSON (catalog.json)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"sources": {s.label: s.to_json() for s in self.sources}}
        if self.samples_per_epoch is not None:
            doc["samples_per_epoch"] = self.samples_per_epoch
        if self.modalities is not None:
            doc["modalities"] = list(self.modalities)
        if self.aspect_ratios is not None:
            doc["aspect_ratios"] = list(self.aspect_ratios)
        return doc

    @classmethod
    def from_json(cls, name: str, doc: Any, known_sources: Iterable[str] | None = None) -> Mixture:
        """The mixture a ``catalog.json`` (or ``sharding.datasets``) entry defines:
        ``{"sources": {"photos": {"weight": 0.6}, ...}, "samples_per_epoch": N}``. Sources are
        catalog source names; with ``known_sources`` an unknown one is refused."""
        if not isinstance(doc, Mapping):
            raise MixtureError(f"dataset {name!r}: {type(doc).__name__} is not a definition; give a list of "
                               "source names, or {'sources': {'<source>': {'weight': 0.5}, ...}}")
        extra = sorted(set(doc) - set(DATASET_KEYS))
        if extra:
            raise MixtureError(f"dataset {name!r}: unknown keys {extra}; the keys are {list(DATASET_KEYS)}")
        sources = doc.get("sources")
        if not isinstance(sources, Mapping) or not sources:
            raise MixtureError(f"dataset {name!r}: 'sources' must map source names to "
                               "{'weight': w} / {'repeat': r} / {'choose': n} (or {} for once each)")
        known = None if known_sources is None else sorted(known_sources)
        out = []
        for src, settings in sources.items():
            if known is not None and src not in known:
                raise MixtureError(f"dataset {name!r}, source {src!r}: no such source in the catalog (built: "
                                   f"{known}); build it first or fix the name")
            if settings is None:
                settings = {}
            if not isinstance(settings, Mapping) or set(settings) - set(SOURCE_KEYS):
                bad = sorted(set(settings) - set(SOURCE_KEYS)) if isinstance(settings, Mapping) else settings
                raise MixtureError(f"dataset {name!r}, source {src!r}: {bad!r} is not a setting; give one of "
                                   f"{list(SOURCE_KEYS)}, e.g. {{'weight': 0.5}}")
            out.append(Source(src, name=src, **dict(settings)))
        return cls(out, samples_per_epoch=doc.get("samples_per_epoch"), name=name,
                   modalities=doc.get("modalities"), aspect_ratios=doc.get("aspect_ratios"))

    def with_name(self, name: str) -> Mixture:
        return Mixture(self.sources, samples_per_epoch=self.samples_per_epoch, name=name,
                       modalities=self.modalities, aspect_ratios=self.aspect_ratios)


def check_modalities(mix: Mixture, source_keys: Mapping[str, Sequence[str]],
                     modalities: Sequence[str] | None = None) -> tuple[str, ...]:
    """The modalities every source is read with; refuses a modality a source lacks, and sources
    with different modality sets when none are chosen (naming the common ones to choose)."""
    wanted = tuple(modalities or mix.modalities or ())
    if wanted:
        for s in mix.sources:
            have = sorted(source_keys[s.label])
            missing = [m for m in wanted if m not in have]
            if missing:
                raise mix.error(f"lacks modalities {missing} (it has {have})",
                               "drop them from the dataset's 'modalities', or remove the source", s)
        return wanted
    sets = {s.label: tuple(sorted(source_keys[s.label])) for s in mix.sources}
    first = mix.sources[0].label
    for s in mix.sources[1:]:
        if sets[s.label] != sets[first]:
            common = sorted(set.intersection(*(set(v) for v in sets.values())))
            raise mix.error(f"has modalities {list(sets[s.label])}, source {first!r} has {list(sets[first])}",
                           f"choose common ones: 'modalities': {common}", s)
    return sets[first]
