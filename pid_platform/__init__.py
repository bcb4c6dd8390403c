"""Build side of pid-platform: a Dagster code location plus the plain-Python build it runs."""
