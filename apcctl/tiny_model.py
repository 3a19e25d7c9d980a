"""Build a random ``glm5_next`` model directory offline, deterministic by seed.

Why: the lineage cache must be exercised against the real mlx-vlm 0.7.10 model code
(KDA linear layers, DSA sparse attention with full and shared indexers, MoE,
hyper-connections) without downloading a checkpoint. Two presets:

* ``tiny``: six layers ``llalls`` (KDA, KDA, attention with its own indexer, KDA, KDA,
  attention sharing that indexer), hidden 64, ``index_topk`` 64 with ``index_kpool`` 16 so
  top-k selection really prunes once a prompt passes 64 tokens. Loads in a fraction of a
  second; meant for tests.
* ``bench``: eight layers ``llasllas`` (4 KDA, 2 full-indexer and 2 shared-indexer
  attention layers) with the tiny widths except ``kv_lora_rank`` 2048 and ``index_topk``
  512. Sized so the caches a snapshot copies weigh what they weigh on the real model
  (GLM-5-Next keeps ~11 attention layers x 1 KiB latent per token in bf16); see
  :func:`cache_bytes`. Compute stays small because the MLX CPU matmul is slow here
  (~6 GFLOP/s): measured ~470 tok/s prefill (16k tokens in ~35 s) and ~14 tok/s decode.

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

Weights are float32 (bfloat16 MoE ``gather_mm`` fails on the CPU backend) and use the
MLX-native parameter names, so ``sanitize`` is the identity on them.

Replies round-trip like a real GLM-4.5's (reply reuse, issue 13): the chat template is
GLM-4.5's structure, the tokenizer a WordPiece over a fixed word list (:func:`build_tokenizer`)
and the output layer keeps the random model to tokens whose text re-encodes to the same ids
(:func:`keep_to_tokens`), so a reply re-sent as ``content`` re-renders as the sampled ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

BUILDER_VERSION = "2"  # 2: WordPiece tokenizer, GLM-4.5 template, no special tokens sampled, 0.1 writers
STAMP_FILE = ".apcctl-build.json"
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")

# glm5_next keeps the derived per-head K/V only below this many tokens
# (mlx_vlm/models/glm5_next/language.py, _MAX_PROJECTED_PREFILL_TOKENS).
MAX_PROJECTED_TOKENS = 32768


@dataclass(frozen=True)
class Preset:
    """Shape of a random model. ``layers``: l = KDA linear, a = sparse attention with its
    own indexer, s = sparse attention reusing the previous indexer's top-k."""

    layers: str
    hidden: int
    intermediate: int
    moe_intermediate: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    linear_heads: int
    linear_head_dim: int
    routed_experts: int
    experts_per_tok: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        layers="llalls", hidden=64, intermediate=128, moe_intermediate=32, heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
        index_n_heads=2, index_head_dim=16, index_topk=64, index_kpool=16,
        linear_heads=2, linear_head_dim=32, routed_experts=4, experts_per_tok=2,
    ),
    "bench": Preset(
        layers="llasllas", hidden=64, intermediate=128, moe_intermediate=32, heads=2,
        q_lora_rank=32, kv_lora_rank=2048, qk_nope_head_dim=16, v_head_dim=16,
        index_n_heads=2, index_head_dim=32, index_topk=512, index_kpool=16,
        linear_heads=2, linear_head_dim=32, routed_experts=8, experts_per_tok=2,
    ),
}

_LAYER_TYPES = {"l": "linear_attention", "a": "deepseek_sparse_attention", "s": "deepseek_sparse_attention"}

UNK_TOKEN = "[UNK]"  # a word with a character the vocabulary lacks
# Special (control) tokens get ids 0..n-1 in this order and are skipped when decoding.
CONTROL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|image|>",
    "<|begin_of_video|>", "<|end_of_video|>", "<|video|>", UNK_TOKEN,
)
# Markup the server's parsers must see in decoded text, so not "special".
MARKUP_TOKENS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
SUBWORD_PREFIX = "##"

# GLM-4.5's template (zai-org/GLM-4.5, as apcctl/templates/glm45.jinja holds it), shortened:
# the tools block is its own <|system|> turn before the system text; an assistant turn is
# "\n<think>reasoning</think>" only after the last user message and "\n<think></think>"
# otherwise, then "\n" + content.strip(); the generation prompt is "<|assistant|>", plus
# "\n<think></think>" with enable_thinking=false (mlx-vlm's server default). So a reply
# without reasoning, re-sent as ``content``, re-renders verbatim: the next prompt starts with
# this prompt + the generated tokens (whitespace is not a token here). Left out: GLM-4.5's
# "/nothink" suffix on user turns. Tool calls are
# <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> (one per line);
# tool results <|observation|><tool_response>...</tool_response>.
CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>
{%- endif -%}
{%- macro visible_text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}
{%- if item is mapping and item.type == 'text' -%}
{{- item.text -}}
{%- elif item is mapping and (item.type == 'image' or item.type == 'image_url') -%}
{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}
{%- elif item is string -%}
{{- item -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}
{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user_index = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{{- '<|system|>\\n' + visible_text(m.content) -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>' + visible_text(m.content) -}}
{%- elif m.role == 'assistant' -%}
{%- set reasoning_content = '' -%}
{%- set content = visible_text(m.content) -%}
{%- if m.reasoning_content is string -%}
{%- set reasoning_content = m.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|assistant|>' -}}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{- '\\n<think>' + reasoning_content.strip() + '</think>' -}}
{%- else -%}
{{- '\\n<think></think>' -}}
{%- endif -%}
{%- if content.strip() -%}
{{- '\\n' + content.strip() -}}
{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{{- '\\n<tool_call>' + f.name -}}
{%- if f.arguments is mapping -%}
{%- for k, v in f.arguments.items() -%}
{{- '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' -}}
{{- v if v is string else v | tojson(ensure_ascii=False) -}}
{{- '</arg_value>' -}}
{%- endfor -%}
{%- elif f.arguments -%}
{{- '\\n' + f.arguments -}}
{%- endif -%}
{{- '\\n</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
{{- '<|observation|>' -}}
{%- endif -%}
{{- '\\n<tool_response>\\n' + visible_text(m.content) + '\\n</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' -}}
{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""


# --------------------------------------------------------------------------- tokenizer

_WORDS = """
the be to of and a in that have i it for not on with he as you do at this but his by from
they we say her she or an will my one all would there their what so up out if about who get
which go me when make can like time no just him know take people into year your good some
could them see other than then now look only come its over think also back after use two how
our work first well way even new want because any these give day most us is are was were been
model token cache prompt prefix lineage snapshot layer attention linear sparse index pool
server request response stream batch decode prefill memory disk tensor array shape float
function call tool result error value key name type string number boolean object list file
path line code python test assert return class import def self none true false yield async
await open read write close json config weight bias norm scale router expert hidden state
user assistant system message content role question answer please thanks hello world help
search weather city temperature today tomorrow calendar meeting email send reply summary
report table column row query select where order group count sum average report chart
apple banana orange water coffee music river mountain forest ocean planet garden window
""".split()

# Words of the template's own tools preamble, so it tokenizes to words, not letters.
_PREAMBLE_WORDS = """Tools You may call one more functions assist query are provided signatures
within XML tags For each output arguments following format arg tools""".split()

_SENTENCES = (
    "The {0} {1} will {2} the {3} before the {4}.",
    "Please {2} the {3} and send me a {4} of the {1}.",
    "Why does the {0} {2} so many {3}s?",
    "def {2}_{3}(self, {4}): return self.{0}_{1}",
    '{{"name": "{2}_{3}", "arguments": {{"{4}": "{0}", "count": {n}}}}}',
    "Error: {3} {4} failed at line {n} in {0}.py",
    "assert {0}.{1} == {n}, \"{2} {3}\"",
    "- {0}: {n} {3}s, {m} {4}s",
    "User asked: can you {2} the {3} in {0}? Assistant: yes, {n} {4}s.",
)


def training_corpus(lines: int = 4000) -> list[str]:
    """A fixed synthetic corpus: prose, code, JSON and numbers, independent of the seed."""
    rng = random.Random(20240607)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(5)]
        template = rng.choice(_SENTENCES)
        out.append(template.format(*words, n=rng.randint(0, 9999), m=rng.randint(0, 99)))
    return out


def _characters() -> list[str]:
    """Printable ASCII, Latin-1 and Latin Extended-A/B, Greek; no whitespace (never a token)."""
    codes = [*range(0x21, 0x7F), *range(0xA1, 0x250), *range(0x391, 0x3CA)]
    return [c for c in map(chr, codes) if c.isprintable() and not c.isspace()]


def vocabulary() -> list[str]:
    """Every token in id order: control, markup, whole words, characters, word continuations.

    A word is a single pre-token (letters only), so it encodes to its own id; a word not in
    the list is spelled from a character and ``##`` continuations (WordPiece's longest match).
    """
    words = [*_WORDS, *(w.capitalize() for w in _WORDS), *_PREAMBLE_WORDS]
    assert all(w.isascii() and w.isalpha() for w in words)
    chars = _characters()
    pieces = [*CONTROL_TOKENS, *MARKUP_TOKENS, *words, *chars, *(SUBWORD_PREFIX + c for c in chars)]
    return list(dict.fromkeys(pieces))


def generatable(token: str) -> bool:
    """Whether the model may sample ``token``: a whole word, an ASCII character, an EOS token.

    Each such token decodes to itself between single spaces and re-encodes to the same id, so
    any sequence of them survives decode -> re-encode (a client re-sends text, not ids). A
    ``##`` continuation would glue onto the word before it; control and markup tokens would
    steer the server's parsers. Other characters would round-trip too; they are left out so
    replies read as words.
    """
    if token in EOS_TOKENS:
        return True
    if token in CONTROL_TOKENS or token in MARKUP_TOKENS or token.startswith(SUBWORD_PREFIX):
        return False
    return token.isascii()


def build_tokenizer():
    """A WordPiece tokenizer over :func:`vocabulary` with GLM's control and markup tokens.

    Whitespace separates pre-tokens and is dropped; punctuation and digits are one token
    each; decoding joins tokens with single spaces (``##`` pieces glue on). Unlike a
    byte-level BPE, the ids a random model samples from :func:`generatable` tokens are the
    canonical encoding of their own text, which reply reuse needs end to end.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=UNK_TOKEN,
                                           continuing_subword_prefix=SUBWORD_PREFIX))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Punctuation("isolated"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tokenizer.decoder = decoders.WordPiece(prefix=SUBWORD_PREFIX, cleanup=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


# --------------------------------------------------------------------------- config


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


# --------------------------------------------------------------------------- weights

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


# --------------------------------------------------------------------------- directory


def _tokenizer_config(chat_template: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "remove_space": False,
        "chat_template": chat_template,
    }


def _processor_config() -> dict[str, Any]:
    image = {
        "image_processor_type": "Glm5NextImageProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_image_tokens": 4,
        "max_image_tokens": 256,
    }
    return {"image_processor": image, "video_processor": dict(image)}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _stamp(preset: str, seed: int) -> dict[str, Any]:
    return {"builder_version": BUILDER_VERSION, "preset": preset, "seed": seed}


def is_built(out_dir: Path, preset: str = "tiny", seed: int = 0) -> bool:
    """True when ``out_dir`` holds a complete build of exactly this preset and seed."""
    try:
        stamp = json.loads((out_dir / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if {k: stamp.get(k) for k in ("builder_version", "preset", "seed")} != _stamp(preset, seed):
        return False
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _write_model(tmp: Path, preset_name: str, seed: int) -> None:
    from safetensors.numpy import save_file

    preset = PRESETS[preset_name]
    tokenizer = build_tokenizer()
    token_ids = {t: tokenizer.token_to_id(t) for t in CONTROL_TOKENS + MARKUP_TOKENS}
    config = make_config(preset, token_ids, tokenizer.get_vocab_size())
    weights = init_weights(config, seed)
    keep_to_tokens(weights, np.array([generatable(t) for t in vocabulary()]))

    tokenizer.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", _tokenizer_config(CHAT_TEMPLATE))
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "processor_config.json", _processor_config())
    _write_json(
        tmp / "generation_config.json",
        {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]},
    )
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "mlx"})
    stamp = _stamp(preset_name, seed) | {
        "fingerprint": weights_fingerprint(tmp),
        "preset_values": asdict(preset),
    }
    _write_json(tmp / STAMP_FILE, stamp)


def _make_readable(directory: Path) -> None:
    """mkdtemp makes the directory private; a model directory should read like any other."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


def build_model(out_dir: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Build (or reuse) a random glm5_next model directory and return its path.

    Reuses ``out_dir`` when its build stamp matches preset, seed and builder version. A
    stale build of ours is replaced; a non-empty directory that is not ours is refused,
    so a typo cannot wipe unrelated files. The build happens in a sibling temporary
    directory and is renamed into place, so a crash never leaves a half-built model.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir)
    if is_built(out_dir, preset, seed):
        return out_dir
    if out_dir.exists():
        ours = (out_dir / STAMP_FILE).is_file()
        if not ours and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise FileExistsError(f"{out_dir} exists and is not a model built by apcctl")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_model(tmp, preset, seed)
        _make_readable(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and every weight file (name and bytes), in name order.

    This is what a persistent cache must be keyed by: stock mlx-vlm keys its disk tier by
    model path only, so a rebuilt model at the same path would otherwise reuse stale state.
    """
    model_dir = Path(model_dir)
    files = [model_dir / "config.json"] + sorted(model_dir.glob("*.safetensors"))
    if not files[0].is_file() or len(files) == 1:
        raise FileNotFoundError(f"{model_dir} has no config.json or no *.safetensors")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        digest.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
