"""Absorbed sparse attention over each query's own top-k latent rows, batched over the chunk.

This is glm5_next's single-token decode shape (gather the query's top-k latent rows, attend
with the absorbed query ``embed_q(q)``, map back with ``unembed_out``) done for all queries of a
chunk at once. Its cost is independent of the context length T, which is why it replaces the
unabsorbed path that expands the whole latent context into per-head keys and values.

Layout: every query is its own batch row and the heads are folded into query rows
([B*L, 1, H, r] against that query's latent rows [B*L, 1, K, r], keys = values). The
attention is written out (matmul, masked precise softmax, matmul) rather than calling
``mx.fast.scaled_dot_product_attention``: for 512-wide heads with an array mask MLX falls back
to these same ops on Metal too, and on the CPU the fused call's GQA form (64 query heads over
one key head) crashed at batch 44 in MLX 0.32.4.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

# Queries gathered at once. 128 queries x 2063 rows x 512 x 2 B = 270 MB of bf16 latent rows.
BLOCK_QUERIES = 128


def gather_latent_rows(
    latent: mx.array, topk: mx.array, first_position: Optional[int] = None
) -> tuple[mx.array, mx.array]:
    """Each query's top-k latent rows in one gather, and which of the k slots are real keys.

    ``latent`` is [B, 1, T, r]; ``topk`` is [B, Lq, K] absolute positions (the indexer's layout,
    -1 for empty slots) for queries at ``first_position`` onwards (default: the last Lq tokens).
    Returns rows [B*Lq, 1, K, r] and a bool mask [B, Lq, K]. The mask also enforces causality
    (slot <= the query's position), so it does not rely on the indexer alone.
    """
    batch, _, length, rank = latent.shape
    queries, slots = topk.shape[1:]
    if first_position is None:
        first_position = length - queries
    positions = (first_position + mx.arange(queries, dtype=topk.dtype))[None, :, None]
    valid = (topk >= 0) & (topk <= positions)
    safe = mx.clip(topk, 0, max(length - 1, 0)).reshape(batch, queries * slots)
    # Row indexing on [B, T, r] reads the buffer in place (no copy of a strided cache slice)
    # and is several times faster than take_along_axis on the CPU.
    rows = latent[:, 0][mx.arange(batch)[:, None], safe]
    return rows.reshape(batch * queries, 1, slots, rank), valid


def latent_attention(queries: mx.array, rows: mx.array, valid: mx.array, scale: float) -> mx.array:
    """Softmax attention of absorbed queries [N, 1, H, r] over their own rows [N, 1, K, r].

    Keys and values are the same latent rows. The scores are formed as rows @ queries^T, the
    orientation the reference BLAS of MLX's CPU wheel runs about 2x faster than q @ k^T; the
    rest is what MLX's SDPA fallback does (scaled query, min-value mask, precise softmax).
    """
    scaled = queries * mx.array(scale, dtype=queries.dtype)
    scores = mx.contiguous((rows @ scaled.swapaxes(-1, -2)).swapaxes(-1, -2))
    scores = mx.where(valid, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return mx.softmax(scores, axis=-1, precise=True) @ rows


def absorbed_attention(
    layer: Any,
    q: mx.array,
    latent: mx.array,
    topk: mx.array,
    first_position: Optional[int] = None,
) -> mx.array:
    """Attention output [B, H, Lq, v] for queries q [B, H, Lq, d] (positions as in the gather).

    Rows whose query has no valid key (left padding) are zero, as the Metal kernel gives; MLX's
    CPU SDPA would otherwise return the mean of the gathered rows.
    """
    batch, heads, queries, _ = q.shape
    rows, valid = gather_latent_rows(latent, topk, first_position)
    rank = rows.shape[-1]
    absorbed = layer.embed_q(q).transpose(0, 2, 1, 3).reshape(batch * queries, 1, heads, rank)
    mask = valid.reshape(batch * queries, 1, 1, valid.shape[-1])
    out = latent_attention(absorbed, rows, mask, layer.scale)
    out = layer.unembed_out(out.reshape(batch, queries, heads, rank).transpose(0, 2, 1, 3))
    has_key = mx.any(valid, axis=-1)[:, None, :, None]
    return mx.where(has_key, out, mx.zeros((), dtype=out.dtype))


def blocked_absorbed_attention(
    layer: Any,
    q: mx.array,
    latent: mx.array,
    topk: mx.array,
    block: int = BLOCK_QUERIES,
) -> mx.array:
    """``absorbed_attention`` for the chunk's last Lq queries, ``block`` queries at a time.

    One gather per block bounds the gathered rows' memory (a single gather up to ``block``).
    """
    queries = q.shape[2]
    first = latent.shape[2] - queries
    if queries <= block:
        return absorbed_attention(layer, q, latent, topk, first)
    outputs = []
    for start in range(0, queries, block):
        end = min(start + block, queries)
        out = absorbed_attention(
            layer, q[:, :, start:end], latent, topk[:, start:end], first + start
        )
        mx.async_eval(out)
        outputs.append(out)
    return mx.concatenate(outputs, axis=2)
