"""The build itself, free of Dagster so the CLI and the assets run the same code path."""
