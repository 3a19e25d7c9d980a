"""Deterministic random float32 weights of a ``glm5_next`` model, kept to generatable tokens.

Weights are float32 (bfloat16 MoE ``gather_mm`` fails on the CPU backend) and use the
MLX-native parameter names, so ``sanitize`` is the identity on them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# The text model's projections that write the residual stream (attention and MLP outputs).
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight")


def init_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Deterministic float32 weights under the model's own parameter names.

    The default MLX init leaves the router and hyper-connection matrices at zero, which
    makes every expert and mix identical, so everything is redrawn here: matrices
    N(0, 0.02), except the projections that write the residual stream, N(0, 0.1); 1-D
    weights/scales 1, A_log = log U(1, 16), other vectors 0. At 0.02 throughout, a word
    changed 200 tokens back moved the next token's top log-probabilities by ~1e-4 (under the
    1e-3 the warm-equals-cold comparisons allow, in 10 of 12 probes); at 0.1 by ~3e-3
    (11 of 12 over 1e-3), while a chunked prefill still matches a whole one to ~1e-7.
    """
    from mlx.utils import tree_flatten
    from mlx_vlm.models.glm5_next import Model, ModelConfig

    model = Model(ModelConfig.from_dict(json.loads(json.dumps(config))))
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    rng = np.random.RandomState(seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            value = np.log(rng.uniform(1.0, 16.0, size=shape))
        elif len(shape) >= 2:
            writer = name.startswith("language_model.model.layers.") and name.endswith(_RESIDUAL_WRITERS)
            value = rng.normal(0.0, 0.1 if writer else 0.02, size=shape)
        elif leaf in ("weight", "scale"):
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        weights[name] = value.astype(np.float32)
    return weights


# The hidden feature that keeps tokens the model must not sample out of reach (see
# :func:`keep_to_tokens`): its value in every embedding, and the lm_head weight reading it.
FLAG_FEATURE, FLAG_VALUE, FLAG_LOGIT = 0, 0.02, -2000.0


def keep_to_tokens(weights: dict[str, np.ndarray], allowed: np.ndarray) -> None:
    """Make the model sample only ``allowed`` ids (a boolean mask over the vocabulary), in place.

    Every embedding carries ``FLAG_VALUE`` in feature ``FLAG_FEATURE`` and no layer writes
    into that feature (its row of each residual projection is zero), so the residual keeps
    a positive value there: hyper-connections mix streams with non-negative weights. After
    the final RMSNorm it is still positive, and the lm_head rows of disallowed tokens read
    only it, with weight ``FLAG_LOGIT``: their logits sit far below every allowed one, greedy
    or sampled. Allowed rows ignore the feature, so their logits are the random model's.
    """
    prefix = "language_model.model."
    weights[prefix + "embed_tokens.weight"][:, FLAG_FEATURE] = FLAG_VALUE
    for name, value in weights.items():
        if name.startswith(prefix + "layers.") and name.endswith(_RESIDUAL_WRITERS):
            value[..., FLAG_FEATURE, :] = 0.0  # (..., hidden out, in)
    head = weights["language_model.lm_head.weight"]
    head[:, FLAG_FEATURE] = 0.0
    head[~allowed] = 0.0
    head[~allowed, FLAG_FEATURE] = FLAG_LOGIT
