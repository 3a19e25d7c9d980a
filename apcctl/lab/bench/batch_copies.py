"""What mlx-vlm's decoding batch copies when a row joins it and when a row leaves it (issue 40).

On the ``bench`` preset's cache shapes (random rows; copy cost depends on bytes, not values),
in-process, each timed to the end of its compute (``mx.eval``):

* ``join``: a row of ``context`` tokens (the other session's restored turn) joins a decoding
  batch of one ``victim``-token row: ``BatchKVCache.extend`` pads both to the longer row and
  concatenates them into a new buffer (every row already in the batch is copied, and the short
  one grows to the long one's width);
* ``leave``: that row leaves again: ``BatchKVCache.filter`` gathers the rows kept (the short
  row, still at the long one's width) into a new buffer, then drops the left padding (a view);
  and the other way round, the short row leaves and the long one stays: copied into a buffer of
  its own, or kept in place (``copyfree.batch.filter_kv``'s default there) and the next token
  written into the old buffer (``write_kv``);
* ``headroom join``: the alternative, a batch buffer allocated ahead with room for the joiner:
  the join writes only the new row's tokens into its slot (``slice_update``), nothing else moves.
* ``regrow``: a decoding batch whose buffer is exactly full (its write index at its width: the
  lone ``context``-token row, or the joint batch of it and the ``victim``-token row as ``extend``
  lays them out) takes one more token: mlx-vlm's ``update_and_fetch`` concatenates every row into
  a new buffer one allocation step wider; ``copyfree.grow.grow_kv`` writes the rows into a new
  zero buffer (allocating, evaluated at once) or into one made ahead (``JointSpares``, made
  before the timing, as the runtime's stager makes them: ``integration.grows_ahead``).
* ``visit``: a short ``victim``-token visitor joins a lone ``context``-token stream, each row in
  the model's own ``KVCache`` (a lone stream decodes in it): mlx-vlm's ``_extend_cache`` merges
  each into a fresh ``BatchKVCache`` of its exact length, then ``extend`` copies both again (and
  the next write regrows: the merge left no room); copy-free, ``one_row`` shows each as a batch
  without a copy and ``extend_kv`` writes both once into buffers made ahead; and after that
  visitor leaves (the long row kept in place), the next one is written into the row it freed.
  MLX's pool is emptied before each timed step, as for the regrow.

Only the KV children (``KVCache`` → ``BatchKVCache``), which hold the bytes; the pooled and
recurrent children are small. Not a test: nothing asserts a time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from apcctl.lab.bench.reply_copy import _stats, bench_layout, timed


def _kv_children(probe: list[Any]) -> list[Any]:
    from mlx_vlm.models.cache import CacheList, KVCache

    children = [c for cache in probe for c in (cache.caches if type(cache) is CacheList else [cache])]
    return [c for c in children if type(c) is KVCache and c.keys is not None]


def _row(child: Any, tokens: int, capacity: int, own: bool = False) -> Any:
    """A one-row ``BatchKVCache`` shaped like ``child`` holding ``tokens`` random rows; with
    ``own``, a ``KVCache`` (as a lone stream's own cache holds its row)."""
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    batch: Any = KVCache() if own else BatchKVCache([0])  # type: ignore[no-untyped-call]
    k, v = child.keys, child.values
    batch.keys = mx.random.normal((1, k.shape[1], capacity, k.shape[3])).astype(k.dtype)
    batch.values = mx.random.normal((1, v.shape[1], capacity, v.shape[3])).astype(v.dtype)
    if own:
        batch.offset = tokens
    else:
        batch._idx, batch.offset = tokens, mx.array([tokens])
    return batch


def _arrays(batches: list[Any]) -> list[mx.array]:
    return [x for b in batches for x in (b.keys, b.values)]


def _step_capacity(tokens: int) -> int:
    return -(-tokens // 256) * 256


def _token(children: list[Any]) -> list[tuple[mx.array, mx.array]]:
    """One decode step's new token for every row of each child (what ``update_and_fetch`` writes)."""
    return [(mx.zeros((c.keys.shape[0], c.keys.shape[1], 1, c.keys.shape[3]), c.keys.dtype),
             mx.zeros((c.values.shape[0], c.values.shape[1], 1, c.values.shape[3]), c.values.dtype))
            for c in children]


def _next_write(rows: list[Any], write: Optional[Callable[..., Any]] = None) -> list[mx.array]:
    """The next decode step's cache write after a join or leave, evaluated: where MLX copies a
    buffer that is a view of another (it cannot write a view in place), this is that copy. Rows
    a leave kept in place are written as the patched ``update_and_fetch`` writes them.
    ``write(row, keys, values)``: the write itself where it is what is timed (a regrow's)."""
    from server_patch.copyfree import batch

    tokens = _token(rows)
    mx.eval([x for pair_ in tokens for x in pair_])
    write = write or (lambda r, k, v: batch.write_kv(r, k, v) or r.update_and_fetch(k, v))
    return [x for r, (k, v) in zip(rows, tokens) for x in write(r, k, v)]


def _join_leave(children: list[Any], context: int, victim: int, repeat: int,
                join: Any, leave: Any, ahead: Any = None, capacity: int = 0, kept: int = 0) -> dict[str, Any]:
    """``repeat`` rounds of: a ``context``-token row joins a ``victim``-token decoding row
    (``join(row, joining)``), one decode write, the long row leaves (``leave(row, keep)``; with
    ``kept=1`` the short one leaves and the long one stays), one decode write; each timed to the
    end of its compute. ``ahead(rows, joining)``, untimed, runs first (what a stager does off
    the generation thread). ``capacity``: the joiner's buffer rows (default: the merge's, its
    context and a decode reserve)."""
    out: dict[str, Any] = {"join": [], "join_next": [], "leave": [], "leave_next": []}
    for _ in range(repeat):
        rows = [_row(c, victim, _step_capacity(victim)) for c in children]
        joining = [_row(c, context, capacity or _step_capacity(context) + 256) for c in children]
        mx.eval(_arrays(rows) + _arrays(joining))
        if ahead is not None:
            ahead(rows, joining)
        out["join"] += timed(lambda: [join(r, j) for r, j in zip(rows, joining)] and _arrays(rows), 1)
        out["joint_bytes"] = sum(int(x.nbytes) for x in _arrays(rows))
        del joining
        out["join_next"] += timed(lambda: _next_write(rows), 1)
        keep = mx.array([kept], mx.int32)
        out["leave"] += timed(lambda: [leave(r, keep) for r in rows] and _arrays(rows), 1)
        out["kept_bytes"] = sum(int(x.nbytes) for x in _arrays(rows))
        out["leave_next"] += timed(lambda: _next_write(rows), 1)
        del rows
    return out


def _lent_capacity(context: int) -> int:
    """A lent entry buffer's rows: the merge's capacity with the lend headroom (defaults)."""
    from server_patch.copyfree.merge import capacity
    from server_patch.copyfree.settings import CopyFreeSettings

    settings = CopyFreeSettings()
    return capacity(context + settings.decode_reserve + settings.lend_headroom)


def _at_once(job: Callable[..., Any], *args: Any) -> Any:
    """The stager's run for ``JointSpares.ask``, here on this thread, before the timing."""
    return job(*args)


def _asked(spares: Any, rows: list[Any], joining: list[Any]) -> None:
    """What the runtime does for a joiner without a staged copy: the join's shapes at its first
    chunk (here its last column left), made as the stager makes them."""
    from server_patch.copyfree import batch

    spares.ask(joining[0], batch.joint_shapes(rows, joining, 0), _at_once)  # a prompt batch's stand-in: its first layer


def _full(children: list[Any], context: int, victim: int, joint: bool) -> list[Any]:
    """Each child's decoding batch with its buffer exactly full (``_idx`` at its width: the next
    single-token write regrows): the lone ``context``-token row, or (``joint``) a ``victim``-token
    row that it joined, as mlx-vlm's ``extend`` lays them out (the short row left-padded)."""
    long = [_row(c, context, context) for c in children]
    if not joint:
        return long
    rows = [_row(c, victim, victim) for c in children]
    for r, j in zip(rows, long):
        r.extend(j)
    return rows


def _regrow(children: list[Any], context: int, victim: int, repeat: int, joint: bool,
            write: Callable[..., Any], ahead: Any = None) -> dict[str, Any]:
    """``repeat`` rounds of: a full batch (``_full``) takes one token (``write(row, keys,
    values)``: the regrow), then the next one; each timed to the end of its compute.
    ``ahead(rows)``, untimed, runs first (what the stager does off the generation thread).
    MLX's pool of freed buffers is emptied before each regrow (untimed): in the server a grown
    buffer is wider than any the batch freed, so its pages come fresh from the OS, whereas here
    the earlier rows (and rounds) free buffers of exactly the grown size, which MLX would reuse."""
    out: dict[str, Any] = {"grow": [], "grow_next": []}
    for _ in range(repeat):
        rows = _full(children, context, victim, joint)
        mx.eval(_arrays(rows))
        out["rows_bytes"] = sum(int(x.nbytes) for x in _arrays(rows))
        if ahead is not None:
            ahead(rows)
        out["grow"].append(_fresh(lambda: _next_write(rows, write)))
        out["grown_bytes"] = sum(int(x.nbytes) for x in _arrays(rows))
        out["grow_next"] += timed(lambda: _next_write(rows), 1)
        del rows
    return out


def _regrows(children: list[Any], context: int, victim: int, repeat: int) -> dict[str, Any]:
    """The regrow rows: mlx-vlm's, ``grow_kv`` allocating, ``grow_kv`` into buffers made ahead;
    for the lone long row (``_long``) and the joint batch (``_joint``)."""
    from server_patch.copyfree import grow, pool
    from server_patch.copyfree.spares import JointSpares

    pool.settings()  # the server's pool limit (16 GB; CPU MLX's own keeps 32 MB): freed buffers are kept
    made = JointSpares(purpose="regrow")
    left: list[int] = []  # buffers made ahead that a regrow did not take (it allocated instead)

    def make(rows: list[Any]) -> None:
        left.append(made.count())  # the last round's leftovers
        made.ask(rows[0], grow.grow_shapes(grow.grown(rows)), _at_once)  # the decoding batch's stand-in: its first layer

    out: dict[str, Any] = {}
    for joint, suffix in ((False, "long"), (True, "joint")):
        for key, write, ahead in (("regrow", lambda r, k, v: r.update_and_fetch(k, v), None),
                                  ("alloc_grow", lambda r, k, v: grow.grow_kv(r, k, v, None), None),
                                  ("ahead_grow", lambda r, k, v: grow.grow_kv(r, k, v, made), make)):
            timing = _regrow(children, context, victim, repeat, joint, write, ahead)
            out |= {f"{key}_{suffix}_ms": _stats(timing["grow"]), f"{key}_{suffix}_next_ms": _stats(timing["grow_next"]),
                    f"{key}_{suffix}_bytes": timing["grown_bytes"], f"{key}_{suffix}_rows_bytes": timing["rows_bytes"]}
        out[f"ahead_grow_{suffix}_left"] = max(left + [made.drop()])
    return out


def _fresh(fn: Callable[[], Any]) -> float:
    """``fn``'s milliseconds to the end of its compute, MLX's pool of freed buffers emptied
    first (untimed): what it allocates comes fresh from the OS, as in the server."""
    mx.clear_cache()
    return timed(fn, 1)[0]


def _own_rows(children: list[Any], tokens: int, capacity: int) -> list[Any]:
    """Each child's row as a lone stream's own cache holds it (a ``KVCache``), evaluated."""
    rows = [_row(c, tokens, capacity, own=True) for c in children]
    mx.eval(_arrays(rows))
    return rows


def _join_timed(decoding: list[Any], visitors: list[Any], join: Callable[[Any, Any], Any],
                after: Optional[Callable[[list[Any]], None]] = None) -> tuple[list[Any], float, float]:
    """Each child's ``join(decoding, visitor)`` (it returns the joint cache), then the next
    decode write, each timed with a fresh pool (``_fresh``); ``after(joint)``, untimed, between."""
    joint: list[Any] = []

    def joined() -> list[mx.array]:
        joint.extend(join(d, v) for d, v in zip(decoding, visitors))
        return _arrays(joint)

    ms = _fresh(joined)
    if after is not None:
        after(joint)
    return joint, ms, _fresh(lambda: _next_write(joint))


def _merge_extend(long: Any, short: Any) -> Any:
    """mlx-vlm's ``_extend_cache`` for single-row caches: each merged into a fresh
    ``BatchKVCache`` of its exact length, then ``extend``."""
    joint = type(long).merge([long])
    joint.extend(type(short).merge([short]))
    return joint


def _extend_with(made: Any, lone: bool) -> Callable[[Any, Any], Any]:
    """The copy-free join of a visitor's own row: ``one_row`` (no copy; the decoding row's too
    where it is ``lone``), then ``extend_kv`` (into ``made``'s buffers where they fit, or into
    the rows a leave freed)."""
    from server_patch.copyfree import batch

    def join(cache: Any, visitor: Any) -> Any:
        joint = batch.one_row(cache) if lone else cache
        batch.extend_kv(joint, batch.one_row(visitor), made)
        return joint

    return join


def _visits(children: list[Any], context: int, victim: int, repeat: int, per_token: int) -> dict[str, Any]:
    """A short visitor (``victim`` tokens) joins a lone long stream (``context`` tokens), each
    row a ``KVCache`` as the model's own cache holds it (256-token steps, the long row with room
    for its next token): mlx-vlm's merge and ``extend`` (``visit_merge_extend``); ``one_row`` and
    ``extend_kv`` into buffers made ahead (``visit_ahead``); and, after that visitor left, the
    next visitor of its size, written into the row it freed (``visit_free_row``). Bytes: every
    buffer the join fills (mlx-vlm: both merges, the short row padded to the long one's width,
    the concatenation; copy-free: the rows written, and the free row's columns zeroed), and the
    joint buffers after the join (``_buffer_bytes``)."""
    from server_patch.copyfree import pool
    from server_patch.copyfree.spares import JointSpares

    pool.settings()  # the server's pool limit, as the regrow rows
    times: dict[str, list[float]] = {}
    out: dict[str, Any] = {"visit_free_row_missed": 0}
    made = JointSpares()
    for _ in range(repeat):
        for name, ms in _stock_visit(children, context, victim, out) + _copyfree_visits(children, context, victim, made, out):
            times.setdefault(name, []).append(ms)
    made.drop()
    padded = max(context, victim) * per_token if context != victim else 0
    out |= {"visit_merge_extend_bytes": (context + victim) * per_token + padded + out["visit_merge_extend_buffer_bytes"],
            "visit_ahead_bytes": (context + victim) * per_token,
            "visit_free_row_bytes": (victim + out["visit_free_row_zeroed_columns"]) * per_token,
            "visit_free_row_joined": out["visit_free_row_missed"] == 0}
    return out | {f"{name}_ms": _stats(ms) for name, ms in times.items()}


def _lone_and_visitor(children: list[Any], context: int, victim: int) -> tuple[list[Any], list[Any]]:
    """Each child's lone long row (room for its next token) and a visitor's, as ``KVCache``s."""
    return _own_rows(children, context, _step_capacity(context + 1)), _own_rows(children, victim, _step_capacity(victim))


def _buffer_bytes(out: dict[str, Any], name: str) -> Callable[[list[Any]], None]:
    """``after`` for ``_join_timed``: the joint buffers' bytes, recorded as ``{name}_buffer_bytes``."""
    return lambda joint: out.update({f"{name}_buffer_bytes": sum(int(x.nbytes) for x in _arrays(joint))})


def _stock_visit(children: list[Any], context: int, victim: int, out: dict[str, Any]) -> list[tuple[str, float]]:
    """One round of mlx-vlm's join (merge, ``extend``): its and the next write's milliseconds."""
    _, ms, next_ms = _join_timed(*_lone_and_visitor(children, context, victim), _merge_extend,
                                 _buffer_bytes(out, "visit_merge_extend"))
    return [("visit_merge_extend", ms), ("visit_merge_extend_next", next_ms)]


def _copyfree_visits(children: list[Any], context: int, victim: int, made: Any,
                     out: dict[str, Any]) -> list[tuple[str, float]]:
    """One round of the copy-free visits: the visitor joins into ``made``'s buffers (asked
    before the timing; how many were made, and the most a join left untaken, recorded), leaves
    (``filter_kv``: the long row kept in place), and the next visitor joins into the row it
    freed (checked: each layer's ``live_view`` is the one the leave made, ending at row 2;
    ``visit_free_row_missed`` counts the layers where it was not)."""
    from server_patch.copyfree import batch
    from server_patch.state.row_view import live_view

    long, short = _lone_and_visitor(children, context, victim)
    _asked(made, long, short)  # the stager's set for this join, made before the timing
    out["visit_ahead_made"] = min(out.get("visit_ahead_made", made.count()), made.count())
    out["visit_ahead_made_bytes"] = made.held_bytes()
    joint, ms, next_ms = _join_timed(long, short, _extend_with(made, lone=True), _buffer_bytes(out, "visit_ahead"))
    out["visit_ahead_left"] = max(out.get("visit_ahead_left", 0), made.count())
    del long, short
    for r in joint:  # the visitor leaves; the long row is kept in place
        batch.filter_kv(r, [0])
    kept = [live_view(r) for r in joint]
    first = kept[0]
    out["visit_free_row_zeroed_columns"] = 0 if first is None else max(
        0, first.column + int(joint[0]._idx) - victim - first.dirty.get(first.end, 0))

    def into_free_row(joint: list[Any]) -> None:
        views = [live_view(r) for r in joint]
        out["visit_free_row_missed"] += sum(not (v is not None and v is k and v.end == 2) for v, k in zip(views, kept))
        out["visit_free_row_buffer_bytes"] = sum(int(v.keys.nbytes + v.values.nbytes) for v in views if v is not None)

    _, again_ms, again_next_ms = _join_timed(joint, _own_rows(children, victim, _step_capacity(victim)),
                                             _extend_with(None, lone=False), into_free_row)
    return [("visit_ahead", ms), ("visit_ahead_next", next_ms), ("visit_free_row", again_ms),
            ("visit_free_row_next", again_next_ms)]


def run(context: int, victim: int, repeat: int) -> dict[str, Any]:
    from server_patch.copyfree import batch
    from server_patch.copyfree.spares import JointSpares

    _, probe, _ = bench_layout(context)
    children = _kv_children(probe)
    per_token = sum(int(c.keys.nbytes + c.values.nbytes) // int(c.keys.shape[2]) for c in children)

    stock = _join_leave(children, context, victim, repeat, lambda r, j: r.extend(j), lambda r, k: r.filter(k))
    copyfree = _join_leave(children, context, victim, repeat, batch.extend_kv, batch.filter_kv)
    as_view = _join_leave(children, context, victim, repeat, batch.extend_kv,
                          lambda r, k: batch.filter_kv(r, k, leave="view"))
    # The short row leaves and the long one stays: copied into a buffer of its own, or kept in
    # place (the default where the kept rows fill at least half the buffer).
    long_copied = _join_leave(children, context, victim, repeat, batch.extend_kv,
                              lambda r, k: batch.filter_kv(r, k, leave="copy"), kept=1)
    long_in_place = _join_leave(children, context, victim, repeat, batch.extend_kv, batch.filter_kv, kept=1)
    made_ahead = JointSpares()  # what a runtime's stager makes for its staged turn's join
    spare = _join_leave(children, context, victim, repeat, lambda r, j: batch.extend_kv(r, j, made_ahead),
                        batch.filter_kv, lambda r, j: made_ahead.reserve(_arrays(j)))
    made_ahead.drop()
    # A lent joiner (its entry's buffer, with the lend headroom): its buffers are asked for at
    # its first prefill chunk, from the shapes both batches have then (``integration.joins_ahead``).
    lent = _join_leave(children, context, victim, repeat, lambda r, j: batch.extend_kv(r, j, made_ahead),
                       batch.filter_kv, lambda r, j: _asked(made_ahead, r, j), capacity=_lent_capacity(context))
    made_ahead.drop()

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

    # Stock: the joint buffer is written twice over (pad, then concatenate); the kept row is
    # gathered at the joint width, then narrowed. Copy-free: one zero-filled joint buffer and
    # each row's tokens written once; the kept row copied from its first used column.
    return {"context": context, "victim": victim, "kv_bytes_per_token": per_token,
            "join_ms": _stats(stock["join"]), "join_bytes": stock["joint_bytes"],
            "join_next_ms": _stats(stock["join_next"]),
            "leave_ms": _stats(stock["leave"]), "leave_bytes": stock["joint_bytes"] // 2,
            "leave_next_ms": _stats(stock["leave_next"]),
            "copyfree_join_ms": _stats(copyfree["join"]), "copyfree_join_bytes": copyfree["joint_bytes"],
            "copyfree_join_rows_bytes": per_token * (context + victim),
            "copyfree_join_next_ms": _stats(copyfree["join_next"]),
            "copyfree_leave_ms": _stats(copyfree["leave"]), "copyfree_leave_bytes": copyfree["kept_bytes"],
            "copyfree_leave_next_ms": _stats(copyfree["leave_next"]),
            "view_leave_ms": _stats(as_view["leave"]), "view_leave_next_ms": _stats(as_view["leave_next"]),
            "long_copied_leave_ms": _stats(long_copied["leave"]), "long_copied_leave_bytes": long_copied["kept_bytes"],
            "long_copied_leave_next_ms": _stats(long_copied["leave_next"]),
            "long_in_place_leave_ms": _stats(long_in_place["leave"]), "long_in_place_leave_bytes": 0,
            "long_in_place_leave_next_ms": _stats(long_in_place["leave_next"]),
            "spare_join_ms": _stats(spare["join"]), "spare_join_bytes": spare["joint_bytes"],
            "spare_join_next_ms": _stats(spare["join_next"]),
            "lent_join_ms": _stats(lent["join"]), "lent_join_bytes": lent["joint_bytes"],
            "lent_join_next_ms": _stats(lent["join_next"]),
            "headroom_join_ms": _stats(headroom_ms), "headroom_join_bytes": headroom_bytes,
            **_regrows(children, context, victim, repeat), **_visits(children, context, victim, repeat, per_token)}


__all__ = ["run"]
