"""Synchronized twin-tar streaming: discovery, expansion, shard lists, resume, pipeline."""
