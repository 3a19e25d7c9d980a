"""The calls the patched mlx-vlm files make (``overlay/patches/copyfree.py``); none raises
(but under ``APC_TEST_FAULTS=1``, where a failure re-raises: ``server_patch.failclosed``).

* ``clear(site)``: stock's per-chunk, per-prompt-batch and per-request ``mx.clear_cache()``,
  now opt-in (``server_patch.copyfree.pool``);
* ``attach(generator)``: a ``BatchGenerator`` introduces itself to its APC coordinator;
* ``joining(generator, gen_batch)``: before a finished prompt batch joins the decoding batch;
* ``leaving(batch, keep)``: before ``GenerationBatch.filter`` drops the rows not in ``keep``;
* ``decoded(batch, tokens)``: after each decode step, the ids it fed (reply reuse);
* ``removing(generator, uid)``: before a cancelled request's row leaves the prompt batch.

These let the lineage coordinator adopt a lone request's KV buffer at the moment nothing
writes it any more (``LineageCoordinator.rows_leaving`` / ``batches_joining``), and end a
buffer loan when its borrower goes (``request_removed``).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from server_patch.copyfree import pool
from server_patch.failclosed import fail_closed

log = logging.getLogger("server_patch.copyfree")

_TAG = "_apc_copyfree_coordinator"


def clear(site: str) -> None:
    try:
        pool.clear(site)
    except Exception as exc:
        fail_closed(exc, f"apc_copyfree pool clear at {site}", log=log)


def attach(generator: Any) -> None:
    coordinator = getattr(generator, "apc", None)
    attach_generator = getattr(coordinator, "attach_generator", None)
    if callable(attach_generator):
        try:
            attach_generator(generator)
        except Exception as exc:
            fail_closed(exc, "apc_copyfree attach", log=log)


def joining(generator: Any, gen_batch: Any) -> None:
    coordinator = getattr(generator, "apc", None)
    if coordinator is None or not hasattr(coordinator, "batches_joining"):
        return
    try:
        setattr(gen_batch, _TAG, coordinator)
        existing = getattr(generator, "_generation_batch", None)
        if existing is not None:
            setattr(existing, _TAG, coordinator)
            coordinator.batches_joining(existing, gen_batch)
    except Exception as exc:
        fail_closed(exc, "apc_copyfree join hook", log=log)


def leaving(batch: Any, keep: Sequence[int]) -> None:
    pool.touch()
    _to_coordinator(batch, "rows_leaving", keep, hook="leave")


def decoded(batch: Any, tokens: Sequence[int]) -> None:
    _to_coordinator(batch, "rows_decoded", tokens, hook="decode")


def _to_coordinator(batch: Any, method: str, arg: Any, *, hook: str) -> None:
    """``coordinator.method(batch, arg)`` for a batch a coordinator tagged (``joining``)."""
    coordinator = getattr(batch, _TAG, None)
    if coordinator is None:
        return
    try:
        getattr(coordinator, method)(batch, arg)
    except Exception as exc:
        fail_closed(exc, f"apc_copyfree {hook} hook", log=log)


def removing(generator: Any, uid: Any) -> None:
    coordinator = getattr(generator, "apc", None)
    request_removed = getattr(coordinator, "request_removed", None)
    if not callable(request_removed):
        return
    try:
        request_removed(uid)
    except Exception as exc:
        fail_closed(exc, "apc_copyfree remove hook", log=log)
