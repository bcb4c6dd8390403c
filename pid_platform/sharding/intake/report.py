"""What an intake reports: every file it looked at is in a sample or counted here with its reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_EXAMPLES = 20


@dataclass
class IntakeReport:
    source: str
    modalities: list[str] = field(default_factory=list)
    empty_modalities: list[str] = field(default_factory=list)
    image_modality: str | None = None
    files_seen: dict[str, int] = field(default_factory=dict)
    orphans: dict[str, int] = field(default_factory=dict)  # modality -> files without partners
    skipped_files: Counter = field(default_factory=Counter)  # reason -> files
    dropped: Counter = field(default_factory=Counter)  # reason -> samples
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first few names
    key_collisions: int = 0
    samples: int = 0
    # How the outcomes were found (not part of the report's JSON: a rebuild of the same source
    # reports the same JSON whatever it had to validate again).
    files_validated: int = 0  # checked this run
    outcomes_reused: int = 0  # taken from the intake cache (file identity unchanged)

    def note_many(self, reason: str, first: Iterable[str], count: int, counter: Counter | None = None) -> None:
        """``count`` more under ``reason``; ``first``: their names in order (only the first few
        are kept as examples, so a column's head is enough)."""
        if count <= 0:
            return
        (self.dropped if counter is None else counter)[reason] += count
        ex = self.examples.setdefault(reason, [])
        for what in first:
            if len(ex) >= MAX_EXAMPLES:
                break
            ex.append(what)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "modalities": self.modalities,
            "empty_modalities": self.empty_modalities,
            "image_modality": self.image_modality,
            "files_seen": self.files_seen,
            "orphans": self.orphans,
            "skipped_files": dict(sorted(self.skipped_files.items())),
            "dropped": dict(sorted(self.dropped.items())),
            "dropped_total": self.dropped_total,
            "examples": {k: v for k, v in sorted(self.examples.items())},
            "key_collisions": self.key_collisions,
            "samples": self.samples,
        }
