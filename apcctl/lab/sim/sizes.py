"""Bytes of glm5_next cache state, derived from a model ``config.json``.

The simulator's policies hold sized placeholders, so every byte figure in a replay comes from
here. The split matters: the latent KV and index caches grow per token and can be sliced, the
KDA recurrent + conv state is a fixed-size snapshot, and the projected per-head K/V cache is a
derived cache that stock 0.7.10 stores in every snapshot (up to 32,768 tokens) while the lineage
cache never stores it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

# mlx_vlm/models/glm5_next/language.py: _MAX_PROJECTED_PREFILL_TOKENS
PROJECTED_MAX_TOKENS = 32768
# The KDA recurrent state is float32 whatever the weights are (models/gated_delta.py).
RECURRENT_DTYPE_BYTES = 4

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NAMED_CONFIGS = {"full": "glm5_next_full.json", "tiny": "glm5_next_tiny.json"}


@dataclass(frozen=True)
class StateSizes:
    """Per-token and fixed byte counts of one model's cache state, summed over layers."""

    name: str
    dtype_bytes: int
    attention_layers: int
    full_indexer_layers: int
    linear_layers: int
    latent_per_token: int  # kv_lora_rank x dtype, every attention layer
    index_valid_per_token: int  # 1 byte (bool) per token, full-indexer layers
    pooled_keys_per_token: int  # index_head_dim x dtype / kpool, full-indexer layers
    projected_per_token: int  # heads x (qk_nope + v_head) x dtype: derived, stock stores it
    recurrent_bytes: int  # KDA heads x head_dim x head_dim x float32, all linear layers
    conv_bytes: int  # (kernel - 1) x 3 x heads x head_dim x dtype, all linear layers
    projected_max_tokens: int = PROJECTED_MAX_TOKENS

    @property
    def kv_per_token(self) -> int:
        """The sliceable, non-derived KV bytes per token: what lineage stores."""
        return self.latent_per_token + self.index_valid_per_token + self.pooled_keys_per_token

    @property
    def snapshot_bytes(self) -> int:
        """The non-sliceable part: one checkpoint, independent of prompt length."""
        return self.recurrent_bytes + self.conv_bytes

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_per_token * max(0, tokens)

    def projected_bytes(self, tokens: int) -> int:
        return self.projected_per_token * min(max(0, tokens), self.projected_max_tokens)

    def full_snapshot_bytes(self, tokens: int) -> int:
        """A stock 0.7.10 snapshot: every cache of every layer, projected cache included."""
        return self.kv_bytes(tokens) + self.projected_bytes(tokens) + self.snapshot_bytes

    def describe(self) -> dict[str, Any]:
        """The derived figures, for printing and for JSON output."""
        return {
            "model": self.name,
            "dtype_bytes": self.dtype_bytes,
            "attention_layers": self.attention_layers,
            "full_indexer_layers": self.full_indexer_layers,
            "linear_layers": self.linear_layers,
            "latent_per_token": self.latent_per_token,
            "index_valid_per_token": self.index_valid_per_token,
            "pooled_keys_per_token": self.pooled_keys_per_token,
            "kv_per_token": self.kv_per_token,
            "projected_per_token": self.projected_per_token,
            "projected_max_tokens": self.projected_max_tokens,
            "recurrent_bytes": self.recurrent_bytes,
            "conv_bytes": self.conv_bytes,
            "snapshot_bytes": self.snapshot_bytes,
        }


def sizes_from_config(config: Mapping[str, Any], name: str = "") -> StateSizes:
    """Derive the sizes the way glm5_next's ``TextConfig.__post_init__`` fills its defaults."""
    text = dict(config.get("text_config") or config)
    dtype_name = str(text.get("torch_dtype") or text.get("dtype")
                     or config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype_name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype_name!r}; known: {sorted(_DTYPE_BYTES)}")
    dtype = _DTYPE_BYTES[dtype_name]
    layers = int(text.get("num_hidden_layers", 45))
    layer_types = _layer_types(text, layers)
    indexer_types = _indexer_types(text, layers)
    attention = [i for i, kind in enumerate(layer_types) if kind != "linear_attention"]
    full_indexer = [i for i in attention if indexer_types[i] == "full"]
    linear = layers - len(attention)

    linear_cfg = text.get("linear_attn_config") or {}
    kda_head_dim = int(linear_cfg.get("head_dim", text.get("linear_head_dim", 128)))
    kda_heads = int(linear_cfg.get("num_heads", text.get("linear_num_heads", 64)))
    kernel = int(linear_cfg.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)))

    heads = int(text.get("num_attention_heads", 64))
    kv_lora = int(text.get("kv_lora_rank", 512))
    qk_nope = int(text.get("qk_nope_head_dim", 256))
    v_head = int(text.get("v_head_dim", 256))
    index_head_dim = int(text.get("index_head_dim", 128))
    kpool = int(text.get("index_kpool", 16))

    return StateSizes(
        name=name or str(config.get("model_type", "glm5_next")),
        dtype_bytes=dtype,
        attention_layers=len(attention),
        full_indexer_layers=len(full_indexer),
        linear_layers=linear,
        latent_per_token=len(attention) * kv_lora * dtype,
        index_valid_per_token=len(full_indexer) * 1,
        pooled_keys_per_token=len(full_indexer) * index_head_dim * dtype // kpool,
        projected_per_token=len(attention) * heads * (qk_nope + v_head) * dtype,
        recurrent_bytes=linear * kda_heads * kda_head_dim * kda_head_dim * RECURRENT_DTYPE_BYTES,
        conv_bytes=linear * (kernel - 1) * 3 * kda_heads * kda_head_dim * dtype,
    )


def _layer_types(text: Mapping[str, Any], layers: int) -> list[str]:
    kinds = text.get("layer_types") or [
        "linear_attention" if i % 4 != 3 else "deepseek_sparse_attention" for i in range(layers)
    ]
    if len(kinds) != layers:
        raise ValueError("layer_types must have one entry per hidden layer")
    return ["deepseek_sparse_attention" if k == "full_attention" else str(k) for k in kinds]


def _indexer_types(text: Mapping[str, Any], layers: int) -> list[str]:
    if text.get("indexer_types"):
        return [str(k) for k in text["indexer_types"]]
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return [str(k) for k in pattern]
    freq = max(int(text.get("index_topk_freq", 1)), 1)
    offset = int(text.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def load_sizes(spec: str = "full") -> StateSizes:
    """``full`` / ``tiny`` (the bundled configs) or a path to a ``config.json``."""
    if spec in NAMED_CONFIGS:
        text = resources.files("apcctl.lab.sim").joinpath("configs", NAMED_CONFIGS[spec]).read_text()
        return sizes_from_config(json.loads(text), name=f"glm5_next-{spec}")
    path = Path(spec)
    config = json.loads(path.read_text())
    if config.get("model_type", "glm5_next") != "glm5_next":
        # Any other family: measure its cache layout from the config (placeholder weights).
        from apcctl.lab.model_check import check_config_file

        return sizes_from_report(check_config_file(path))
    return sizes_from_config(config, name=path.stem if path.name != "config.json"
                             else path.parent.name or "config")


def sizes_from_report(report: Any) -> StateSizes:
    """The replay's ``StateSizes`` for any model ``apcctl.lab.model_check`` checked (a ``ModelReport``).

    The simulator needs two numbers per model: KV bytes per token (what the lineage cache
    stores once and slices) and snapshot bytes (what each restore point holds). Here they go
    into the latent and recurrent fields; nothing is derived (projected = 0), so a stock
    snapshot at n tokens is KV(n) + snapshot, as stock 0.7.10 stores it.
    """
    kv_layers = sum(1 for layer in report.layers if layer.kv_bytes_per_token)
    snapshot_layers = sum(1 for layer in report.layers if layer.snapshot_bytes)
    return StateSizes(
        name=report.model_type or Path(report.model_dir).name, dtype_bytes=_DTYPE_BYTES[report.dtype],
        attention_layers=kv_layers, full_indexer_layers=0, linear_layers=snapshot_layers,
        latent_per_token=report.kv_bytes_per_token, index_valid_per_token=0, pooled_keys_per_token=0,
        projected_per_token=0, recurrent_bytes=report.snapshot_bytes, conv_bytes=0)


# Snapshots an entry may hold beyond its checkpoint cap: its head, its prompt end (reply reuse)
# and the newest turn's generation-prompt start (a drift point, kept on top of the cap).
SNAPSHOTS_PAST_CAP = 3


def ram_to_hold(requests: Sequence[Any], sizes: StateSizes, max_checkpoints: int, anchor_bytes: int) -> int:
    """RAM that holds every branch of a trace at once, so a lineage cache with this budget never
    has to evict one: per branch (a request whose prompt extends no earlier request's prompt and
    reply starts one), its longest sequence's KV and a full set of snapshots; and the anchors'
    own cap. ``requests`` in time order (``apcctl.lab.sim.trace.Request``)."""
    heads: list[Any] = []  # each branch's newest sequence (prompt and reply)
    longest: list[int] = []
    for req in requests:
        extends = [i for i, head in enumerate(heads)
                   if req.n >= head.shape[0] and np.array_equal(req.tokens[:head.shape[0]], head)]
        seen = req.seen
        if extends:
            i = max(extends, key=lambda k: heads[k].shape[0])
            heads[i], longest[i] = seen, max(longest[i], int(seen.shape[0]))
        else:
            heads.append(seen)
            longest.append(int(seen.shape[0]))
    per_branch = (max_checkpoints + SNAPSHOTS_PAST_CAP) * sizes.snapshot_bytes
    return sizes.kv_bytes(sum(longest)) + len(heads) * per_branch + anchor_bytes
