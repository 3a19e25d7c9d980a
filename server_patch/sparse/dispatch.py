"""Which attention path a glm5_next sparse-layer chunk takes, and the ``_attend`` that applies it.

Stock 0.7.10 decides by the chunk length L alone: L <= 8 loops the absorbed decode shape per
query, L >= 9 takes the unabsorbed per-head path, which re-projects the whole context once its
projected cache is stale (after any short forward, i.e. always in a warm conversation). The
rule here (measurements in docs/sparse-attention.md):

* L <= 8: stock's per-query loop, untouched, so these chunks stay bit-identical to single-token
  decode (speculative verification compares them). The batched path happens to equal the loop
  on the CPU wheel's reference BLAS, but kernels picked by row count may differ elsewhere.
* 9 <= L <= 512, any context: the decode shape batched over the chunk (one gather per <= 128
  queries). Its cost does not depend on the context length T.
* L > 512 on the GPU: unabsorbed while L >= 0.2 * M, gathered otherwise. M is what the
  unabsorbed path must project: T when the projected cache is stale or empty (every warm
  chunk), only L while a cold chunked prefill keeps it in sync. FLOP model, multiply-adds per
  head: absorbed 2*K*r + r*(d_k + d_v) per query; unabsorbed K*(d_k + d_v) per query plus
  r*(d_k + d_v) per projected token. With K = 2063, r = 512, d_k = d_v = 256 the absorbed form
  wins while L < 0.199 * M.
* L > 512 on the CPU: gathered. Measured here the CPU fallback of the unabsorbed attention
  (it materialises per-head K/V for each query) is slower than the gather at every L and T,
  in sync or not.

``APC_SPARSE_ATTENTION=0`` (read at import) sends every chunk to stock's ``_attend``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from mlx_vlm.models.glm5_next import language as _language
from mlx_vlm.models.linear import DECODE_BLOCK_SIZE
from server_patch import settings
from server_patch.sparse.gathered import blocked_absorbed_attention
from server_patch.sparse.projected import release, reusable_length, sync_projection

STOCK = "stock"  # stock's _attend as is: switched off, training, quantized latent caches
DECODE_LOOP = "decode_loop"  # stock's per-query loop (L <= 8)
GATHERED = "gathered"  # batched absorbed gather
UNABSORBED = "unabsorbed"  # per-head projected K/V, kept in sync incrementally

ENABLED: bool = settings.value("APC_SPARSE_ATTENTION")
GATHER_ALWAYS_MAX = 512
UNABSORBED_MIN_FRACTION = 0.2
# Above this absorbed/per-head cost ratio the model's proportions overrule the measured rule.
ABSORBED_MAX_PENALTY = 8.0

# The class's own _attend before any patch; an overlay that renames it keeps it reachable as
# _stock_attend.
_ORIGINAL_ATTEND: Callable[..., Any] = _language.Glm5NextAttention.__dict__.get(
    "_stock_attend", _language.Glm5NextAttention._attend
)


def _default_on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def choose_path(
    length: int, context: int, missing: Optional[int] = None, on_gpu: Optional[bool] = None
) -> str:
    """The path for a chunk of ``length`` queries whose latent holds ``context`` tokens.

    ``missing`` is how many tokens the unabsorbed path would project (default: all of them);
    ``on_gpu`` defaults to whether MLX's default device is the GPU.
    """
    if length <= DECODE_BLOCK_SIZE:
        return DECODE_LOOP
    if length <= GATHER_ALWAYS_MAX:
        return GATHERED
    if on_gpu is None:
        on_gpu = _default_on_gpu()
    if not on_gpu:
        return GATHERED
    missing = context if missing is None else missing
    return UNABSORBED if length >= UNABSORBED_MIN_FRACTION * missing else GATHERED


def _path(layer: Any, latent: Any, kv_cache: Any, projected_cache: Any, length: int,
          selected: int) -> str:
    """``choose_path`` for this call; stock code when switched off, for training and for
    quantized latent caches."""
    if (
        not ENABLED
        or layer.training
        or not isinstance(latent, mx.array)
        or hasattr(kv_cache, "bits")
    ):
        return STOCK
    context = latent.shape[2]
    path = choose_path(length, context, missing=context)
    if path == GATHERED and length > DECODE_BLOCK_SIZE and projected_cache is not None:
        # The measured rule assumes glm5_next's proportions (latent 512, heads 256 + 256 wide).
        # A model whose latent is far wider than its heads makes the absorbed form the
        # expensive one; then the per-head path wins wherever its projection is mostly there.
        have = reusable_length(projected_cache, kv_cache, context, length)
        if absorbed_penalty(layer, min(selected, context), length, context - have) >= ABSORBED_MAX_PENALTY:
            return UNABSORBED
    if path == UNABSORBED:  # only now is it worth asking how much the projection lacks
        have = reusable_length(projected_cache, kv_cache, context, length)
        path = choose_path(length, context, missing=context - have)
    return path


def absorbed_penalty(layer: Any, keys: int, length: int, missing: int) -> float:
    """How many times the absorbed form's multiply-adds exceed the per-head path's, per head.

    absorbed: each query attends over ``keys`` latent rows of width r (scores and values) and
    is embedded/unembedded (r x (d_k + d_v)); per-head: each query attends over ``keys``
    per-head rows (d_k + d_v), and ``missing`` latent rows must be projected first.
    At glm5_next's dimensions this never exceeds ~2.3, so the measured rule stands there.
    """
    r = int(layer.kv_lora_rank)
    d = int(layer.qk_nope_head_dim) + int(layer.v_head_dim)
    absorbed = length * (2 * keys * r + r * d)
    per_head = length * keys * d + missing * r * d
    return absorbed / max(1, per_head)


def stock_attend(layer: Any, *args: Any, **kwargs: Any) -> tuple[mx.array, mx.array]:
    """Stock ``Glm5NextAttention._attend``, whether or not the class has been patched."""
    original = getattr(type(layer), "_stock_attend", _ORIGINAL_ATTEND)
    return original(layer, *args, **kwargs)


def _zero_keyless_rows(out: mx.array, topk: mx.array, context: int) -> mx.array:
    """Zero the outputs of queries with no valid key (left padding) on every backend."""
    has_key = mx.any((topk >= 0) & (topk < context), axis=-1)[:, None, :, None]
    return mx.where(has_key, out, mx.zeros((), dtype=out.dtype))


def attend(
    layer: Any,
    q: mx.array,
    latent: mx.array,
    new_latent: mx.array,
    topk: mx.array,
    kv_cache: Any,
    projected_cache: Any,
    last_only: bool = False,
) -> tuple[mx.array, mx.array]:
    """Drop-in for ``Glm5NextAttention._attend`` (same arguments and results)."""
    length = q.shape[2]
    path = _path(layer, latent, kv_cache, projected_cache, length, topk.shape[-1])
    if path in (STOCK, DECODE_LOOP):
        return stock_attend(
            layer, q, latent, new_latent, topk, kv_cache, projected_cache, last_only
        )

    if last_only:
        q, topk = q[:, :, -1:], topk[:, -1:]
    if path == GATHERED:
        release(projected_cache)
        out = blocked_absorbed_attention(layer, q, latent, topk)
    else:
        keys, values = sync_projection(layer, projected_cache, latent, length, kv_cache)
        out = _language._sparse_prefill_attention(q, keys, values, topk, layer.scale)
        out = _zero_keyless_rows(out, topk, latent.shape[2])
    batch, _, queries, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(batch, queries, -1), topk
