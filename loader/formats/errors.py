"""Named exceptions for format problems; every message says which file and what to do."""


class FormatError(ValueError):
    """A file does not follow one of the pid-platform on-disk contracts."""
