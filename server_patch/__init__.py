"""The lineage prompt cache patch for mlx-vlm 0.7.10.

The policy (``server_patch.lineage``) is plain Python over sized state handles; the mlx
plumbing, disk tier and patch overlay live beside it and import mlx-vlm only where they must.
"""

PATCH_VERSION = "0.1.0"
MLX_VLM_VERSION = "0.7.10"
