"""Each source's sharding settings, in one durable place: ``sharding.yaml`` in its raw folder.

The file sits beside the source's modality folders (``<raw_root>/<source>/sharding.yaml``, a
local file or an S3 object) and overrides the code location's defaults (the ``sharding``
resource) key by key::

    # photos/sharding.yaml
    max_shard_size_mb: 64
    classify_aspect_ratio: false

The sensor, the daily schedule and every run read it, so a source keeps its settings until
someone edits the file; its version (``ShardingConfig.version()``) is in the sensor's run key
and in the data version of the ``sharding_settings`` observation that the source's assets
depend on, so a change shows them stale in the UI and the sensor rebuilds exactly that source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import yaml

from loader.formats.errors import short_repr
from loader.formats.strict_doc import load_yaml_doc
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import SourceStore

SETTINGS_NAME = "sharding.yaml"
# Every setting that changes which bytes land in which tar.
SETTING_KEYS = tuple(f.name for f in fields(ShardingConfig))


@dataclass(frozen=True)
class SourceSettings:
    source: str
    config: ShardingConfig
    location: str        # where the file is (or would be)
    from_file: dict[str, Any]  # the keys the file sets
    exists: bool = False  # whether the file is there (absent: the defaults)

    @property
    def version(self) -> str:
        return self.config.version()


# A settings file is a handful of lines; anything larger is not one (and is not read whole).
MAX_SETTINGS_BYTES = 64 * 1024
_FIX = "fix or delete the file"


def parse_settings(data: bytes, location: str) -> dict[str, Any]:
    """The settings a ``sharding.yaml`` sets: a flat mapping of setting names to single values.

    Read by the one strict reader (``loader.formats.strict_doc``), so whatever the file holds the
    reading is bounded: larger than ``MAX_SETTINGS_BYTES``, not UTF-8, anchors and aliases, nested
    values, tags, a key written twice, a second document and YAML 1.1's ambiguous spellings
    (yes/no/on/off, 010, 1_000, 1:20) are each a ``ShardingConfigError`` naming the file and the
    key; values are then checked by ``ShardingConfig``.
    """
    lines: dict[str, int] = {}

    def known(path: tuple[str | int, ...], name: str, line: int) -> None:
        if path:
            return
        if name not in SETTING_KEYS:  # before its value: an unknown key is the clearer message
            raise ShardingConfigError(f"{location}: unknown settings [{short_repr(name)}] (line {line}); the "
                                      f"settings are {', '.join(SETTING_KEYS)}")
        lines.setdefault(name, line)

    doc = load_yaml_doc(data, location, max_bytes=MAX_SETTINGS_BYTES, fix=_FIX, error=ShardingConfigError,
                        max_depth=1, on_key=known)
    if doc is None:
        return {}  # empty, comments only, or "---" alone
    if not isinstance(doc, dict):
        raise ShardingConfigError(f"{location}: must be a mapping of settings ({', '.join(SETTING_KEYS)})")
    for name, value in doc.items():
        if value is None:
            raise ShardingConfigError(f"{location}: {name} (line {lines[name]}) has no value; give one, or "
                                      "delete the line to use the default")
    return doc


def source_settings(store: SourceStore, source: str, defaults: ShardingConfig) -> SourceSettings:
    """The settings ``source`` is built with: ``defaults`` overridden by its ``sharding.yaml``."""
    location = store.source_file_uri(source, SETTINGS_NAME)
    # One byte past the cap is enough to know the file is too large; the rest is never read.
    data = store.read_source_file(source, SETTINGS_NAME, max_bytes=MAX_SETTINGS_BYTES + 1)
    from_file = parse_settings(data, location) if data is not None else {}
    try:
        config = ShardingConfig(**{**asdict(defaults), **from_file})
    except ShardingConfigError as exc:
        raise ShardingConfigError(f"{location}: {exc}") from None
    return SourceSettings(source, config, location, from_file, data is not None)


def persist_settings(store: SourceStore, current: SourceSettings, changes: dict[str, Any],
                     defaults: ShardingConfig) -> SourceSettings:
    """Write ``changes`` into the source's ``sharding.yaml`` (other keys kept) and return the
    settings now in force. Nothing is written when they change nothing."""
    unknown = sorted(k for k in changes if k not in SETTING_KEYS)
    if unknown:
        raise ShardingConfigError(f"unknown sharding settings {unknown}; the settings are {', '.join(SETTING_KEYS)}")
    wanted = {**current.from_file, **changes}
    config = ShardingConfig(**{**asdict(defaults), **wanted})  # refuses a bad value before writing
    if wanted == current.from_file:
        return current
    body = ("# Sharding settings of this source; the build, the sensor and the daily schedule read them.\n"
            + yaml.safe_dump(dict(sorted(wanted.items())), sort_keys=True))
    store.write_source_file(current.source, SETTINGS_NAME, body.encode())
    return SourceSettings(current.source, config, current.location, wanted, True)
