"""LeRobot v3 datasets: one MP4 sidecar per dataset (a dynamic partition each), its blocking
validity check, and its publication, serialized through the ``lerobot_publish`` pool."""
