"""On-disk contracts shared by the build side (writer) and the load side (reader)."""
