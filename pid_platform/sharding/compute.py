"""``pyarrow.compute``, imported on first use.

Importing it builds ~290 function wrappers (60 ms), which every task process would pay at start
though only listings, plans and commits compute: build modules take ``pc`` from here.
"""

from __future__ import annotations


class _Compute:
    def __getattr__(self, name: str):
        import pyarrow.compute

        return getattr(pyarrow.compute, name)


pc = _Compute()
