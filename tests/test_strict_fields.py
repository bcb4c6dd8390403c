"""``strict_doc.Fields``: the one reader of a build record's fields (lease, run hold, claim,
staged plan). Each fault is refused with one wording naming the file, the field and its value;
the refusals the records' own tests do not reach are checked here on the reader itself."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from loader.formats.errors import FormatError
from loader.formats.strict_doc import Fields, env_number

WHERE = "s3://b/photos/.pid-build/x.json"


def _fields(doc: object, **kw: object) -> Fields:
    return Fields(doc, WHERE, what="an x record", fix="delete it", error=FormatError,
                  version=("x_version", 1), **kw)


@pytest.mark.parametrize(("doc", "read", "says"), [
    ({"x_version": 1, "name": "a\nb"}, lambda f: f.text("name"),
     "name = 'a\\nb', not a name of 1 to 200 printable characters"),
    ({"x_version": 1, "name": ""}, lambda f: f.text("name"), "name = '', not a name of 1 to 200"),
    ({"x_version": 1, "id": "../x"},
     lambda f: f.text("id", pattern=re.compile("[0-9a-f]{8}"), kind="an id"), "id = '../x', not an id"),
    ({"x_version": 1, "n": True}, lambda f: f.number("n", 0, 10), "n = True, not a number in [0, 10]"),
    ({"x_version": 1, "n": 1.0}, lambda f: f.number("n", 0, 10, whole=True),
     "n = 1.0, not an integer in [0, 10]"),
    ({"x_version": 1, "n": None}, lambda f: f.number("n", 0, 10, optional="n" not in f.doc),
     "n = None, not a number in [0, 10]"),
    ({"x_version": 1, "inner": [1]}, lambda f: f.inner("inner"), "inner = [1], not a JSON object"),
    ({"x_version": 1, "inner": {"id": 3}}, lambda f: f.inner("inner").text("id", None, cut=True),
     "inner.id = 3, not text"),
    ({"x_version": True}, lambda f: None, None),  # True == 1: accepted, as the records always did
    ({"x_version": 2}, lambda f: None, "x_version = 2, not 1"),
    ("text", lambda f: None, "'text', not a JSON object"),
])
def test_each_fault_is_refused_naming_the_file_the_field_and_the_value(
        doc: object, read: Callable[[Fields], object], says: str | None) -> None:
    if says is None:
        read(_fields(doc))
        return
    with pytest.raises(FormatError) as exc:
        read(_fields(doc))
    message = str(exc.value)
    assert message.startswith(f"{WHERE}: not an x record this version of pid-platform reads (")
    assert says in message
    assert message.endswith("; delete it"), message


def test_optional_fields_and_unknown_keys() -> None:
    f = _fields({"x_version": 1, "n": None}, keys=("n", "t"))
    assert f.number("n", 0, 1, optional=True) is None and f.text("t", optional=True) is None
    assert _fields({"x_version": 1, "t": "abcdef"}).text("t", 3, cut=True) == "abc"
    with pytest.raises(FormatError, match=r"\(unknown key 'owner'\); delete it"):
        _fields({"x_version": 1, "owner": "x"}, keys=("n",))


@pytest.mark.parametrize("text", ["soon", "nan", "inf", "1e400", "9" * 41, "5", "1e300"])
def test_an_env_number_that_is_not_a_finite_short_number_in_range_is_refused_naming_it(text: str) -> None:
    with pytest.raises(FormatError, match=r"^PID_X_S='.*: give seconds from 10 to 1e\+06$"):
        env_number("PID_X_S", {"PID_X_S": text}, fix="give seconds from 10 to 1e+06", low=10, high=1e6)


def test_an_env_number_unset_or_blank_is_none_and_a_number_in_range_is_read() -> None:
    assert env_number("PID_X_S", {}, fix="") is None
    assert env_number("PID_X_S", {"PID_X_S": "  "}, fix="") is None
    assert env_number("PID_X_S", {"PID_X_S": " 60 "}, fix="", low=10, high=60) == 60.0
