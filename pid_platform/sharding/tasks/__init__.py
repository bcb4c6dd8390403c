"""A source's build as tasks any scheduler can run (the datatrove model).

``plan`` -> write task ``I`` of ``N`` (each a contiguous range of shards) -> ``commit``, with
optional intake tasks (``I`` of ``N``: a slice of the listing, balanced by file bytes) before the plan. Every task writes
only its own outputs into the staging folder of the version being built, then its completion
record (``records``); a task that finds its record does nothing. The bytes of a build do not
depend on ``N``: they equal ``run.run_build``'s, which runs the same tasks in one process (task 0 of 1).
"""
