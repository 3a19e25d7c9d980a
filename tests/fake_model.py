"""A kilobyte-sized glm5_next language model built in-process from real mlx modules.

Layout matches the real model's kinds: KDA layers (ArraysCache), a sparse-attention layer
with its own indexer (CacheList of 4 with PoolingCache and the derived projected cache) and a
shared-indexer layer (CacheList of 2). Random weights, float32, deterministic by seed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import LanguageModel

PATTERN = ["linear_attention", "linear_attention", "deepseek_sparse_attention",
           "linear_attention", "deepseek_sparse_attention"]
INDEXERS = ["full", "full", "full", "full", "shared"]


def tiny_config(**overrides) -> TextConfig:
    args = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=len(PATTERN), num_nextn_predict_layers=0, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=16,
        index_topk=32, index_head_dim=16, index_n_heads=2, index_kpool=16,
        layer_types=list(PATTERN), indexer_types=list(INDEXERS),
        mlp_layer_types=["dense"] * len(PATTERN),
        linear_attn_config={"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4},
        tie_word_embeddings=False, pad_token_id=0,
    )
    args.update(overrides)
    return TextConfig(**args)


def tiny_language_model(seed: int = 0) -> LanguageModel:
    model = LanguageModel(tiny_config())
    rng = np.random.RandomState(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        if "norm" in name and name.endswith("weight"):
            arr = np.ones(value.shape, np.float32)
        elif name.endswith("A_log"):
            arr = np.log(rng.uniform(1, 16, value.shape)).astype(np.float32)
        elif value.ndim >= 2:
            arr = rng.normal(0, 0.02, value.shape).astype(np.float32)
        else:
            arr = np.zeros(value.shape, np.float32)
        params.append((name, mx.array(arr)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def prefill(model: LanguageModel, cache: list, tokens: np.ndarray, step: int = 64) -> mx.array:
    """Feed ``tokens`` in chunks of ``step``; returns last-position logits."""
    logits = None
    for start in range(0, len(tokens), step):
        chunk = mx.array(tokens[start:start + step][None])
        logits = model(chunk, cache=cache).logits[:, -1]
        mx.eval(logits, [c.state for c in cache])
    return logits


def random_tokens(n: int, seed: int = 1) -> np.ndarray:
    """``n`` deterministic token ids inside the tiny vocabulary."""
    return np.random.RandomState(seed).randint(1, 500, n).astype(np.int32)
