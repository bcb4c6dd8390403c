"""Owners and tags of every asset, set in one place per group (as dagster-open-platform does): the
catalog's Owner column and its tag filters then find each asset by team and domain.
"""

from __future__ import annotations

import dagster as dg

from pid_platform.defs.groups import BUILD_GROUP, CATALOG_GROUP
from pid_platform.defs.lerobot.partitions import LEROBOT_GROUP

OWNERS = ["team:data-platform"]
DOMAIN_BY_GROUP = {BUILD_GROUP: "training-data", CATALOG_GROUP: "training-data", LEROBOT_GROUP: "robot-learning"}


def owned(spec: dg.AssetSpec) -> dg.AssetSpec:
    """``spec`` with the project's owners and its group's domain tag (``domain``)."""
    domain = DOMAIN_BY_GROUP.get(spec.group_name or "")
    if domain is None:
        raise ValueError(f"asset {spec.key.to_user_string()} is in group {spec.group_name!r}, which has no domain in "
                         f"pid_platform/defs/ownership.py; add the group to DOMAIN_BY_GROUP")
    return spec.replace_attributes(owners=OWNERS, tags={**spec.tags, "domain": domain})


def with_owners(defs: dg.Definitions) -> dg.Definitions:
    # Observable source assets (SourceAsset) take no owners in 1.13; they carry their domain tag
    # in their own decorator (domain_tags below) and are left as they are here.
    return defs.permissive_map_resolved_asset_specs(func=owned, selection=None)


def domain_tags(group: str) -> dict[str, str]:
    """The tags of a source asset of ``group`` (see ``with_owners``)."""
    return {"domain": DOMAIN_BY_GROUP[group]}
