"""The buffers a decoding batch's next regrow wants, made before it comes (issue 40).

Every 256 decode steps mlx-vlm grows the decoding batch's KV buffers, copying every row into
fresh memory on the generation thread (``copyfree.grow``). The shapes of the next one are known
long before: each layer's rows and heads, one step wider. So at each decode step (the door's
``hooks.decode_step``) ``tend`` looks at the batch's room: once it is within
``grow.AHEAD_STEPS`` columns of full, it hands the runtime's stager a job that makes those zero
buffers (``JointSpares.make``, counted in the RAM budget first, evaluated off the thread); the
regrow takes them (``grow.grow_kv`` through ``hooks.kv_rows_write``). Once the batch has room
again (it grew, or a join made it wider), a set it did not take is let go.

Fails safe: a row joining or leaving meanwhile, a stager that has not finished, no room in the
budget: the regrow allocates, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server_patch.copyfree import grow

if TYPE_CHECKING:
    from server_patch.integration.runtime import LineageRuntime


def tend(runtime: LineageRuntime, decoding: Any) -> bool:
    """Before a decode step of ``decoding`` (mlx-vlm's ``GenerationBatch``): its regrow's
    buffers asked of the stager when the regrow is near, those of one that has passed let go.
    Whether a job was handed to the stager."""
    made = runtime.grow_spares
    layers = grow.grown(decoding.prompt_cache) if grow.takes_grows() else []
    if not grow.due(layers):
        made.joined()  # it grew (or got wider): a set it did not take fits no later regrow
        return False
    if made.asked(decoding):
        return False
    return made.ask(decoding, grow.grow_shapes(layers), runtime.stages.run)


__all__ = ["tend"]
