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

A join whose set the stager is still making when its prompt batch has finished prefilling
(a short joiner's prefill is shorter than making a long batch's buffers) waits for it
(``waits``): the generator skips the join and keeps decoding the other rows, for at most
``APC_COPYFREE_JOIN_WAIT_MS`` (2 s), so the joiner pays for its own buffers in time to its
first token instead of every decoding stream paying for their allocation on the thread.

Fails safe: a row leaving meanwhile, a prefill that outruns the estimate, a stager that has not
finished within the wait, a set the RAM budget had no room for: the join allocates, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from server_patch import clock
from server_patch.copyfree import batch, pool
from server_patch.disk import faults

log = logging.getLogger("server_patch.copyfree")

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
    if batch.joins_into_free_rows(decoding.prompt_cache, prompt_batch.prompt_cache, int(columns.shape[1])):
        return False  # it will join into rows a leave freed: no buffer to make
    shapes = batch.joint_shapes(decoding.prompt_cache, prompt_batch.prompt_cache, int(columns.shape[1]))
    return spares.ask(prompt_batch, shapes, lambda make, *args: runtime.stages.run(_made, make, *args))


def _made(make: Callable[..., bool], *args: Any) -> bool:
    """On the stager: ``make(*args)`` (a test may hold it first: ``disk.faults``)."""
    faults.before_join_spares()
    return make(*args)


def waits(runtime: LineageRuntime, generator: Any, prompt_batch: Any) -> bool:
    """Before the finished ``prompt_batch`` joins the decoding batch: whether its join waits
    (skipped this time, the rows decode on) because the stager is still making its set, within
    ``APC_COPYFREE_JOIN_WAIT_MS`` of the first time it was found waiting."""
    spares, limit_s = runtime.spares, pool.settings().join_wait_ms / 1000.0
    decoding = getattr(generator, "_generation_batch", None)
    if limit_s <= 0 or decoding is None or not len(decoding.uids) or not spares.unmade(prompt_batch):
        return False
    now = clock.steady()
    if spares.waiting_since is None:
        spares.waiting_since = now
        log.info("apc_copyfree join waits for its buffers made ahead (the rows decode on)")
    if now - spares.waiting_since < limit_s:
        return True
    log.info("apc_copyfree join: its buffers were not made within %.0f ms: it allocates them", limit_s * 1000)
    return False


def waited(runtime: LineageRuntime) -> None:
    """At the join: how long it waited for its buffers, if it did (the log)."""
    since = runtime.spares.waiting_since
    if since is not None:
        log.info("apc_copyfree join waited %.0f ms for its buffers made ahead", (clock.steady() - since) * 1000)


__all__ = ["ask", "waited", "waits"]
