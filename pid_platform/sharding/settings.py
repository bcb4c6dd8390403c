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

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import yaml

from loader.formats.errors import short_repr
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
_MAX_NUMBER_CHARS = 40

try:  # libyaml: the same events, read in C (a hostile file of MAX_SETTINGS_BYTES takes milliseconds)
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

# Plain scalars that YAML 1.1 (PyYAML) and YAML 1.2 (most other readers) read differently, or
# that surprise a person: refused with the spelling to use instead, never taken silently.
_BOOL_1_1 = re.compile(r"(?i:y|n|yes|no|on|off)")
_TRUE, _FALSE = ("true", "True", "TRUE"), ("false", "False", "FALSE")
_NULL = ("", "~", "null", "Null", "NULL")
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?")
_SPECIAL_FLOAT = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
_RADIX = re.compile(r"[-+]?0(?:[0-7]+|[oO][0-7]+|[xX][0-9a-fA-F]+|[bB][01]+|[0-9]+)")
_UNDERSCORE = re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?")
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


def _scalar(text: str, where: str) -> Any:
    """The value of a plain (unquoted) scalar, by one set of rules (true/false, decimal numbers)."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if text in _NULL:
        raise ShardingConfigError(f"{where} has no value; give one, or delete the line to use the default")
    if _BOOL_1_1.fullmatch(text):
        raise ShardingConfigError(f"{where}: {text!r} is a boolean to some YAML readers and text to others; "
                                  "write true or false")
    if text.lower() in _SPECIAL_FLOAT:
        return _SPECIAL_FLOAT[text.lower()]
    looks_numeric = _FLOAT.fullmatch(text) or _RADIX.fullmatch(text) or _UNDERSCORE.fullmatch(text) \
        or _SEXAGESIMAL.fullmatch(text)
    if looks_numeric and len(text) > _MAX_NUMBER_CHARS:
        raise ShardingConfigError(f"{where}: a number of {len(text)} characters is out of every setting's range")
    if _INT.fullmatch(text):
        return int(text)
    if _RADIX.fullmatch(text):
        raise ShardingConfigError(f"{where}: {text!r} is octal, hexadecimal or binary to some YAML readers "
                                  "(010 is 8) and decimal to others; write the decimal number without a leading 0")
    if _FLOAT.fullmatch(text):
        return float(text)
    if _SEXAGESIMAL.fullmatch(text):
        raise ShardingConfigError(f"{where}: {text!r} is a base-60 number to YAML 1.1 (1:20 is 80) and text to "
                                  "others; write the decimal number")
    if _UNDERSCORE.fullmatch(text):
        raise ShardingConfigError(f"{where}: {text!r}: YAML readers disagree on '_' in numbers; "
                                  "write the number without '_'")
    return text  # a plain string: ShardingConfig names the setting it does not fit


# (libyaml marks a plain scalar's style "", PyYAML's own parser None.)


def _refuse(location: str, message: str) -> ShardingConfigError:
    return ShardingConfigError(f"{location}: {message}; fix or delete the file")


def _events(text: str, location: str) -> Iterator[yaml.Event]:
    loader = _Loader(text)
    try:
        while loader.check_event():
            yield loader.get_event()
    except yaml.YAMLError as exc:
        raise _refuse(location, f"not valid YAML ({short_repr(str(exc), 300)})") from None
    finally:
        loader.dispose()


def parse_settings(data: bytes, location: str) -> dict[str, Any]:
    """The settings a ``sharding.yaml`` sets: a flat mapping of setting names to single values.

    Read event by event, so whatever the file holds the reading is bounded: larger than
    ``MAX_SETTINGS_BYTES``, not UTF-8, anchors and aliases, nested values, tags, a key written
    twice, a second document and YAML 1.1's ambiguous spellings (yes/no/on/off, 010, 1_000, 1:20)
    are each a ``ShardingConfigError`` naming the file and the key; values are then checked by
    ``ShardingConfig``.
    """
    if len(data) > MAX_SETTINGS_BYTES:
        raise _refuse(location, f"larger than {MAX_SETTINGS_BYTES} bytes, so not a settings file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(location, f"not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); "
                                "save it as UTF-8") from None
    text = text.removeprefix("\ufeff")
    events = _events(text, location)
    out: dict[str, Any] = {}
    lines: dict[str, int] = {}

    def refuse_node(event: yaml.Event, where: str) -> None:
        if isinstance(event, yaml.AliasEvent):
            raise _refuse(location, f"{where} is an alias (*{short_repr(event.anchor)}); anchors and aliases "
                                    "are not read here, write the value itself")
        anchor, tag = getattr(event, "anchor", None), getattr(event, "tag", None)
        if anchor is not None:
            raise _refuse(location, f"{where} has an anchor (&{short_repr(anchor)}); anchors and aliases "
                                    "are not read here")
        if tag is not None:
            raise _refuse(location, f"{where} has a tag ({short_repr(tag)}); write plain values")

    first = next(events)  # StreamStartEvent
    assert isinstance(first, yaml.StreamStartEvent)
    doc = next(events)
    if isinstance(doc, yaml.StreamEndEvent):
        return {}  # empty, or comments only
    top = next(events)
    if isinstance(top, yaml.ScalarEvent) and not top.style and top.value in _NULL and top.tag is None:
        pass  # an empty document ("---" alone): no settings
    elif not isinstance(top, yaml.MappingStartEvent):
        raise ShardingConfigError(f"{location}: must be a mapping of settings ({', '.join(SETTING_KEYS)})")
    else:
        refuse_node(top, "the document")
        while True:
            key = next(events)
            if isinstance(key, yaml.MappingEndEvent):
                break
            line = key.start_mark.line + 1
            if not isinstance(key, yaml.ScalarEvent) or key.style not in (None, "", "'", '"'):
                raise _refuse(location, f"line {line}: a key must be a setting name "
                                        f"({', '.join(SETTING_KEYS)})")
            refuse_node(key, f"line {line}: key {short_repr(key.value)}")
            name = key.value
            if name not in SETTING_KEYS:
                raise ShardingConfigError(
                    f"{location}: unknown settings [{short_repr(name)}] (line {line}); the settings are "
                    f"{', '.join(SETTING_KEYS)}"
                )
            if name in out:
                raise _refuse(location, f"{name} is set twice (lines {lines[name]} and {line}); "
                                        "keep one of them")
            where = f"{name} (line {line})"
            value = next(events)
            refuse_node(value, where)
            if not isinstance(value, yaml.ScalarEvent):
                raise _refuse(location, f"{where} must be a single value, not a list or a mapping")
            out[name] = _scalar(value.value, f"{location}: {where}") if not value.style else value.value
            lines[name] = line
    if not isinstance(next(events), yaml.DocumentEndEvent) or not isinstance(next(events), yaml.StreamEndEvent):
        raise _refuse(location, "holds more than one YAML document; keep one")
    return out


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
