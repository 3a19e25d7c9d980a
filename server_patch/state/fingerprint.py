"""A model fingerprint for disk files: config plus a sample of every weight, not the path.

Hashing every byte of a 100 GB model at startup would cost minutes, so each parameter
contributes its name, shape, dtype and its first and last elements. Any re-initialisation,
fine-tune or quantisation change moves the hash; a rebuilt model at the same path does too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

_SAMPLE = 2048


def _config_dict(model: Any) -> dict:
    config = getattr(model, "args", None) or getattr(model, "config", None)
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(vars(config))


def model_fingerprint(model: Any) -> str:
    """sha256 over the model's config and a head/tail sample of each parameter."""
    digest = hashlib.sha256()
    digest.update(json.dumps(_config_dict(model), sort_keys=True, default=str).encode())
    for name, value in tree_flatten(model.parameters()):
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        flat = value.reshape(-1)
        sample = flat[:_SAMPLE] if flat.size <= 2 * _SAMPLE else mx.concatenate(
            [flat[:_SAMPLE], flat[-_SAMPLE:]])
        if sample.dtype == mx.bfloat16:
            sample = sample.astype(mx.float32)
        digest.update(bytes(memoryview(sample)))
    return digest.hexdigest()
