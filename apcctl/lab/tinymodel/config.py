"""config.json of a random ``glm5_next`` model, and what its caches weigh per sequence.

Bench cache bytes per token (float32; latent and index are what a lineage snapshot holds):

* MLA latent KV: 4 attention layers x 2048 x 4 B = 32,768 B/token.
* Indexer (2 full layers): validity flag 1 B + pooled keys 32 x 4 B / 16 = 8 B, so
  2 x 9 = 18 B/token (plus at most 15 buffered tail tokens of 2 x 32 x 4 B per layer).
* Latent + index = 32,786 B/token, i.e. 537,165,824 B (537 MB) at 16,384 tokens.
* The derived per-head "projected" cache (kept only up to 32,768 tokens) adds
  4 layers x 2 heads x (16 + 16) x 4 B = 1,024 B/token (16.8 MB at 16k).
* KDA state is fixed-size: per linear layer a (3 x 192) conv window and a 2 x 32 x 32
  recurrent state, 10,496 B.

Tiny, for comparison: latent 2 x 32 x 4 = 256 B, index 1 + 16 x 4 / 16 = 5 B,
projected 2 x 2 x (16 + 16) x 4 = 512 B per token; the same 10,496 B per KDA layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apcctl.lab.tinymodel.presets import Preset
from apcctl.lab.tinymodel.vocab import EOS_TOKENS

# glm5_next keeps the derived per-head K/V only below this many tokens
# (mlx_vlm/models/glm5_next/language.py, _MAX_PROJECTED_PREFILL_TOKENS).
MAX_PROJECTED_TOKENS = 32768

_LAYER_TYPES = {"l": "linear_attention", "a": "deepseek_sparse_attention", "s": "deepseek_sparse_attention"}


def make_config(preset: Preset, token_ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    """config.json with every per-layer list written out (the defaults are wrong at tiny depth)."""
    n = len(preset.layers)
    eos = [token_ids[t] for t in EOS_TOKENS]
    pad = token_ids["<|endoftext|>"]
    text = {
        "model_type": "glm5_next_text",
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden,
        "intermediate_size": preset.intermediate,
        "moe_intermediate_size": preset.moe_intermediate,
        "num_hidden_layers": n,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.heads,
        "n_shared_experts": 1,
        "n_routed_experts": preset.routed_experts,
        "num_experts_per_tok": preset.experts_per_tok,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": preset.kv_lora_rank,
        "q_lora_rank": preset.q_lora_rank,
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": preset.qk_nope_head_dim,
        "v_head_dim": preset.v_head_dim,
        "mla_use_nope": True,
        "index_n_heads": preset.index_n_heads,
        "index_head_dim": preset.index_head_dim,
        "index_topk": preset.index_topk,
        "index_kpool": preset.index_kpool,
        "layer_types": [_LAYER_TYPES[c] for c in preset.layers],
        "indexer_types": ["shared" if c == "s" else "full" for c in preset.layers],
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
        "linear_attn_config": {
            "head_dim": preset.linear_head_dim,
            "num_heads": preset.linear_heads,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "safe_gate": True,
        },
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    vision = {
        "model_type": "glm5_next_vision",
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "projection_intermediate_size": 64,
        "out_hidden_size": preset.hidden,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
    }
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": token_ids["<|image|>"],
        "video_token_id": token_ids["<|video|>"],
        "image_start_token_id": token_ids["<|begin_of_image|>"],
        "image_end_token_id": token_ids["<|end_of_image|>"],
        "video_start_token_id": token_ids["<|begin_of_video|>"],
        "video_end_token_id": token_ids["<|end_of_video|>"],
        "eos_token_id": eos,
        "pad_token_id": pad,
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


@dataclass(frozen=True)
class CacheBytes:
    """Logical cache bytes for one sequence of ``tokens`` tokens, summed over layers."""

    tokens: int
    latent: int  # MLA latent KV (cache[0] of every attention layer)
    index: int  # indexer validity flags + pooled keys + buffered tail (full-indexer layers)
    projected: int  # derived per-head K/V, only kept up to MAX_PROJECTED_TOKENS

    @property
    def latent_and_index(self) -> int:
        return self.latent + self.index


def cache_bytes(config: dict[str, Any], tokens: int, dtype_bytes: int = 4) -> CacheBytes:
    """What the attention-layer caches of a prefilled prompt weigh (no step padding)."""
    text = config.get("text_config", config)
    latent = index = projected = 0
    kpool, head_dim = text["index_kpool"], text["index_head_dim"]
    for kind, indexer in zip(text["layer_types"], text["indexer_types"]):
        if kind == "linear_attention":
            continue
        latent += tokens * text["kv_lora_rank"] * dtype_bytes
        if tokens <= MAX_PROJECTED_TOKENS:
            projected += tokens * text["num_attention_heads"] * (
                text["qk_nope_head_dim"] + text["v_head_dim"]
            ) * dtype_bytes
        if indexer == "full":
            pooled, tail = divmod(tokens, kpool)
            index += tokens  # one bool validity flag per token
            index += pooled * head_dim * dtype_bytes  # compressed pool keys
            index += tail * 2 * head_dim * dtype_bytes  # buffered keys + gates of the tail
    return CacheBytes(tokens, latent, index, projected)
