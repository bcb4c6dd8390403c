"""Errors raised while indexing an MP4 file from its boxes."""

from __future__ import annotations


class Mp4FormatError(ValueError):
    """The file is not an MP4 this indexer can read (bad or missing boxes, fragmented, no video).

    The message names the file and says what was found.
    """


class EditListError(Mp4FormatError):
    """The video track's edit list is something other than one rate-1 media edit, optionally
    preceded by one empty edit: presentation times could not be mapped without misaligning frames."""
