"""The demo: sample sources and datasets, a local S3 server, and the commands that build them."""
