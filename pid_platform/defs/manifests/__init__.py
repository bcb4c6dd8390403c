"""Key indexes, wdinfo.json manifests and the dataset catalog."""
