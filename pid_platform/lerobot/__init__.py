"""LeRobot sidecars on the build side: publish a built MP4 sidecar, and the ``pid-build-mp4-sidecar`` CLI.

The sidecar itself (format, build, validation) lives in ``loader.lerobot.sidecar``; this package
only moves finished, complete sidecars to where training finds them, reads them back from there
(``fetch_back``) and streams one batch through them (``stream_check``) to prove a publish usable.
"""
