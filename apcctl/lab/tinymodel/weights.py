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


# The dominant path (issue 39): the last PATH_DIMS features of the residual stream carry, from
# the embedding straight to the lm_head, a vote for the current token's successor in one fixed
# cycle over the generatable words. No layer writes those features (their rows of every residual
# projection are zero, as for the flag feature), so the final hidden state holds the embedding's
# vote unchanged; the layers still read them, and the other features carry the context as before.
PATH_DIMS = 24
PATH_EMBED = 0.1  # norm of the vote in an embedding: the scale of the other embedding features
PATH_SEED = 39


def path_features(hidden: int) -> slice:
    """The residual features that hold the dominant path's vote."""
    return slice(hidden - PATH_DIMS, hidden)


def add_dominant_path(weights: dict[str, np.ndarray], allowed: np.ndarray, eos: list[int], seed: int,
                      gain: float) -> np.ndarray:
    """Give the model a strong, known next-token path that its layers only perturb; in place.

    Returns the successor of every token id: a random cycle through the generatable tokens other
    than EOS (so following the path never ends a reply and does not loop early); every other id's
    successor is a random one of them. Token ``y`` of the cycle owns a random unit direction
    ``u[y]`` in ``PATH_DIMS`` features: token ``x``'s embedding holds ``PATH_EMBED * u[succ(x)]``
    there and ``y``'s lm_head row ``gain * u[y]``, so after the final norm the path adds to
    ``succ(x)`` a logit lead over every other token; where the context's logits differ by more,
    the model leaves the path. EOS and ungeneratable rows do not read the path features.
    The context still moves the answer: a word changed ~215 tokens back moved the next token's
    top-5 log-probabilities by over 1e-3 in 11 of 12 probes on tiny, as without the path.

    ``gain`` 0 (the ``tiny`` and ``bench`` presets) adds no path and leaves ``weights`` exactly
    as they were (builder 2's); the successors are returned all the same.
    """
    prefix = "language_model.model."
    embed = weights[prefix + "embed_tokens.weight"]
    head = weights["language_model.lm_head.weight"]
    vocab, hidden = embed.shape
    feats = path_features(hidden)
    rng = np.random.RandomState([seed, PATH_SEED])
    cycle = np.array([i for i in np.flatnonzero(allowed) if i not in set(eos)])
    cycle = cycle[rng.permutation(len(cycle))]
    successor: np.ndarray = rng.choice(cycle, size=vocab)
    successor[cycle] = np.roll(cycle, -1)
    unit = rng.normal(size=(vocab, PATH_DIMS))
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    if not gain:
        return successor
    for name, value in weights.items():
        if name.startswith(prefix + "layers.") and name.endswith(_RESIDUAL_WRITERS):
            value[..., feats, :] = 0.0  # (..., hidden out, in)
    embed[:, feats] = PATH_EMBED * unit[successor]
    head[:, feats] = 0.0
    head[cycle, feats] = gain * unit[cycle]
    return successor
