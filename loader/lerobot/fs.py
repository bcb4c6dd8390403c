"""Moved to ``loader.io.roots`` (``loader.io`` owns roots, file identities and listings); this
name stays importable for code written against it."""

from loader.io.roots import *  # noqa: F403
from loader.io.roots import __all__  # noqa: F401
