"""The joint buffers of any prompt batch's join, made while it prefills (issue 40).

A staged turn gets its join's zero buffers made on the stager with its staged copy
(``copyfree.merge.stage_rows``). Every other joiner (a warm turn lent its entry's buffer, a
cold or mixed prompt batch, a batch of more than two rows, a decoding row wider than the
joiner) would have ``copyfree.batch.extend_kv`` allocate the joint buffer on the generation
thread at the join: 409 ms against 41 ms at 8k tokens (``bench copies``), and every other
stream waits. Their shapes are known when the prompt batch starts prefilling while rows decode:
the rows of both batches, each side's buffer and write index, the prompt columns left. So at
its first prefill chunk (``hooks.prefill_step``) ``ask`` computes them
(``copyfree.batch.joint_shapes``) and hands the runtime's stager (``LineageRuntime.stages``) a
job that makes them (``JointSpares.make``: counted in the RAM budget first, evaluated off the
thread). The join takes them when it comes (``JointSpares.take``); the door's join
(``hooks.batch_join``) then tells the spares it happened (``JointSpares.joined``), so a set
that fit nothing, or one finished after its join, is let go.

Fails safe: a row leaving meanwhile, a prefill that outruns the estimate, a stager that has not
finished by the join: the join allocates, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server_patch.copyfree import batch

if TYPE_CHECKING:
    from server_patch.integration.runtime import LineageRuntime


def ask(runtime: LineageRuntime, generator: Any, prompt_batch: Any) -> bool:
    """Before a prefill chunk of ``prompt_batch`` (mlx-vlm's ``PromptProcessingBatch``, the
    generator's): the first time rows decode meanwhile, the zero buffers of its join are asked
    of the stager. Whether a job was handed to it."""
    spares = runtime.spares
    if not batch.takes_joins() or spares.asked(prompt_batch):
        return False
    decoding = getattr(generator, "_generation_batch", None)
    columns = getattr(prompt_batch, "_input_ids", None)  # the prompt columns not yet prefilled
    if decoding is None or not len(decoding.uids) or columns is None:
        return False
    shapes = batch.joint_shapes(decoding.prompt_cache, prompt_batch.prompt_cache, int(columns.shape[1]))
    return spares.ask(prompt_batch, shapes, runtime.stages.run)


__all__ = ["ask"]
