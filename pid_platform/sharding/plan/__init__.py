"""The plan: which sample goes into which shard, cut from the intake's samples table."""
