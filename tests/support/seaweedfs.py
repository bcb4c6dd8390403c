"""Placeholder: the SeaweedFS fixture is being written (see tests/support/seaweedfs.py owner)."""
