"""Twin-tar shards of a source."""
