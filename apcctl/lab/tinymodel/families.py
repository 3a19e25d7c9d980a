"""Tiny random language models of other mlx-vlm families, built from each family's own config class.

The lineage cache's restore rules are per cache class, but whether a family's layers really are
what their class says (append-only KV, a snapshot recurrent state, a sliding window) is only
true where it is tested. ``build_language_model(family)`` sizes the family's config down
(hidden 64, 4 layers, a layer pattern that holds every cache kind the family has, sliding
windows of 8 tokens so they really rotate in a short test), builds ``Model(config)`` the way
``mlx_vlm.utils.load_model`` does, and returns its language model in float32 with
deterministic random weights. Nothing is downloaded or written.

``not_built()`` lists the families beyond plain KV layers (the lineage cache's path) that are not
built here, each with the reason; the conformance test asserts that list, so a family is never
silently skipped.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

#: Sizes every family gets where its config has the field.
COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
    "sliding_window": 8, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0, "attention_bias": False,
    "rope_scaling": None,
}

#: LongCat-Flash's MLA and shortcut-MoE sizes (shared by its dense, ngram and sparse variants).
_LONGCAT: dict[str, Any] = {
    "zero_expert_type": "identity", "ffn_hidden_size": 128, "moe_topk": 2,
    "expert_ffn_hidden_size": 32, "zero_expert_num": 2, "num_layers": 2, "kv_lora_rank": 16,
    "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "routed_scaling_factor": 1.0, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
}

#: Per family: what COMMON does not cover (layer patterns that mix the cache kinds, state sizes).
FAMILIES: dict[str, dict[str, Any]] = {
    # Gated DeltaNet hybrids: every 4th layer is full attention (full_attention_interval=4).
    "qwen3_5": {},
    "qwen3_5_text": {},
    "qwen3_5_moe": {},
    "qwen3_5_moe_text": {},
    "qwen3_next": {"decoder_sparse_step": 1, "mlp_only_layers": [], "partial_rotary_factor": 0.25},
    # Mamba + attention hybrids.
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2},
    "nemotron_h": {"hybrid_override_pattern": "M*M*", "mamba_num_heads": 8, "mamba_head_dim": 16,
                   "mamba_proj_bias": False, "ssm_state_size": 8, "conv_kernel": 4, "n_groups": 1,
                   "mlp_bias": False, "use_bias": False, "use_conv_bias": True},
    "falcon_h1": {"mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 8, "mamba_n_heads": 4,
                  "mamba_chunk_size": 16},
    "plamo2": {"hidden_size_per_head": 16, "attention_window_size": 8, "mamba_d_state": 8,
               "mamba_num_heads": 4, "mamba_chunk_size": 16},
    "lfm2": {"full_attn_idxs": [1, 3], "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_ff_dim": 128, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False},
    # Recurrent-only and recurrent + sliding window.
    "mamba": {"state_size": 8, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
              "time_step_rank": 8},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 8, "conv_kernel": 4, "n_groups": 1,
               "use_bias": False, "use_conv_bias": True, "time_step_limit": [0.0, 1e9],
               "time_step_rank": 8, "expand": 2},
    "rwkv7": {"head_dim": 16, "a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8,
              "decay_low_rank_dim": 8},
    "recurrent_gemma": {"conv1d_width": 4, "logits_soft_cap": 30.0, "attention_window_size": 8,
                        "block_types": ["recurrent", "recurrent", "attention"], "lru_width": 64},
    # Sliding-window families (RotatingKVCache layers next to full KVCache layers).
    "gpt_oss": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "cohere2": {},
    "olmo3": {"layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                              "full_attention"]},
    "gemma3_text": {"sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    # More hybrids.
    "baichuan_m1": {"sliding_window_layers": [1, 3], "conv_window": 2},
    "bailing_moe_linear": {"num_shared_experts": 1, "norm_topk_prob": True, "first_k_dense_replace": 1,
                           "layer_group_size": 2, "group_norm_size": 1},
    "decider2": {},
    "indic_ocr": {},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"],
                         "embedding_multiplier": 1.0, "attention_multiplier": 0.25,
                         "logits_scaling": 1.0, "residual_multiplier": 1.0, "mamba_n_heads": 8,
                         "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 8,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "shared_intermediate_size": 64, "num_local_experts": 0},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                           "head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
                    "model_max_length": 4096, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "num_attention_heads": 2},
    "lfm2_moe": {"full_attn_idxs": [1, 3], "norm_topk_prob": True, "use_expert_bias": False,
                 "num_dense_layers": 1, "conv_bias": False, "conv_L_cache": 3},
    # More sliding windows.
    "llama": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "ministral3": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                   "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                      "llama_4_scaling_beta": 0.1,
                                      "original_max_position_embeddings": 4096}},
    "exaone4": {"sliding_window_pattern": "LLLG"},
    "afmoe": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "cohere_compass": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "spark2_5": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "laguna": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "flint": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "gemma4_text": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                    "num_kv_shared_layers": 0, "global_head_dim": 16, "hidden_size_per_layer_input": 16,
                    "vocab_size_per_layer_input": 256},
    "iquestloopcoder": {"loop_window_size": 8},
    "mellum": {"layer_types": ["sliding_attention", "full_attention"] * 2, "norm_topk_prob": True,
               "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                                   "full_attention": {"rope_theta": 10000.0}}},
    "kolibri1": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "exaone_moe": {"layer_types": ["sliding_attention", "full_attention"] * 2, "num_shared_experts": 1,
                   "is_moe_layer": [False, True, True, True]},
    "step3p5": {"num_attention_groups": 2,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "cohere2_moe": {},
    # Chunked attention (ChunkedKVCache on 3 of every 4 layers), chunks of 32 tokens.
    "llama4": {"attention_chunk_size": 32, "intermediate_size_mlp": 128, "num_experts_per_tok": 1,
               "no_rope_layers": [1, 1, 1, 0], "floor_scale": 32},
    # MLA + DSA sparse attention: CacheList(latent KV, index keys), top-k 32 so it prunes.
    "deepseek_v32": {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 32, "kv_lora_rank": 16,
                     "q_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
                     "n_shared_experts": 1, "first_k_dense_replace": 1},
    "glm_moe_dsa": {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 32, "kv_lora_rank": 16,
                    "q_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                    "n_group": 1, "topk_group": 1, "moe_layer_freq": 1,
                    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    # Vision families: the language model of the VLM.
    "gemma3": {"sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    "mistral3": {"model_type": "ministral3", "layer_types": ["sliding_attention", "full_attention"] * 2,
                 "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                     "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 4096}},
    "lfm2_vl": {"full_attn_idxs": [1, 3], "block_dim": 64, "block_ff_dim": 128, "conv_dim": 64,
                "conv_dim_out": 64, "block_multiple_of": 16, "block_auto_adjust_ff_dim": False,
                "num_heads": 4},
    "d1": {"full_attn_idxs": [1, 3], "block_dim": 64, "block_ff_dim": 128, "conv_dim": 64,
           "conv_dim_out": 64, "block_multiple_of": 16, "block_auto_adjust_ff_dim": False,
           "num_heads": 4},
    "minicpmv4_6": {},
    "plamo2vl": {"model_type": "plamo2", "hidden_size_per_head": 16, "attention_window_size": 8,
                 "mamba_d_state": 8,
                 "mamba_num_heads": 4, "mamba_chunk_size": 16, "full_attention_idx": [1, 3]},
    "aya_vision": {"sliding_window_pattern": 2},
    "gemma4": {"layer_types": ["sliding_attention", "full_attention"] * 2,
               "num_kv_shared_layers": 0, "global_head_dim": 16, "hidden_size_per_layer_input": 16,
               "vocab_size_per_layer_input": 256},
    "gemma4_unified": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                       "sliding_window_pattern": 2, "global_head_dim": 16,
                       "vocab_size_per_layer_input": 256},
    "muse_glimmer": {},
    "inkling": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                "sliding_window_size": 8, "rel_extent": 32, "n_shared_experts": 1},
    "nemotron_h_nano_omni": {"hybrid_override_pattern": "M*M*", "mamba_num_heads": 8,
                             "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 8,
                             "conv_kernel": 4, "n_groups": 1, "mlp_bias": False, "use_bias": False,
                             "use_conv_bias": True},
    "step3p7": {"num_attention_groups": 2, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "llama_nemotron_vl_embedding": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "kimi_k3": {"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                       "head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
                "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16,
                "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
                "num_experts_per_token": 2, "moe_intermediate_size": 32},
    "mimo_v2": {"hybrid_layer_pattern": [0, 1, 0, 1], "moe_layer_freq": [0, 1, 1, 1],
                "sliding_window_size": 8, "swa_head_dim": 16, "swa_v_head_dim": 16, "v_head_dim": 16,
                "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "n_shared_experts": 1,
                "moe_router_dtype": "float32", "attention_chunk_size": 32,
                "partial_rotary_factor": 0.5},
    # MLA with two attention sublayers per layer: CacheList(KV, KV) per layer (num_layers 2 = 4
    # attention sublayers); the ngram variants add an ArraysCache holding the last n-1 token ids.
    "longcat_flash": {**_LONGCAT, "attention_method": "MLA"},
    "longcat_flash_ngram": {**_LONGCAT, "ngram_vocab_size_ratio": 2, "emb_neighbor_num": 3,
                            "emb_split_num": 2},
    # Sparse (LSA) indexer: CacheList(latent, index keys, latent); top-k 32 of ~200 so it prunes.
    "longcat_flash_sparse": {**_LONGCAT, "attention_method": "LSA", "index_n_heads": 2,
                             "index_head_dim": 16, "index_topk": 32, "index_init_tokens": 4,
                             "index_local_tokens": 8, "oe_vocab_size_ratio": 2, "oe_neighbor_num": 3,
                             "oe_split_num": 2},
    # Full attention on layers 0 and 3, sliding windows (with attention sinks) on 1 and 2.
    "mimo_v2_flash": {"hybrid_layer_pattern": [0, 1, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 8, "n_shared_experts": None,
                      "routed_scaling_factor": 1.0, "topk_method": "noaux_tc",
                      "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
                      "topk_group": 1, "layernorm_epsilon": 1e-5, "swa_rope_theta": 10000.0,
                      "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "v_head_dim": 16,
                      "swa_head_dim": 16, "swa_v_head_dim": 16, "partial_rotary_factor": 0.5},
    "gemma3n": {"intermediate_size": [128] * 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                "hidden_size_per_layer_input": 16,
                "vocab_size_per_layer_input": 256, "laurel_rank": 8, "num_kv_shared_layers": 0,
                "activation_sparsity_pattern": [0.0] * 4},
    # Attention + CCA conv state: CacheList(KV, ArraysCache(2)) per layer; a flat config.json.
    "zaya1_vl": {"ffn_hidden_size": 128, "zaya_mlp_expansion": 16, "num_query_groups": 2,
                 "vision_lora_rank_attn": 4, "vision_lora_rank_mlp": 4},
}

#: Families sized here whose restores cannot equal a cold prefill because the model itself is not
#: split-invariant: its output depends on where the prompt is cut into forward calls (REASONS says
#: where; the conformance test proves it and that the family's cache classes restore exactly).
NOT_SPLIT_INVARIANT: dict[str, dict[str, Any]] = {
    # Window-only (ratio 0), sparse overlap-compressed (4) and compressed (128) layers:
    # RotatingKVCache, CacheList(Rotating, Pooling, Pooling), CacheList(Rotating, Pooling).
    "deepseek_v4": {"num_key_value_heads": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                    "q_lora_rank": 16, "qk_rope_head_dim": 8, "compress_ratios": [0, 4, 128, 0],
                    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 4,
                    "num_hash_layers": 1, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2,
                    "index_head_dim": 16, "index_topk": 32, "index_block": 8, "index_keep": 4,
                    "num_nextn_predict_layers": 0},
}

NOT_BUILT_REASON = "no tiny model yet"

#: Vision families whose ``ModelConfig.from_dict`` reads the text fields from the top level of
#: config.json (as their checkpoints ship it) and ignores a nested ``text_config``.
FLAT_CONFIG: frozenset[str] = frozenset({"zaya1_vl"})


def _config_classes(module: Any) -> tuple[type, bool]:
    """(the class that holds the text model's fields, whether it is nested as text_config)."""
    model_config = module.ModelConfig
    fields = {f.name for f in dataclasses.fields(model_config)}
    if "text_config" in fields and hasattr(module, "TextConfig"):
        return module.TextConfig, True
    return model_config, False


def tiny_config(family: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of ``family``'s tiny model (only fields its config class has);
    ``overrides`` replace text-model fields (a head dimension ``mx.quantize`` can pack, say)."""
    sized = {**FAMILIES, **NOT_SPLIT_INVARIANT}
    if family not in sized:
        raise KeyError(f"no tiny model for {family!r}; sized families: {', '.join(sorted(sized))}")
    module = importlib.import_module(f"mlx_vlm.models.{family}")
    text_class, nested = _config_classes(module)
    names = {f.name for f in dataclasses.fields(text_class)}
    if unknown := set(overrides or {}) - names:
        raise KeyError(f"{family}'s text config has no field {', '.join(sorted(unknown))}")
    text = {"model_type": family}
    text.update({k: v for k, v in {**COMMON, **sized[family], **(overrides or {})}.items() if k in names})
    if nested and family in FLAT_CONFIG:
        return {**text, "vision_config": {}}
    if nested:
        return {"model_type": family, "text_config": text, "vision_config": {}}
    return text


def build_language_model(family: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> Any:
    """``Model(config).language_model`` of the tiny ``family`` model, float32, seeded weights
    (``overrides``: see ``tiny_config``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from apcctl.lab.tinymodel.language_model import language_model_from_config

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    mx.random.seed(seed)
    language_model = language_model_from_config(module, tiny_config(family, overrides))
    # MLX's own init (uniform ±1/sqrt(fan_in)) keeps activations sane at these sizes; only cast.
    params = [(k, v.astype(mx.float32)) for k, v in tree_flatten(language_model.parameters())
              if isinstance(v, mx.array)]
    language_model.update(tree_unflatten(params))
    mx.eval(language_model.parameters())
    return language_model


def forward(language_model: Any, tokens: Any, cache: list) -> Any:
    """Last-position logits of ``tokens`` (1-D ids) through ``language_model`` with ``cache``."""
    import mlx.core as mx

    out = language_model(mx.array(tokens)[None], cache=cache)
    logits = getattr(out, "logits", out)
    return logits[:, -1]


DEEPSEEK_V4_REASON = (
    "served with the lineage on, as it is: the model's ratio-4 overlapping compressor "
    "(_overlap_compress_kv) restarts its previous window at every forward call, so its own "
    "chunked cold prefill depends on where a prompt is split (tiny model: up to 0.42 of the logit "
    "scale, apcctl bench splits); a restore equals a cold prefill split at the restore point and "
    "the canary allows the measured split dependence (tests/state/test_split_dependence.py); its cache "
    "classes restore exactly (ratio-0/128 layers)")
MUSE_SPARK_REASON = ("its attention, norms and expert routing are Metal-only kernels "
                     "(mlx_vlm.kernels has no CPU path), so the CPU conformance test cannot run it")

#: Why a family beyond plain KV layers has no tiny model here (the conformance test asserts the
#: whole list, so adding a builder means removing its line). Families with a class that has
#: no restore rule get their reason from ``not_built`` itself.
REASONS: dict[str, str] = {
    "glm5_next": "tested with its own tiny model (tests/fake_model.py, test_state_plumbing.py, e2e suite)",
    "prism_hadamard_qwen35": "needs 2-bit Hadamard-packed weights (no random float32 model)",
    "clef": "a retrieval model: its Model needs a vision config with no defaults",
    "minicpmv4_7": "its forward needs the image token ids of a full model config",
    "deepseek_v4": DEEPSEEK_V4_REASON,
    "muse_spark": MUSE_SPARK_REASON,
}


def not_built() -> dict[str, str]:
    """Families of the installed mlx-vlm that build more than plain KVCache layers (the lineage
    cache's path) and have no tiny model here, with the reason."""
    from server_patch.state.families import all_families

    out = {}
    for f in all_families():
        if not f.beyond_kv or f.family in FAMILIES:
            continue
        if f.unknown_classes:
            out[f.family] = f"builds {', '.join(f.unknown_classes)}, which has no restore rule: refused"
        else:
            out[f.family] = REASONS.get(f.family, NOT_BUILT_REASON)
    return out
