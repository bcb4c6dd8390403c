"""A source's build as tasks any scheduler can run (the datatrove model).

``plan`` -> write task ``I`` of ``N`` (each a contiguous range of shards) -> ``commit``, with
optional intake tasks (``I`` of ``N``: a slice of the listing, balanced by file bytes) before the
plan; one module per stage, each entry (``run_plan``, ``run_intake_task``, ``run_write_task``,
``run_commit``) taking a folder or an ``s3://`` output: ``plan.py``, ``write.py``, ``commit.py``,
meeting in ``staging.py`` (the staged plan and where each output keeps it) and reading the
published version of a bucket through ``published.py``; ``records.py`` (the staging seam over
``loader/io/objects.py`` and the completion records kept there), ``outcomes.py`` (what they
report). Every task writes only its own outputs into the
staged version, then its completion record; a task that finds its record does nothing. The
bytes of a build do not depend on ``N``: they equal ``run.py``'s one-process build, which runs
the same stages in one process (write task 0 of 1).
"""
