"""Servable random model directories of other families, offline; ``qwen3_5`` first.

Why: qwen3_5 (Gated DeltaNet hybrid + a 1-block vision tower) is the hybrid most people run on
a Mac, so besides the in-process conformance test it is served end to end by the real patched
server; ``build_family_dir`` does the same for any family ``apcctl.lab.tinymodel.families`` sizes
(a sliding-window family through the server, for one). The text model is
``apcctl.lab.tinymodel.families``'s (3 Gated DeltaNet layers, 1 full-attention layer, hidden 64);
the tokenizer is a byte-level BPE trained on ``apcctl.lab.tinymodel.corpus`` with Qwen's ChatML
control tokens, and the chat template is ChatML (``apcctl.lab.tinymodel.template.CHATML_TEMPLATE``:
system/user/assistant turns, images as ``<|vision_start|><|image_pad|><|vision_end|>``).
Weights are float32 with MLX-native names, so ``sanitize`` leaves them as they are.
Deterministic by seed; about 2 MB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from apcctl.lab.tinymodel.template import CHATML_TEMPLATE

#: Families the real-server tests serve (tests/e2e/test_e2e_qwen35.py, tests/e2e/test_e2e_families.py).
SERVED_END_TO_END = ("qwen3_5", "gpt_oss", "nemotron_h")

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
          "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
          "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 64,
          "deepstack_visual_indexes": []}
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14,
                "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136, "max_pixels": 50176,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from apcctl.lab.tinymodel.corpus import training_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def make_config(family: str, ids: dict[str, int], vocab_size: int,
                overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``families``'s config of ``family`` with this tokenizer's vocabulary and ids
    (``overrides``: text-model fields, see ``families.tiny_config``)."""
    from apcctl.lab.tinymodel.families import tiny_config

    config = tiny_config(family, overrides)
    text = config.get("text_config", config)
    text.update(vocab_size=vocab_size, eos_token_id=ids["<|im_end|>"])
    config.update(eos_token_id=ids["<|im_end|>"], torch_dtype="float32")
    if family == "qwen3_5":
        config.update(vision_config=dict(VISION), image_token_id=ids["<|image_pad|>"],
                      video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"])
    return config


def build_family_dir(family: str, out_dir: Path, seed: int = 0,
                     overrides: dict[str, Any] | None = None) -> Path:
    """A servable model directory of ``family`` in ``out_dir`` (created; must be empty or absent):
    config, float32 weights of the whole ``Model`` (MLX-native names), tokenizer, ChatML template.
    ``overrides``: text-model fields (``families.tiny_config``)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import update_module_configs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    tokenizer = _tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in CONTROL_TOKENS}
    config = make_config(family, ids, tokenizer.get_vocab_size(), overrides)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE, "model_max_length": 131072,
    }, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if "vision_config" in config and config["vision_config"]:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    module = importlib.import_module(f"mlx_vlm.models.{family}")
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config = update_module_configs(model_config, module, json.loads(json.dumps(config)),
                                         ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def build_qwen35(out_dir: Path, seed: int = 0) -> Path:
    """The qwen3_5 directory the end-to-end test serves (text and a 1-block vision tower)."""
    return build_family_dir("qwen3_5", out_dir, seed)
