"""Training-time reader for pid-platform datasets. Never imports dagster."""
