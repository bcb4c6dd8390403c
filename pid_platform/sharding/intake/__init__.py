"""The intake task: list a source, validate its files (reusing cached outcomes), keep the samples."""
