"""A decoding batch outgrowing its KV buffer, into a buffer made ahead (issue 40).

mlx-vlm's ``BatchKVCache.update_and_fetch`` grows a full buffer by ``mx.concatenate``: every
row, every 256 decode steps, copied into a fresh allocation on the generation thread, which
every decoding stream waits for. The fresh pages are the cost: MLX reuses a freed buffer only
for an allocation of nearly the same size, and a grown buffer is always larger than any freed
one, so each regrow faults in the whole batch's KV anew (``bench copies``' ``regrow`` rows).

With ``APC_COPYFREE``, ``APC_COPYFREE_JOIN`` and ``APC_COPYFREE_GROW`` on, a plain
``BatchKVCache`` of the decoding batch grows like this instead:

* ahead: once the batch's buffer has at most ``AHEAD_STEPS`` columns left (``due``), the door's
  decode step asks the runtime's stager for the zero buffers the regrow will want
  (``grow_shapes``, each layer's rows and heads at one allocation step wider; made and counted
  in the RAM budget like a join's, ``copyfree.spares``: ``integration.grows_ahead``);
* at the regrow (``grow_kv``, the patched ``update_and_fetch`` through the door): the rows over
  ``[:_idx]`` written into such a buffer, pages already mapped, then the step's tokens. Where
  none fits (rows joined or left meanwhile, the stager not done, no room in the budget) the
  buffer is allocated here, as mlx-vlm would. Either way the copy is evaluated at once, after
  the previous step's pending compute, so the waits book names it ``grow`` instead of hiding
  it inside the joint ``step``.

The rows over ``[:_idx]``, the offsets and the write index are mlx-vlm's; the buffer may be wider
than mlx-vlm's (a buffer made ahead fits up to twice the width needed), which only moves the
next regrow later.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from server_patch.copyfree import pool
from server_patch.copyfree.spares import JointSpares, Shape
from server_patch.state.row_view import ROW_VIEW
from server_patch.state.rows import leaf_caches

AHEAD_STEPS = 64  # a regrow's buffers are asked for once this few columns are left
Moved = tuple[mx.array, mx.array]
# How the copy runs: ``runner(call, *args)`` (the door's times it as a ``grow`` unit).
Runner = Callable[..., Moved]


def _direct(call: Callable[..., Moved], *args: Any) -> Moved:
    return call(*args)


def takes_grows() -> bool:
    """``APC_COPYFREE``, ``APC_COPYFREE_JOIN`` and ``APC_COPYFREE_GROW`` on."""
    settings = pool.settings()
    return settings.enabled and settings.join and settings.grow


def grown(caches: Sequence[Any]) -> list[Any]:
    """The layers of a decoding batch's caches whose regrow this module makes: plain
    ``BatchKVCache`` layers holding a buffer."""
    from mlx_vlm.models.cache import BatchKVCache

    return [c for c in leaf_caches(caches) if type(c) is BatchKVCache and c.keys is not None]


def room(cache: Any) -> int:
    """Columns ``cache``'s buffer has left past its write index."""
    return int(cache.keys.shape[2]) - int(cache._idx)


def due(layers: Sequence[Any]) -> bool:
    """Whether the batch whose layers are ``layers`` (``grown``) will regrow within
    ``AHEAD_STEPS`` decode steps."""
    return bool(layers) and min(room(c) for c in layers) <= AHEAD_STEPS


def grow_shapes(layers: Sequence[Any]) -> list[Shape]:
    """The buffers each of ``layers`` grows into at its next single-token regrow: its rows and
    heads, one allocation step wider than its buffer (what mlx-vlm's concatenation makes)."""
    shapes: list[Shape] = []
    for cache in layers:
        width = int(cache.keys.shape[2]) + int(type(cache).step)
        for buffer in (cache.keys, cache.values):
            rows, heads, _, dim = (int(n) for n in buffer.shape)
            shapes.append(((rows, heads, width, dim), buffer.dtype))
    return shapes


def grow_kv(cache: Any, keys: mx.array, values: mx.array, made: Optional[JointSpares],
            runner: Runner = _direct) -> Optional[Moved]:
    """``cache.update_and_fetch(keys, values)`` when the tokens do not fit its buffer: the rows
    over ``[:_idx]`` written into a buffer of ``made`` (the runtime's, made ahead) where one
    fits, else into a new one, evaluated now (through ``runner``); then the tokens, as mlx-vlm
    writes them. None (mlx-vlm writes) when the tokens fit or the cache has no buffer yet."""
    prev, count = int(cache._idx), int(keys.shape[2])
    if cache.keys is None or prev + count <= int(cache.keys.shape[2]):
        return None
    step = int(type(cache).step)
    width = prev + -(-count // step) * step  # mlx-vlm's: the held rows, then whole steps
    old_keys, old_values = cache.keys[..., :prev, :], cache.values[..., :prev, :]
    mx.eval(old_keys, old_values)  # the previous step's pending write: its ``step``, not the copy
    cache.keys, cache.values = runner(_moved, old_keys, old_values, width, made)
    setattr(cache, ROW_VIEW, None)  # rows a leave kept in place live in the new buffer now
    cache.offset += count
    cache._idx += count
    cache.keys[..., prev: cache._idx, :] = keys
    cache.values[..., prev: cache._idx, :] = values
    return cache.keys[..., : cache._idx, :], cache.values[..., : cache._idx, :]


def _moved(old_keys: mx.array, old_values: mx.array, width: int, made: Optional[JointSpares]) -> Moved:
    """``old_keys``/``old_values`` in the first columns of buffers ``width`` wide, computed:
    written into ``made``'s where one fits, else concatenated with zeros as mlx-vlm does (one
    write of the rows; filling a new buffer with zeros first would write it twice)."""
    moved = []
    for old in (old_keys, old_values):
        rows, heads, held, dim = (int(n) for n in old.shape)
        buffer = made.taken((rows, heads, width, dim), old.dtype) if made is not None else None
        if buffer is None:
            buffer = mx.concatenate([old, mx.zeros((rows, heads, width - held, dim), dtype=old.dtype)], axis=2)
        else:
            buffer[..., :held, :] = old
        moved.append(buffer)
    mx.eval(moved)
    return moved[0], moved[1]


__all__ = ["AHEAD_STEPS", "Runner", "due", "grow_kv", "grow_shapes", "grown", "room", "takes_grows"]
