"""Reading a small JSON document that someone else wrote (``catalog.json``, LeRobot's ``info.json``).

Python's ``json`` takes more than the format should: ``NaN`` and ``Infinity``, a key written twice
(the last one wins, silently), numbers of any length (past 4300 digits ``int`` raises a bare
``ValueError``), nesting until the interpreter's recursion limit (``RecursionError``), any size.
:func:`load_json_doc` refuses each of these with the caller's named error, so a hostile file
ends in one clear message, quickly and in bounded memory, never in a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from loader.formats.errors import FormatError, short_repr

MAX_DIGITS = 40  # a count, a size or a sha256 prefix: int64 needs 19 digits


class _Refused(ValueError):
    pass


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
                  error: Callable[[str], Exception] = FormatError) -> Any:
    """The JSON value in ``data`` (UTF-8, a BOM allowed), read from ``origin``.

    ``error(message)`` is raised for anything the format does not allow; the message names
    ``origin``, what is wrong (the key for a duplicate) and ends with ``fix``.
    """
    if len(data) > max_bytes:
        raise error(f"{origin}: {len(data)} bytes is larger than the {max_bytes} this file may be; {fix}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{origin}: not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); {fix}") from None
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
