"""What mlx-vlm's decoding batch copies when a row joins it and when a row leaves it (issue 40).

On the ``bench`` preset's cache shapes (random rows; copy cost depends on bytes, not values),
in-process, each timed to the end of its compute (``mx.eval``):

* ``join``: a row of ``context`` tokens (the other session's restored turn) joins a decoding
  batch of one ``victim``-token row: ``BatchKVCache.extend`` pads both to the longer row and
  concatenates them into a new buffer (every row already in the batch is copied, and the short
  one grows to the long one's width);
* ``leave``: that row leaves again: ``BatchKVCache.filter`` gathers the rows kept (the short
  row, still at the long one's width) into a new buffer, then drops the left padding (a view);
* ``headroom join``: the alternative, a batch buffer allocated ahead with room for the joiner:
  the join writes only the new row's tokens into its slot (``slice_update``), nothing else moves.

Only the KV children (``KVCache`` → ``BatchKVCache``), which hold the bytes; the pooled and
recurrent children are small. Not a test: nothing asserts a time.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from apcctl.bench.reply_copy import _stats, bench_layout, timed


def _kv_children(probe: list[Any]) -> list[Any]:
    from mlx_vlm.models.cache import CacheList, KVCache

    children = [c for cache in probe for c in (cache.caches if type(cache) is CacheList else [cache])]
    return [c for c in children if type(c) is KVCache and c.keys is not None]


def _row(child: Any, tokens: int, capacity: int) -> Any:
    """A one-row ``BatchKVCache`` shaped like ``child`` holding ``tokens`` random rows."""
    from mlx_vlm.models.cache import BatchKVCache

    batch = BatchKVCache([0])
    k, v = child.keys, child.values
    batch.keys = mx.random.normal((1, k.shape[1], capacity, k.shape[3])).astype(k.dtype)
    batch.values = mx.random.normal((1, v.shape[1], capacity, v.shape[3])).astype(v.dtype)
    batch._idx, batch.offset = tokens, mx.array([tokens])
    return batch


def _arrays(batches: list[Any]) -> list[mx.array]:
    return [x for b in batches for x in (b.keys, b.values)]


def _step_capacity(tokens: int) -> int:
    return -(-tokens // 256) * 256


def run(context: int, victim: int, repeat: int) -> dict[str, Any]:
    _, probe, _ = bench_layout(context)
    children = _kv_children(probe)
    per_token = sum(int(c.keys.nbytes + c.values.nbytes) // int(c.keys.shape[2]) for c in children)

    def pair() -> tuple[list[Any], list[Any]]:
        rows = [_row(c, victim, _step_capacity(victim)) for c in children]
        joining = [_row(c, context, _step_capacity(context)) for c in children]
        mx.eval(_arrays(rows) + _arrays(joining))
        return rows, joining

    join_ms, leave_ms, join_bytes, leave_bytes = [], [], 0, 0
    for _ in range(repeat):
        rows, joining = pair()
        join_ms += timed(lambda: [r.extend(j) for r, j in zip(rows, joining)] and _arrays(rows), 1)
        join_bytes = sum(int(x.nbytes) for x in _arrays(rows))
        keep = mx.array([0], mx.int32)
        leave_bytes = join_bytes // 2  # the kept row gathered at the joined width (the padding dropped after)
        leave_ms += timed(lambda: [r.filter(keep) for r in rows] and _arrays(rows), 1)
        del rows, joining

    headroom_ms, headroom_bytes = [], 0
    for _ in range(repeat):
        room = _step_capacity(context + 256)
        rows = [_row(c, victim, room) for c in children]
        joining = [_row(c, context, _step_capacity(context)) for c in children]
        buffers = [(mx.concatenate([r.keys, mx.zeros_like(r.keys)]), mx.concatenate([r.values, mx.zeros_like(r.values)]))
                   for r in rows]  # the batch buffer with a free slot, allocated ahead (off the step)
        mx.eval([x for pair_ in buffers for x in pair_] + _arrays(joining))

        def write() -> list[mx.array]:
            out = []
            for (k, v), j in zip(buffers, joining):
                k[1:2, :, :context, :] = j.keys[..., :context, :]
                v[1:2, :, :context, :] = j.values[..., :context, :]
                out += [k, v]
            return out

        headroom_ms += timed(write, 1)
        headroom_bytes = per_token * context
        del rows, joining, buffers

    return {"context": context, "victim": victim, "kv_bytes_per_token": per_token,
            "join_ms": _stats(join_ms), "join_bytes": join_bytes,
            "leave_ms": _stats(leave_ms), "leave_bytes": leave_bytes,
            "headroom_join_ms": _stats(headroom_ms), "headroom_join_bytes": headroom_bytes}


__all__ = ["run"]
