"""Named exceptions for format problems; every message says which file and what to do."""


class FormatError(ValueError):
    """A file does not follow one of the pid-platform on-disk contracts."""


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for messages about values others wrote.

    A value read from a hostile file can be megabytes long, or an integer too large for ``repr``
    (Python refuses to print more than 4300 digits): a message must stay one short line.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value) if not isinstance(value, (list, dict, tuple, set)) or len(value) < 64 else (
            f"<a {type(value).__name__} of {len(value)} items>")
    except (ValueError, RecursionError):
        text = f"<a {type(value).__name__} too large to print>"
    return text if len(text) <= limit else f"{text[: limit - 3]}...({len(text)} characters)"
