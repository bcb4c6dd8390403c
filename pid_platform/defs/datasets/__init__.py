"""Logical datasets (weighted mixtures or unions of sources): one asset each, downstream of its
sources' manifests, with its shares as metadata and a blocking check on its sources."""
