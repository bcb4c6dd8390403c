"""Names shared by the asset modules: groups in the UI, and the pool of the heavy steps."""

BUILD_GROUP = "webdataset_build"
CATALOG_GROUP = "catalog"
# The steps that read every raw byte share one pool: a limit on it (instance settings) bounds
# how many sources are read and sharded at once.
BUILD_POOL = "pid_build"
