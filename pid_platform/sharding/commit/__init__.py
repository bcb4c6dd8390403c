"""The commit: manifests, the recorded state, and the switch that publishes a version."""
