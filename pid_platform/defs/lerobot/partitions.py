"""One partition per LeRobot v3 dataset root, added by ``lerobot_datasets_sensor``."""

import dagster as dg

LEROBOT_DATASETS = "lerobot_datasets"
LEROBOT_GROUP = "lerobot"

lerobot_datasets_partitions = dg.DynamicPartitionsDefinition(name=LEROBOT_DATASETS)
