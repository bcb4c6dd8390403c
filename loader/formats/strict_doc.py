"""The one strict reader of small documents a person or another machine wrote: settings files
(``sharding.yaml``, ``$PID_DATASETS``, ``$PID_EXECUTOR_CONFIG``), ``catalog.json``, LeRobot's
``info.json``, and the build's own records in a bucket others can write to (lease, claims).

Python's readers take more than a settings file should. ``yaml.safe_load`` expands aliases (a
400-byte "billion laughs" becomes gigabytes), follows nesting to a ``RecursionError``, reads a
named pipe until a writer comes, and gives mixed-type keys (``1:`` beside ``a:``) that break
sorting later; ``json`` takes ``NaN``, a key written twice (the last wins, silently), numbers of
any length and nesting to the recursion limit. Here:

* :func:`read_local_doc` opens without blocking, refuses anything but a regular file and reads
  at most ``max_bytes + 1`` bytes (one past the cap is enough to refuse it);
* :func:`load_yaml_doc` reads libyaml's events one at a time into plain values: no anchors,
  aliases, tags or merge keys, nesting bounded, keys are text (a plain key that reads as a
  number, boolean or null is refused: quote it), a key written twice refused, one
  document, plain scalars by one set of rules (``true``/``false``, decimal numbers; YAML 1.1's
  ``yes``/``on``/``010``/``1_000``/``1:20``, read differently by other readers, refused), numbers
  finite and short;
* :func:`load_json_doc` is Python's C reader with the same refusals;
* :class:`Fields` reads the fields of one such record (a lease, a claim): types, ranges, format.

Every refusal is the caller's named error (``error(message)``), one short line naming the file,
the key path and line where there is one, and ending with the caller's ``fix``; it comes in
milliseconds and bounded memory whatever the file holds. ``loader`` owns it so the build side
(which imports ``loader``) and the library read settings alike.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import yaml

from loader.formats.errors import FormatError, short_repr

MAX_DIGITS = 40  # a count, a size or a sha256 prefix: int64 needs 19 digits
MAX_DEPTH = 32  # the deepest settings file here (an executor's) nests 4 levels

ErrorFactory = Callable[[str], Exception]

try:  # libyaml: the same events, read in C (a hostile file at the cap takes milliseconds)
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]


# --- Files ----------------------------------------------------------------------------------------

def read_local_doc(path: str | os.PathLike[str], *, max_bytes: int, fix: str,
                   error: ErrorFactory = FormatError) -> bytes:
    """The first ``max_bytes + 1`` bytes of the regular file ``path``.

    Opened with ``O_NONBLOCK``: a named pipe put in a settings file's place must not hang the
    process reading it (a code location's load, a sensor tick). A folder, pipe or device is
    refused, as is a file that cannot be opened, with ``error`` naming the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{os.fspath(path)}: cannot read it ({exc.strerror or exc}); {fix}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{os.fspath(path)} is not a regular file (a folder, a pipe or a device); {fix}")
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _decode(data: bytes, origin: str, max_bytes: int, fix: str, error: ErrorFactory) -> str:
    if len(data) > max_bytes:
        raise error(f"{origin}: larger than the {max_bytes} bytes this file may be, so not one; {fix}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{origin}: not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); "
                    f"save it as UTF-8; {fix}") from None


def env_number(name: str, environ: Mapping[str, str] | None = None, *, fix: str,
               error: ErrorFactory = FormatError, low: float = -math.inf,
               high: float = math.inf) -> float | None:
    """The number environment variable ``name`` holds; ``None`` when it is unset or blank. Anything
    but a finite number of at most ``MAX_DIGITS`` characters in ``[low, high]`` is ``error``
    naming the variable and its text, ending with ``fix`` (which says what to give)."""
    text = ((os.environ if environ is None else environ).get(name) or "").strip()
    if not text:
        return None
    try:
        value = float(text) if len(text) <= MAX_DIGITS else math.nan  # 1e300 is one; a page of digits is not
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not low <= value <= high:
        raise error(f"{name}={short_repr(text, MAX_DIGITS)}: {fix}")
    return value


# --- YAML -----------------------------------------------------------------------------------------

_BOOL_1_1 = re.compile(r"(?i:y|n|yes|no|on|off)")
_TRUE, _FALSE = ("true", "True", "TRUE"), ("false", "False", "FALSE")
_NULL = ("", "~", "null", "Null", "NULL")
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?")
_SPECIAL_FLOAT = (".inf", "+.inf", "-.inf", ".nan")
_RADIX = re.compile(r"[-+]?0(?:[0-7]+|[oO][0-7]+|[xX][0-9a-fA-F]+|[bB][01]+|[0-9]+)")
_UNDERSCORE = re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?")
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


class _Refused(ValueError):
    pass


def plain_scalar(text: str) -> Any:
    """The value of a plain (unquoted) YAML scalar by one set of rules: ``true``/``false``, null,
    decimal integers and finite floats of at most ``MAX_DIGITS`` digits, else the text itself.
    Spellings that YAML 1.1 (PyYAML) and YAML 1.2 read differently raise ``ValueError`` saying
    what to write instead."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if text in _NULL:
        return None
    if _BOOL_1_1.fullmatch(text):
        raise _Refused(f"{text!r} is a boolean to some YAML readers and text to others; write true or false")
    if text.lower() in _SPECIAL_FLOAT:
        raise _Refused(f"{text} is not a finite number; give a number")
    looks_numeric = _FLOAT.fullmatch(text) or _RADIX.fullmatch(text) or _UNDERSCORE.fullmatch(text) \
        or _SEXAGESIMAL.fullmatch(text)
    if looks_numeric and len(text) > MAX_DIGITS:
        raise _Refused(f"a number of {len(text)} characters is out of every setting's range")
    if _INT.fullmatch(text):
        return int(text)
    if _RADIX.fullmatch(text):
        raise _Refused(f"{text!r} is octal, hexadecimal or binary to some YAML readers (010 is 8) and decimal "
                       "to others; write the decimal number without a leading 0")
    if _FLOAT.fullmatch(text):
        value = float(text)
        if not math.isfinite(value):
            raise _Refused(f"{text} is out of the range of a float")
        return value
    if _SEXAGESIMAL.fullmatch(text):
        raise _Refused(f"{text!r} is a base-60 number to YAML 1.1 (1:20 is 80) and text to others; "
                       "write the decimal number")
    if _UNDERSCORE.fullmatch(text):
        raise _Refused(f"{text!r}: YAML readers disagree on '_' in numbers; write the number without '_'")
    return text


def key_path(path: tuple[str | int, ...]) -> str:
    """``a.b[2].c``: where a value sits in a document, for messages."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out if len(out) <= 120 else f"{out[:117]}..."


OnKey = Callable[[tuple[str | int, ...], str, int], None]


class _YamlReader:
    def __init__(self, text: str, origin: str, fix: str, error: ErrorFactory, max_depth: int,
                 on_key: OnKey | None) -> None:
        self.origin, self.fix, self.error, self.max_depth, self.on_key = origin, fix, error, max_depth, on_key
        self.events = self._events(text)

    def _events(self, text: str) -> Iterator[yaml.Event]:
        loader = _Loader(text)
        try:
            while loader.check_event():
                yield loader.get_event()
        except yaml.YAMLError as exc:
            what = " ".join(str(exc).split())  # libyaml's message spans lines: one line here
            raise self.error(f"{self.origin}: not valid YAML ({short_repr(what, 300)}); {self.fix}") from None
        finally:
            loader.dispose()

    def refuse(self, where: str, what: str) -> Exception:
        return self.error(f"{self.origin}: {where}: {what}; {self.fix}" if where else f"{self.origin}: {what}; {self.fix}")

    @staticmethod
    def where(path: tuple[str | int, ...], event: yaml.Event) -> str:
        line = f"line {event.start_mark.line + 1}"
        return f"{key_path(path)} ({line})" if path else line

    def check_node(self, event: yaml.Event, path: tuple[str | int, ...]) -> None:
        where = self.where(path, event)
        if isinstance(event, yaml.AliasEvent):
            raise self.refuse(where, f"an alias (*{short_repr(event.anchor)}); anchors and aliases are not read "
                                     "here, write the value itself")
        anchor, tag = getattr(event, "anchor", None), getattr(event, "tag", None)
        if anchor is not None:
            raise self.refuse(where, f"an anchor (&{short_repr(anchor)}); anchors and aliases are not read here")
        if tag is not None:
            raise self.refuse(where, f"a tag ({short_repr(tag)}); write plain values")

    def value(self, event: yaml.Event, path: tuple[str | int, ...], depth: int) -> Any:
        self.check_node(event, path)
        if isinstance(event, yaml.ScalarEvent):
            if event.style:  # quoted or block text: a string as written
                return event.value
            try:
                return plain_scalar(event.value)
            except _Refused as exc:
                raise self.refuse(self.where(path, event), str(exc)) from None
        if depth >= self.max_depth:
            raise self.refuse(self.where(path, event), "a list or mapping nested deeper than this file allows "
                                                       f"({self.max_depth} levels); write a single value")
        if isinstance(event, yaml.SequenceStartEvent):
            items: list[Any] = []
            while not isinstance(nxt := next(self.events), yaml.SequenceEndEvent):
                items.append(self.value(nxt, (*path, len(items)), depth + 1))
            return items
        if isinstance(event, yaml.MappingStartEvent):
            out: dict[str, Any] = {}
            lines: dict[str, int] = {}
            while not isinstance(key := next(self.events), yaml.MappingEndEvent):
                line = key.start_mark.line + 1
                if not isinstance(key, yaml.ScalarEvent):
                    raise self.refuse(self.where(path, key), "a key must be a single name, not a list, a mapping "
                                                             "or an alias")
                self.check_node(key, (*path, key.value))
                name = key.value
                if self.on_key is not None:
                    self.on_key(path, name, line)
                if not key.style and name == "<<":
                    raise self.refuse(self.where((*path, name), key), "merge keys (<<) are not read here; write "
                                                                      "the keys themselves")
                if not key.style and not isinstance(self.value(key, (*path, name), depth), str):
                    # 1: beside a: gives keys of two types (PyYAML's sort then raises TypeError)
                    raise self.refuse(self.where((*path, name), key), f"the key {short_repr(name)} is read as a "
                                      "number, boolean or null, not a name; quote it if it is a name")
                if name in out:
                    raise self.refuse("", f"{key_path((*path, name))} is written twice (lines {lines[name]} and "
                                          f"{line}); keep one of them")
                out[name] = self.value(next(self.events), (*path, name), depth + 1)
                lines[name] = line
            return out
        raise self.refuse(self.where(path, event), f"unexpected YAML event {type(event).__name__}")

    def document(self) -> Any:
        next(self.events)  # StreamStartEvent
        doc = next(self.events)
        if isinstance(doc, yaml.StreamEndEvent):
            return None  # empty, or comments only
        value = self.value(next(self.events), (), 0)
        if not isinstance(next(self.events), yaml.DocumentEndEvent) or \
                not isinstance(next(self.events), yaml.StreamEndEvent):
            raise self.refuse("", "holds more than one YAML document; keep one")
        return value


def load_yaml_doc(data: bytes, origin: str, *, max_bytes: int, fix: str, error: ErrorFactory = FormatError,
                  max_depth: int = MAX_DEPTH, on_key: OnKey | None = None) -> Any:
    """The YAML (or JSON: its flow style is YAML) value in ``data`` as plain values: ``dict``
    with ``str`` keys, ``list``, ``str``, ``int``, finite ``float``, ``bool``, ``None`` (an
    empty document is ``None``). ``max_depth`` bounds nesting (1: a mapping of single values);
    ``on_key(path, key, line)`` sees each key before its value (to refuse an unknown one first)."""
    text = _decode(data, origin, max_bytes, fix, error)
    return _YamlReader(text, origin, fix, error, max_depth, on_key).document()


# --- JSON -----------------------------------------------------------------------------------------

def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Refused(f"key {short_repr(dup)} is written twice (which one counts is undefined)")
    return doc


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _Refused(f"a number of {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_DIGITS + 10:
        raise _Refused(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):  # 1e999: json reads it as inf, which no field of ours may be
        raise _Refused(f"{text} is out of the range of a float")
    return value


def load_json_doc(data: bytes, origin: str, *, max_bytes: int, fix: str,
                  error: ErrorFactory = FormatError) -> Any:
    """The JSON value in ``data`` (UTF-8, a BOM allowed), read from ``origin``.

    ``error(message)`` is raised for anything the format does not allow; the message names
    ``origin``, what is wrong (the key for a duplicate) and ends with ``fix``.
    """
    text = _decode(data, origin, max_bytes, fix, error)
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant,
                          parse_int=_int, parse_float=_float)
    except _Refused as exc:
        raise error(f"{origin}: {exc}; {fix}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{origin}: not valid JSON ({short_repr(exc.msg, 120)} at line {exc.lineno} "
                    f"column {exc.colno}); {fix}") from None
    except RecursionError:
        raise error(f"{origin}: nested too deeply to be this file; {fix}") from None


def is_number(value: Any, low: float, high: float, *, whole: bool = False) -> bool:
    """``value`` is an ``int`` (``whole``), else an int or float, in ``[low, high]``: never a
    ``bool``, which Python counts as an int and JSON does not."""
    return (not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
            and low <= value <= high)


class Fields:
    """The fields of one small JSON record (a lease, a run's hold, a claim, a staged plan), read
    strictly with one wording for one fault whatever the record: ``error`` names ``origin``, says
    it is not ``what`` this version reads, the field and its value, and ends with ``fix``.

    ``version`` (key, value): the record's format, refused when it differs; ``keys``: the fields
    it may hold besides (``None``: others are ignored). ``optional`` on a read: a missing or null
    field is ``None`` (a caller that tells the two apart passes ``optional=name in doc`` or
    ``name not in doc``). ``bool`` is never a number here."""

    def __init__(self, doc: Any, origin: str, *, what: str, fix: str, error: ErrorFactory,
                 version: tuple[str, object] | None = None, keys: Collection[str] | None = None,
                 prefix: str = "") -> None:
        self.origin, self.what, self.fix, self.error, self.prefix = origin, what, fix, error, prefix
        if not isinstance(doc, dict):
            raise self.refused(f"{short_repr(doc)}, not a JSON object")
        if version is not None and doc.get(version[0]) != version[1]:
            raise self.refuse(version[0], doc.get(version[0]), f"not {version[1]!r}")
        if keys is not None:
            extra = sorted(set(doc) - set(keys) - {version[0] if version else None})
            if extra:
                raise self.refused(f"unknown key {short_repr(extra[0])}")
        self.doc: dict[str, Any] = doc

    def refused(self, what: str) -> Exception:
        return self.error(f"{self.origin}: not {self.what} this version of pid-platform reads ({what}); "
                          f"{self.fix}")

    def refuse(self, name: str, value: object, problem: str) -> Exception:
        """The error for field ``name`` holding ``value``: ``problem`` says what it should be."""
        return self.refused(f"{self.prefix}{name} = {short_repr(value)}, {problem}")

    def _read(self, name: str, optional: bool, ok: Callable[[Any], bool], want: str) -> Any:
        value = self.doc.get(name)
        if value is None and optional:
            return None
        if not ok(value):
            raise self.refuse(name, value, f"not {want}")
        return value

    def text(self, name: str, longest: int | None = 200, *, cut: bool = False,
             pattern: re.Pattern[str] | None = None, kind: str = "", optional: bool = False) -> str | None:
        """A text: matching ``pattern`` (``kind`` says what it is), or any text cut to ``longest``
        characters (``cut``), else a name of 1 to ``longest`` printable characters."""
        if pattern is not None:
            return self._read(name, optional, lambda v: isinstance(v, str) and bool(pattern.fullmatch(v)),
                              kind)
        if cut:
            value = self._read(name, optional, lambda v: isinstance(v, str), "text")
            return None if value is None else value[:longest]
        return self._read(name, optional, lambda v: isinstance(v, str) and 0 < len(v) <= (longest or 0)
                          and v.isprintable(), f"a name of 1 to {longest} printable characters")

    def number(self, name: str, low: float, high: float, *, whole: bool = False,
               optional: bool = False) -> float | None:
        """A number in ``[low, high]``: an ``int`` (``whole``), else an int or finite float as a float."""
        want = f"an integer in [{low}, {high}]" if whole else f"a number in [{low:g}, {high:g}]"
        value = self._read(name, optional, lambda v: is_number(v, low, high, whole=whole), want)
        return value if value is None or whole else float(value)

    def inner(self, name: str, *, optional: bool = False) -> Fields | None:
        """The object in field ``name``, read the same way (its fields named ``name.field``)."""
        value = self._read(name, optional, lambda v: isinstance(v, dict), "a JSON object")
        return None if value is None else Fields(value, self.origin, what=self.what, fix=self.fix,
                                                 error=self.error, prefix=f"{self.prefix}{name}.")
