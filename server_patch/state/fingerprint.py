"""A model fingerprint for disk files: config, every byte of the weight files, a sample of the
loaded parameters, the KV dtype and the versions of the software that computes the state; not
the path.

The weight files are hashed in full (``weights_hash``: xxh3-128, cached by each file's stat, so
only a changed file is read again): any re-initialisation, fine-tune, quantisation change or a
single scaled row moves the fingerprint, and a rebuilt model at the same path does too. The
loaded parameters add their names, shapes, dtypes and first and last elements (an adapter
applied in memory moves those). Another mlx, mlx-vlm or patch version may compute (or lay out)
the cache differently, and a different activation dtype gives KV of another dtype, so those are
in the fingerprint as well: a file written under any of them is never restored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import metadata
from typing import Any

_SAMPLE = 2048


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def software_identity() -> dict[str, str]:
    """The versions that decide how cache state is computed and stored (no MLX import)."""
    from server_patch import PATCH_VERSION

    return {"mlx": _version("mlx"), "mlx_vlm": _version("mlx-vlm"), "patch": PATCH_VERSION}


def _config_dict(model: Any) -> dict:
    config = getattr(model, "args", None) or getattr(model, "config", None)
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(vars(config))


def kv_dtype(model: Any) -> str:
    """The dtype the model's attention K/V come out in: that of its embedded activations.

    One embedding lookup of token 0 (microseconds); a quantised embedding dequantises to its
    scales' dtype, which is what the projections then produce. "unknown" if it has none.
    """
    import mlx.core as mx
    import mlx.nn as nn

    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            out = module(mx.array([0]))
            return str(out.dtype).removeprefix("mlx.core.")
    return "unknown"


def model_fingerprint(model: Any, weights: str | None = None) -> str:
    """sha256 over the config, the weight files' digest (``weights_hash.weights_digest``), a
    head/tail sample of each parameter, the KV dtype and versions."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    digest = hashlib.sha256()
    if weights is not None:
        digest.update(f"weights:{weights}".encode())
    digest.update(json.dumps(_config_dict(model), sort_keys=True, default=str).encode())
    identity = {**software_identity(), "kv_dtype": kv_dtype(model)}
    digest.update(json.dumps(identity, sort_keys=True).encode())
    for name, value in tree_flatten(model.parameters()):
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        flat = value.reshape(-1)
        sample = flat[:_SAMPLE] if flat.size <= 2 * _SAMPLE else mx.concatenate(
            [flat[:_SAMPLE], flat[-_SAMPLE:]])
        if sample.dtype == mx.bfloat16:
            sample = sample.astype(mx.float32)
        digest.update(bytes(memoryview(sample)))
    return digest.hexdigest()
