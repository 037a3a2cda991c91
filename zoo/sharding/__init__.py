"""Sharding: meshes, layouts and logical-axis rules, placement, per-device compute of stored
weights (``shard_ops``), typed cache containers with their axes, the abstract mesh of a plan."""
