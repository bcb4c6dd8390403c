"""The write task: the planned twin tars, their digests and key indexes."""
