"""LeRobot v3 datasets: metadata, MP4 box indexes, sidecars, streaming reader."""
