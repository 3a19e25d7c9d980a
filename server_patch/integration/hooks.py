"""The one door: every call the patched mlx-vlm files make into the lineage cache comes here.

Each function is handed what it acts on by its call site in mlx-vlm: the coordinator (a
``BatchGenerator``'s ``apc``, a ``PromptProcessingBatch``'s ``_apc_coordinator``, the one a
``GenerationBatch`` was built with) or the server's parts (``ServerRuntime.apc_parts``). Nothing
is looked up by name and nothing is tagged onto mlx-vlm's objects. The one way to tell a lineage
coordinator from stock's (``APC_LINEAGE=0`` leaves no overlay at all, but block-mode models and
``APC_ENABLED=0`` keep mlx-vlm's own ``APCCoordinator``) is ``_lineage``: an ``isinstance``.

None of these raises into mlx-vlm: a failure is logged (and re-raised under
``APC_TEST_FAULTS=1``, ``server_patch.failclosed``) or, for the timing records, logged at debug.

* built with the server: ``build_parts`` (the ``ServerRuntime`` field), ``install_admin``,
  ``wrap_apply_chat_template``; ``coordinator`` (the factory in generate/ar.py, dispatch.py)
  and its end, ``coordinator_closed`` (a batch generator's ``close``; ``closing`` around a
  single-sequence call);
* the batch generator's queue: ``admissible`` (a prompt whose disk restore point loads, or
  whose merge copy stages, waits), ``prefetch`` (every step: their loads and copies start);
* the batch generator's prefill: ``prefill_step`` (decode-aware chunks, ``server_patch.pacing``);
* the batch generator's rows: ``lookup`` (with the row's uid), ``generator_started``, ``rows_bound``, ``rows_decoded``,
  ``rows_leaving``, ``batches_joining``, ``request_removed``; a speculative batch's
  ``speculative_round`` and ``speculative_rows_leaving``; the buffer pool: ``clear``;
* the server's request events: ``prefill_completed``, ``first_token``, ``queued_tokens``,
  ``cancelled``; the idle loop: ``idle``; a cache reset: ``cache_cleared``; stock's figures:
  ``stock_stats``; the model's end:
  ``model_unloading``, ``shutdown``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

from server_patch.copyfree import pool
from server_patch.failclosed import fail_closed
from server_patch.integration import waits

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from server_patch.integration.coordinator import LineageCoordinator
    from server_patch.integration.generator import PromptBatch, RowBatch
    from server_patch.integration.parts import Parts

log = logging.getLogger("server_patch.lineage")
copyfree_log = logging.getLogger("server_patch.copyfree")


def _lineage(coordinator: object) -> "LineageCoordinator | None":
    """``coordinator`` if it is the lineage cache's, else None (stock APC, or no APC)."""
    from server_patch.integration.coordinator import LineageCoordinator

    return coordinator if isinstance(coordinator, LineageCoordinator) else None


# ---------------------------------------------------------------------- built with the server


def build_parts() -> "Parts":
    """The server's parts, built once with mlx-vlm's ``ServerRuntime``."""
    from server_patch.integration.parts import Parts

    return Parts.from_env()


def install_admin(app: Any, parts: "Parts") -> None:
    """/admin, the traffic gate and the guard on mlx-vlm's app, reading ``parts``."""
    from server_patch.admin.api import install

    install(app, parts)


def wrap_apply_chat_template(apply: Callable[..., Any], parts: "Parts") -> Callable[..., Any]:
    """mlx-vlm's ``apply_chat_template``, noting each rendered request in the server's finder."""
    from server_patch.integration.segments import wrap_apply_chat_template as wrap

    return wrap(apply, parts.finder)


def coordinator(manager: Any, model: Any) -> Any:
    """The APC coordinator of ``manager`` (never None: the call sites check the manager):
    the lineage cache's, whose runtime the server's parts adopt, replacing (and closing) the
    one of a model served before. A library caller with no server gets the coordinator alone
    (its runtime still one per manager). mlx-vlm's generate modules have no server in scope,
    so this is where the server's parts are read (``parts.of_server``)."""
    from server_patch.integration.coordinator import LineageCoordinator
    from server_patch.integration.parts import of_server

    parts = of_server()
    if parts is not None:
        parts.runtimes.replacing(manager)
    built = LineageCoordinator(manager, model)
    if parts is not None and built.runtime is not None:
        parts.runtimes.adopt(manager, built.runtime, parts)
    return built


def coordinator_closed(coordinator: object) -> None:
    """mlx-vlm is done with ``coordinator``: its batch generator closed (the server closes an
    idle one and builds a new one for the next request, whose uids start again at 0; or the
    generator was dropped, ``__del__``), or its single-sequence call ended. Its scope of the
    runtime's book is closed: its sessions end and leave the book, their holds let go
    (``LineageCoordinator.close``). Again, or a stock coordinator: nothing."""
    _tell(coordinator, "apc_lineage scope close", lambda lineage: lineage.close())


@contextlib.contextmanager
def closing(coordinator: object) -> Iterator[None]:
    """Around a single-sequence call's prefill and decode (``stream_generate``, whose
    coordinator lives for that call): ``coordinator_closed`` when it ends, however it ends
    (finished, its consumer gone, or raising)."""
    try:
        yield
    finally:
        coordinator_closed(coordinator)


# ---------------------------------------------------------------------- the batch generator's rows


def clear(site: str) -> None:
    """Stock's per-chunk, per-prompt-batch and per-request ``mx.clear_cache()``, now opt-in
    (``APC_POOL_CLEAR=1``, ``server_patch.copyfree.pool``)."""
    try:
        waits.run(waits.Work.POOL, pool.clear, site)
    except Exception as exc:
        fail_closed(exc, f"apc_copyfree pool clear at {site}", log=copyfree_log)


def kv_rows_join(cache: Any, other: Any) -> bool:
    """``BatchKVCache.extend``: True when ``server_patch.copyfree.batch`` joined the rows (each
    moved once, into the joining runtime's buffers made ahead where one fits: ``batch_join``
    named them); False leaves it to mlx-vlm (``APC_COPYFREE_JOIN=0``, another cache type)."""
    from server_patch.copyfree import batch, spares

    if not (batch.takes_over(cache) and batch.takes_over(other)):
        return False
    batch.extend_kv(cache, other, spares.of_this_join())
    return True


def one_row(cache: Any) -> Any:
    """mlx-vlm's ``_extend_cache``, a single-row cache before a join: shown as a batch of one
    without a copy (``copyfree.batch.one_row``), or mlx-vlm's merge (``APC_COPYFREE_JOIN=0``)."""
    from server_patch.copyfree import batch

    return batch.one_row(cache) if batch.takes_joins() else type(cache).merge([cache])


def kv_rows_leave(cache: Any, batch_indices: Any) -> bool:
    """``BatchKVCache.filter``: True when ``copyfree.batch`` kept the rows (each moved once)."""
    from server_patch.copyfree import batch

    if not batch.takes_over(cache):
        return False
    batch.filter_kv(cache, batch_indices)
    return True


def kv_rows_write(cache: Any, keys: Any, values: Any) -> Any:
    """``BatchKVCache.update_and_fetch`` of a cache whose rows a leave kept in place (it has a
    ``copyfree.batch.RowView``), or whose buffer the tokens outgrow: the tokens written into the
    old buffer, in place, or, in a decode step, the buffer grown into one its runtime made
    ahead (``copyfree.grow``, timed as ``grow``), and the views to attend over; None leaves the
    write to mlx-vlm (a stock cache, a prefill chunk's regrow, the record stale and the buffer
    not full)."""
    from server_patch.copyfree import batch, grow, spares

    if not batch.takes_over(cache):
        return None
    written = batch.write_kv(cache, keys, values)
    made = spares.GROWS.get()  # named for a decode step of a lineage runtime's batch only
    if written is not None or made is None or not grow.takes_grows():
        return written
    return grow.grow_kv(cache, keys, values, made, functools.partial(waits.run, waits.Work.GROW))


def admissible(coordinator: object, queue: list[Any], extra_hash_of: Callable[[dict[str, Any]], int], limit: int,
               decoding: int = 0) -> int:
    """How many of the generator's queued sequences, from the first, it admits now (at most
    ``limit``); ``queue`` may be reordered in place (``LineageCoordinator.admissible``). Stock's
    coordinator, or a failure: all of them, as stock."""
    if (lineage := _lineage(coordinator)) is not None:
        try:
            with _staging(lineage):
                return lineage.admissible(queue, extra_hash_of, limit, decoding=decoding)
        except Exception as exc:
            fail_closed(exc, "apc_lineage admissible", log=log)
    return min(limit, len(queue))


def prefetch(generator: Any) -> None:
    """Every step of the generator, admitting or not: the disk loads and staged copies of its
    first queued prompts start (``LineageCoordinator.prefetch``), while the batch is full or a
    prefill runs. A stock coordinator, or a failure: nothing."""
    if (lineage := _lineage(generator.apc)) is None:
        return
    try:
        decoding, prefilling = len(generator._generation_batch), generator._prompt_batch is not None
        full = generator.completion_batch_size - decoding < generator.prefill_batch_size
        with _staging(lineage, bool(generator._unprocessed_sequences)):
            lineage.prefetch(generator._unprocessed_sequences, generator._apc_extra_hash,
                             generator.prefill_batch_size, busy=decoding > 0 or prefilling,
                             blocked=prefilling or full)
    except Exception as exc:
        fail_closed(exc, "apc_lineage prefetch", log=log)


def generator_started(coordinator: object, generator: object) -> None:
    """A ``BatchGenerator`` built its coordinator: the coordinator learns who else decodes."""
    _tell(coordinator, "apc_copyfree attach", lambda lineage: lineage.attach_generator(generator))


def stock_stats(manager: Any, snapshot: dict[str, Any]) -> dict[str, Any]:
    """mlx-vlm's ``APCManager.stats_snapshot`` (``GET /metrics``' ``apc``): behind a lineage cache
    its counters are the lineage cache's (``admin.stock_stats``); stock's own otherwise."""
    if (runtime := manager.lineage_runtime) is None:
        return snapshot
    try:
        from server_patch.admin.stock_stats import lineage_figures

        return lineage_figures(runtime, snapshot)
    except Exception as exc:
        fail_closed(exc, "apc_lineage stock stats", log=log)
        return snapshot


def cache_cleared(manager: Any) -> None:
    """mlx-vlm's ``APCManager.clear`` (``POST /v1/cache/reset``: stock's RAM entries go, its
    disk files stay) cleared its own cache: the lineage cache's RAM entries go with them, or
    an operator's reset would leave every lineage restorable."""
    if (runtime := manager.lineage_runtime) is None:
        return
    try:
        runtime.cache.clear()
    except Exception as exc:
        fail_closed(exc, "apc_lineage cache reset", log=log)


def _waits_of(coordinator: object) -> Optional[waits.Waits]:
    """The waits book of ``coordinator``'s rows (``integration.waits``; None for stock's, or a
    lineage coordinator with no cache of its own)."""
    lineage = _lineage(coordinator)
    cache = lineage.lineage if lineage is not None else None
    return cache.book.waits if cache is not None else None


def _staging(lineage: "LineageCoordinator", queued: bool = True) -> AbstractContextManager[None]:
    """The queue's turn on the generation thread (its loads and staged copies started or
    checked) as one ``stage`` unit, charged to every live row; untimed with nothing queued (a
    step's bookkeeping, not another's work: a gap holds none of it)."""
    book = _waits_of(lineage) if queued else None
    return book.timed(waits.Work.STAGE, waits.Owners()) if book is not None else contextlib.nullcontext()


def _prefilling(generator: Any, prompt_batch: RowBatch) -> tuple[Optional[waits.Waits], waits.Owners]:
    """Whose prefill chunk it is (the prompt batch's rows), and the waits of the rows it holds
    up (``integration.waits``; None for a stock coordinator's)."""
    return _waits_of(generator.apc), waits.Owners(uids=tuple(prompt_batch.uids))


def _settle(book: waits.Waits, batch: Any, kind: str, owners: waits.Owners) -> None:
    """Wait, as a unit of ``kind``, for what ``batch`` still computes (mlx-vlm dispatches each
    decode step's successor before returning its tokens, and a prompt batch its first token):
    a unit timed next (a prefill chunk, a join, a leave) then times only its own work."""
    if batch is None or not len(batch.uids):
        return
    with book.timed(kind, owners):
        batch._eval_pending_state()


def prefill_step(generator: Any, prompt_batch: PromptBatch) -> int:
    """One prefill chunk (``_prefill_chunk``), after the decoding rows' pending step is
    computed (their own ``step``, not the chunk: the chunk is timed to the end of its compute)."""
    try:
        if (book := _waits_of(generator.apc)) is not None:
            _settle(book, generator._generation_batch, waits.OWN_STEP, waits.Owners())
    except Exception as exc:  # a timing record never fails the chunk (the chunk raises as it would)
        log.debug("apc_lineage waits: pending step not settled before a chunk: %s", exc)
    _join_ahead(generator, prompt_batch)
    return _prefill_chunk(generator, prompt_batch)


def join_waits(generator: Any, prompt_batch: PromptBatch) -> bool:
    """``BatchGenerator._next``, before a finished prompt batch joins the decoding batch:
    True skips the join this time (the rows decode on) while the runtime's stager is still
    making its buffers (``integration.joins_ahead.waits``). A failure to tell joins now."""
    try:
        if (lineage := _lineage(generator.apc)) is not None and lineage.runtime is not None:
            from server_patch.integration import joins_ahead

            return joins_ahead.waits(lineage.runtime, generator, prompt_batch)
    except Exception as exc:
        fail_closed(exc, "apc_copyfree join wait", log=copyfree_log)
    return False


def _join_ahead(generator: Any, prompt_batch: PromptBatch) -> None:
    """The prompt batch's join's buffers asked of the runtime's stager while rows decode
    (``integration.joins_ahead``); a failure leaves the join to allocate them, as before."""
    try:
        if (lineage := _lineage(generator.apc)) is not None and lineage.runtime is not None:
            from server_patch.integration import joins_ahead

            joins_ahead.ask(lineage.runtime, generator, prompt_batch)
    except Exception as exc:
        fail_closed(exc, "apc_copyfree joint buffers ahead", log=copyfree_log)


@waits.unit(waits.Work.PREFILL, _prefilling)
def _prefill_chunk(generator: Any, prompt_batch: PromptBatch) -> int:
    """One ``prompt_step`` of the generator's prompt batch, sized so the rows decoding meanwhile
    wait at most ``APC_DECODE_STALL_MS`` (``server_patch.pacing``, with the lineage runtime's
    pacer); a stock coordinator's prefill keeps mlx-vlm's full chunk. The step itself is
    mlx-vlm's and raises as it would: only sizing it may fail closed (a full chunk)."""
    pacer = None
    try:
        if (lineage := _lineage(generator.apc)) is not None and lineage.runtime is not None:
            pacer = lineage.runtime.pacer
        decoding = len(generator._generation_batch) if pacer is not None else 0
    except Exception as exc:
        fail_closed(exc, "apc_pacing prefill step", log=log)
        pacer = None
    if pacer is None:
        return prompt_batch.prompt_step()
    from server_patch import pacing

    return pacing.step(pacer, prompt_batch, decoding)


def lookup(coordinator: Any, token_ids: Sequence[int], uid: Optional[int], **lookup_kwargs: Any) -> Any:
    """A queued sequence's lookup at admission: the lineage coordinator gets mlx-vlm's ``uid``
    too, the name of the request's row from the queue to its end (issue 35: identical prompts
    are separate rows); stock's answers as it would. Raises what the lookup raises, as stock's."""
    if (lineage := _lineage(coordinator)) is not None:
        return lineage.lookup(token_ids, uid=uid, **lookup_kwargs)
    return coordinator.lookup(token_ids, **lookup_kwargs)


def rows_bound(coordinator: object, uids: Sequence[int], metas: Sequence[Optional[dict[str, Any]]]) -> None:
    """A prompt batch was built: each row's uid is bound to its lookup (timing records, loans)."""
    if (lineage := _lineage(coordinator)) is not None:
        lineage.bind_rows(uids, metas)


def batches_joining(coordinator: object, existing: Any, incoming: Any) -> None:
    """Before a finished prompt batch joins (or becomes) the decoding batch."""
    _tell(coordinator, "apc_copyfree join hook", lambda lineage: lineage.batches_joining(existing, incoming))


def rows_leaving(coordinator: object, batch: Any, keep: Sequence[int]) -> None:
    """Before ``GenerationBatch.filter`` drops the rows not in ``keep``."""
    pool.touch()
    _tell(coordinator, "apc_copyfree leave hook", lambda lineage: lineage.rows_leaving(batch, keep))


def rows_decoded(coordinator: object, batch: RowBatch, tokens: Sequence[int]) -> None:
    """After each decode step: the ids it fed (0.7.10 keeps no generated ids; reply reuse), and
    each row's inter-token gap ends (``waits.Waits.close_gaps``)."""
    _tell(coordinator, "apc_copyfree decode hook", lambda lineage: lineage.rows_decoded(batch, tokens))
    try:
        if (book := _waits_of(coordinator)) is not None:
            book.close_gaps(list(batch.uids))
    except Exception as exc:  # a timing record must never fail the generation thread
        log.debug("apc_lineage gaps not closed: %s", exc)


def speculative_round(coordinator: object, batch: Any, verify_input: Any, accepted: Sequence[int],
                      active: Sequence[int]) -> None:
    """After ``_mtp_rounds_batch`` committed a round of ``SpeculativeGenerationBatch`` ``batch``:
    cache row ``j`` kept ``verify_input[j, :accepted[j] + 1]`` and is ``batch._all_uids[active[j]]``."""
    _tell(coordinator, "apc_speculative round hook",
          lambda lineage: lineage.speculative_round(batch, verify_input, accepted, active))


def speculative_rows_leaving(coordinator: object, batch: Any, uids: Sequence[int]) -> None:
    """Rows ``uids`` of a ``SpeculativeGenerationBatch`` finished (before it filters or releases
    its cache)."""
    if uids:
        pool.touch()
        _tell(coordinator, "apc_speculative leave hook", lambda lineage: lineage.speculative_rows_leaving(batch, uids))


# Decorators the overlay puts on mlx-vlm's batch methods (``overlay/patches/copyfree.py``): each
# call is a unit of ``integration.waits``, timed to the end of its compute. A stock coordinator's
# batch, or a failure to name the book, runs the method untimed; the method raises as it would.


def decode_step(method: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationBatch.next``: the joint decode step, every decoding row's own ``step``."""

    @functools.wraps(method)
    def timed(batch: Any, *args: Any, **kwargs: Any) -> Any:
        book = _waits_of(batch.apc_coordinator) if batch.uids else None
        if book is None:
            return method(batch, *args, **kwargs)
        with _growing(batch), book.timed(waits.OWN_STEP, waits.Owners()):
            return method(batch, *args, **kwargs)

    return timed


def _growing(batch: Any) -> AbstractContextManager[None]:
    """The decode step's regrow spares (``copyfree.grow``): the runtime's made ahead, named for
    the step, after its stager was asked for them when the regrow is near
    (``integration.grows_ahead``). A failure to tend them never fails the step."""
    from server_patch.copyfree import spares

    lineage = _lineage(batch.apc_coordinator)
    runtime = lineage.runtime if lineage is not None else None
    if runtime is None:
        return contextlib.nullcontext()
    try:
        from server_patch.integration import grows_ahead

        grows_ahead.tend(runtime, batch)
    except Exception as exc:
        fail_closed(exc, "apc_copyfree regrow buffers ahead", log=copyfree_log)
    return spares.GROWS.naming(runtime.grow_spares)


def rows_leave(method: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationBatch.filter(keep)``: rows leaving are a ``leave`` unit of theirs, from their
    batch's pending step computed (the rows' own ``step``) to the filtered caches computed."""

    @functools.wraps(method)
    def timed(batch: Any, keep: Sequence[int]) -> Any:
        book = _waits_of(batch.apc_coordinator)
        if book is None or len(keep) >= len(batch.uids):
            return method(batch, keep)
        kept = set(keep)
        leaving = waits.Owners(uids=tuple(uid for i, uid in enumerate(batch.uids) if i not in kept))
        _settle(book, batch, waits.OWN_STEP, waits.Owners())
        with book.timed(waits.Work.LEAVE, leaving):
            result = method(batch, keep)
            _settle(book, batch, waits.Work.LEAVE, leaving)
        return result

    return timed


def batch_join(method: Callable[..., Any]) -> Callable[..., Any]:
    """``BatchGenerator._extend_generation_batch(gen_batch)``: a prompt batch joining a decoding
    batch is a ``join`` unit of its rows, from both batches' pending work computed (the decoding
    rows' own ``step``, the joiners' first token as their ``prefill``) to the joined caches
    computed (mlx-vlm's extend only builds them: its copy would run in the next decode step).
    The rows' copy-free join (``kv_rows_join``) takes the joint buffers this generator's runtime
    made ahead (``LineageRuntime.spares``), named for the length of the call; after it, a set
    made for it that it did not take is let go (``JointSpares.joined``)."""

    @functools.wraps(method)
    def joined(generator: Any, gen_batch: Any) -> Any:
        from server_patch.copyfree import spares

        lineage = _lineage(generator.apc)
        runtime = lineage.runtime if lineage is not None else None
        with spares.joining(runtime.spares if runtime is not None else None):
            try:
                return timed(generator, gen_batch)
            finally:
                if runtime is not None:
                    from server_patch.integration import joins_ahead

                    joins_ahead.waited(runtime)
                    runtime.spares.joined()  # the set asked for this join is spent

    def timed(generator: Any, gen_batch: Any) -> Any:
        book = _waits_of(generator.apc)
        existing = generator._generation_batch
        if book is None or not len(existing.uids) or not len(gen_batch.uids):
            return method(generator, gen_batch)
        joining = waits.Owners(uids=tuple(gen_batch.uids))
        _settle(book, existing, waits.OWN_STEP, waits.Owners())
        _settle(book, gen_batch, waits.Work.PREFILL, joining)
        with book.timed(waits.Work.JOIN, joining):
            result = method(generator, gen_batch)
            _settle(book, generator._generation_batch, waits.Work.JOIN, joining)
        return result

    return joined


def prompt_generation(method: Callable[..., Any]) -> Callable[..., Any]:
    """``PromptProcessingBatch.generate``: the prompt's last forward and first token (and its
    prompt-end commit, its own unit inside), the rows' ``prefill``."""

    @functools.wraps(method)
    def timed(prompt_batch: Any, *args: Any, **kwargs: Any) -> Any:
        book = _waits_of(prompt_batch._apc_coordinator)
        if book is None:
            return method(prompt_batch, *args, **kwargs)
        with book.timed(waits.Work.PREFILL, waits.Owners(uids=tuple(prompt_batch.uids))):
            return method(prompt_batch, *args, **kwargs)

    return timed


def request_removed(coordinator: object, uid: int) -> None:
    """Before a cancelled request's row leaves the prompt batch mid-prefill."""
    _tell(coordinator, "apc_copyfree remove hook", lambda lineage: lineage.request_removed(uid))


def _tell(coordinator: object, hook: str, call: Callable[["LineageCoordinator"], object], *,
          record: bool = False) -> None:
    """``call`` the lineage coordinator (nothing for stock's). A failure never reaches mlx-vlm:
    a copy-free hook fails closed (``failclosed``), a timing ``record`` hook logs at debug."""
    if (lineage := _lineage(coordinator)) is None:
        return
    try:
        call(lineage)
    except Exception as exc:
        if record:
            log.debug("%s failed: %s", hook, exc)
        else:
            fail_closed(exc, hook, log=copyfree_log)


# ---------------------------------------------------------------------- the server's request events


def prefill_completed(coordinator: object, uid: int, info: Mapping[str, object], prompt_time_s: float) -> None:
    """The row's prefill ended: its restore line and prefill time."""
    request_id = info.get("request_id", uid)
    _tell(coordinator, "apc_lineage prefill hook",
          lambda lineage: lineage.prefill_completed(uid, request_id, prompt_time_s), record=True)


def first_token(coordinator: object, uid: int, request_id: object, ttft_s: float) -> None:
    """The row's first token went to its client: its timing record is finished."""
    _tell(coordinator, "apc_lineage first-token hook",
          lambda lineage: lineage.first_token(uid, request_id, ttft_s), record=True)


def queued_tokens(batch_gen: Any, uid: int) -> int | None:
    """The prompt length of ``uid`` while it still waits in the generator's queue (its prefill,
    and so its lookup, not started), else None: read before a cancel removes it."""
    try:
        for sequence in batch_gen.unprocessed_prompts:
            if sequence[0] == uid:
                return len(sequence[1])
    except Exception as exc:
        log.debug("apc_lineage queued-prompt probe failed: %s", exc)
    return None


def cancelled(coordinator: object, uid: int, info: Mapping[str, object], queued_tokens: int | None = None) -> None:
    """A request was cancelled and the generator let it go: its record says so (one cancelled
    while queued never reached the cache, so its record is made here and counted)."""
    request_id = info.get("request_id", uid)
    _tell(coordinator, "apc_lineage cancel hook",
          lambda lineage: lineage.cancelled(uid, request_id, queued_tokens), record=True)


# ---------------------------------------------------------------------- idle, unload, shutdown


def idle(parts: "Parts", generator: object) -> None:
    """The generation loop found no active request: the canary may run (a part of) a check
    on the open runtime. Never raises (the canary's own guard)."""
    parts.canary.on_idle(generator, parts.runtimes.current)


def model_unloading(parts: "Parts", manager: object) -> None:
    """mlx-vlm unloads the model of APC ``manager``: its runtime is closed (written) first."""
    parts.runtimes.retire(manager)


def shutdown(parts: "Parts") -> None:
    """Write unwritten entries before the process exits, so a restart starts warm."""
    try:
        parts.runtimes.flush()
    except Exception as exc:
        log.warning("apc_lineage shutdown flush failed: %s", exc)
