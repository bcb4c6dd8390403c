"""``pyarrow.compute``, imported on first use, and the checks built on it that several build
modules share.

Importing it builds ~290 function wrappers (60 ms), which every task process would pay at start
though only listings, plans and commits compute: build modules take ``pc`` from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa


class _Compute:
    def __getattr__(self, name: str):
        import pyarrow.compute

        return getattr(pyarrow.compute, name)


pc = _Compute()


def ascending(values: pa.Array | pa.ChunkedArray) -> bool:
    """Whether ``values`` are strictly ascending (so each is there once)."""
    return len(values) < 2 or bool(pc.all(pc.less(values[:-1], values[1:])).as_py())
