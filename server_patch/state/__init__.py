"""mlx plumbing of the lineage cache: cache-class registry, layouts, state handles."""
