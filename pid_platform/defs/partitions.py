"""One partition per source (a raw drop), so a new source is built without touching the others.

The sensor in ``automation/sensors.py`` adds a partition for each source it finds under the raw root.
"""

import dagster as dg

SOURCES = "sources"

sources_partitions = dg.DynamicPartitionsDefinition(name=SOURCES)
