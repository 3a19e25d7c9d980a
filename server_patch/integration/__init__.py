"""The lineage cache wired into mlx-vlm 0.7.10: coordinator, runtime, anchors, timings."""
