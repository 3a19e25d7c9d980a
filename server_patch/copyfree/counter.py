"""A debug counter of the bytes every cache copy moves (``--copy-counter``, ``APC_COPY_COUNTER=1``).

Counting by timing would mix copies with page faults and compute; this counts bytes at the
operations that copy, by wrapping them in the process (stock mlx-vlm and the patch alike):

| op | what | wrapped |
|---|---|---|
| clone | stock's restore clone and store clone | ``apc._clone_prompt_cache_for_apc`` |
| reserve | stock's capacity padding of a clone (``mx.concatenate``) | ``KVCache.prefix_cache_reserve`` |
| merge | the copy into the batch layout | ``BatchKVCache.merge``, ``ArraysCache.merge``, ``BatchPoolingCache.merge``, ``copyfree.merge`` |
| regrow | a cache outgrowing its buffer (``mx.concatenate``) | ``update_and_fetch`` of the KV and pooling caches |
| cow | an in-place slice write that copied because another reference held the buffer | same, by comparing the buffer address before and after the write |
| extract | a row copied out of a live cache | ``BatchKVCache/KVCache/BatchPoolingCache.extract``, ``state.rows`` |
| extend, filter | rows joining or leaving a decoding batch (not a leave that kept its rows in place) | ``BatchKVCache.extend/filter`` |
| anchor | an anchor's own copy of its prefix | ``MlxKV.prefix`` |

Each op is split into ``kv`` (append-only rows: latent, index, pooled keys, projected) and
``state`` (recurrent and conv state, pooling remainder buffers). The copy-on-write check
evaluates the cache before and after every write and reads buffer addresses, so it is slow
and for measurement only; it needs a backend whose arrays expose host memory (CPU, Metal).

Totals go to the ledger (``server_patch.observe.ledger``, which the serving path calls and
which imports no mlx): ``ledger.snapshot()`` in process; with ``APC_COPY_COUNTER_FILE`` set, a
JSON file rewritten after every counted copy. The launcher installs this counter with
``--copy-counter[=FILE]`` or ``APC_COPY_COUNTER=1`` (``requested()``), stock or patched, for
``apcctl bench ttft``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Sequence

import mlx.core as mx

from server_patch.observe import ledger
from server_patch.observe.ledger import add

log = logging.getLogger("server_patch.copyfree")

# A method of an mlx-vlm cache class this wraps: any signature, any result (counted by shape).
Method = Callable[..., object]

ENV = "APC_COPY_COUNTER"
ENV_FILE = "APC_COPY_COUNTER_FILE"

# Whether mlx-vlm's classes are wrapped: the process's, on purpose (they are the process's classes).
_wrapped = False


def requested(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the environment asks for the counter (``APC_COPY_COUNTER``)."""
    from server_patch import settings

    return bool(settings.value(ENV, env))


# ---------------------------------------------------------------------------- byte accounting

def _arr_bytes(x: object) -> int:
    return int(x.nbytes) if isinstance(x, mx.array) else 0


def _used_bytes(x: object, rows: int, axis: int = 2) -> int:
    """Bytes of the first ``rows`` rows of ``x`` along ``axis``."""
    if not isinstance(x, mx.array) or x.ndim <= axis or not x.shape[axis]:
        return 0
    return int(x.nbytes) // int(x.shape[axis]) * min(int(rows), int(x.shape[axis]))


def cache_bytes(cache: Any) -> tuple[int, int]:
    """(kv, state) bytes a cache object holds in use (KV rows up to its length)."""
    name = type(cache).__name__
    if name == "CacheList":
        kv = state = 0
        for child in cache.caches:
            k, s = cache_bytes(child)
            kv, state = kv + k, state + s
        return kv, state
    if hasattr(cache, "pooled") and hasattr(cache, "buf_kv"):
        return _arr_bytes(cache.pooled), _arr_bytes(cache.buf_kv) + _arr_bytes(cache.buf_gate)
    if hasattr(cache, "keys") and hasattr(cache, "values") and not hasattr(cache, "max_size"):
        if cache.keys is None:
            return 0, 0
        rows = cache._idx if hasattr(cache, "_idx") else cache.offset
        rows = int(rows) if not isinstance(rows, mx.array) else int(cache.keys.shape[2])
        return _used_bytes(cache.keys, rows) + _used_bytes(cache.values, rows), 0
    arrays: list[mx.array] = []
    collect_arrays(getattr(cache, "state", ()), arrays)
    return 0, sum(int(a.nbytes) for a in arrays)


def collect_arrays(value: object, out: list[mx.array]) -> None:
    """Every mx.array in a (nested) cache state, appended to ``out``."""
    if isinstance(value, mx.array):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            collect_arrays(item, out)


def _add_caches(op: str, caches: object) -> None:
    items = caches if isinstance(caches, (list, tuple)) else [caches]
    kv = state = 0
    for cache in items:
        if cache is None:
            continue
        k, s = cache_bytes(cache)
        kv, state = kv + k, state + s
    add(op, kv, kind="kv")
    add(op, state, kind="state")


# ---------------------------------------------------------------------------- copy-on-write

def _address(x: mx.array) -> int | None:
    """Host address of ``x``'s first element (evaluates it); None where not readable."""
    try:
        import numpy as np

        view = memoryview(x)  # type: ignore[arg-type]  # mlx's stubs omit __buffer__; mx.array exports it
        try:
            return int(np.asarray(view).__array_interface__["data"][0])
        except (TypeError, ValueError):  # e.g. bfloat16, which numpy cannot describe
            if view.c_contiguous:
                return int(np.frombuffer(view.cast("B"), np.uint8).__array_interface__["data"][0])
    except Exception:
        return None
    return None


Probed = tuple[tuple[int, ...], int | None, int]  # the shape, host address and size of one array


def _probe(owner: object, names: tuple[str, ...]) -> dict[str, Probed]:
    """Shape, address and size of ``owner``'s arrays; holds no reference to them afterwards
    (a held reference would itself force the copy-on-write this looks for)."""
    out: dict[str, Probed] = {}
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, mx.array) and value.size:
            mx.eval(value)
            out[name] = (tuple(value.shape), _address(value), int(value.nbytes))
    return out


def _watched(method: Method, names: tuple[str, ...], kinds: dict[str, str]) -> Method:
    @functools.wraps(method)
    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        before = _probe(self, names)
        result = method(self, *args, **kwargs)
        if before:
            after = _probe(self, tuple(before))
            for name, (shape, address, nbytes) in before.items():
                if name not in after:
                    continue
                new_shape, new_address, new_nbytes = after[name]
                if new_shape != shape:
                    add("regrow", nbytes, kind=kinds.get(name, "kv"))
                elif address is not None and new_address is not None and new_address != address:
                    add("cow", new_nbytes, kind=kinds.get(name, "kv"))
        return result

    return wrapper


# ---------------------------------------------------------------------------- installation

def _after(func: Method, op: str) -> Method:
    """Count the caches ``func`` returns as copied by ``op`` (a class method: wrap its
    ``__func__`` and make the wrapper a ``classmethod``)."""

    @functools.wraps(func)
    def wrapper(*args: object, **kwargs: object) -> object:
        result = func(*args, **kwargs)
        if result is not None:
            _add_caches(op, result)
        return result

    return wrapper


_ROW_ATTRS = {"keys": "kv", "values": "kv", "pooled": "kv", "buf_kv": "state", "buf_gate": "state"}


def _shares(x: mx.array, base: object) -> bool:
    """Whether ``x`` lies inside ``base``'s buffer (a view, not a copy)."""
    if not isinstance(base, mx.array) or not base.size or not x.size:
        return False
    mx.eval(x, base)
    return _within(_address(x), _address(base), int(base.nbytes))


def _inside(after: Probed, before: Probed | None) -> bool:
    """Whether the probed array ``after`` starts inside the buffer probed as ``before``."""
    return before is not None and _within(after[1], before[1], before[2])


def _within(at: int | None, lo: int | None, nbytes: int) -> bool:
    """Whether address ``at`` lies in the ``nbytes`` from ``lo`` (False where one is unknown)."""
    return lo is not None and at is not None and lo <= at < lo + nbytes


def _extracted(method: Method) -> Method:
    """``extract``: count only the rows that were really copied (``mx.contiguous`` shares a
    view that is already contiguous, e.g. row 0 of a one-row batch)."""
    @functools.wraps(method)
    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        result = method(self, *args, **kwargs)
        for name, kind in _ROW_ATTRS.items():
            value = getattr(result, name, None)
            if isinstance(value, mx.array) and value.size and not _shares(value, getattr(self, name, None)):
                add("extract", int(value.nbytes), kind=kind)
        return result

    return wrapper


def _kv_rows_merged(func: Method) -> Method:
    """``BatchKVCache.merge`` (its ``__func__``; the caller makes the wrapper a
    ``classmethod``): the rows copied (not the zero padding)."""

    @functools.wraps(func)
    def wrapper(cls: type, caches: Sequence[object], *args: object, **kwargs: object) -> object:
        result = func(cls, caches, *args, **kwargs)
        add("merge", sum(cache_bytes(c)[0] for c in caches), kind="kv")
        return result

    return wrapper


def _reserve(method: Method) -> Method:
    @functools.wraps(method)
    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        result = method(self, *args, **kwargs)
        if result:  # it padded: the used rows were copied into the bigger buffer
            add("reserve", cache_bytes(self)[0], kind="kv")
        return result

    return wrapper


def _batch_op(method: Method, op: str) -> Method:
    """``extend``/``filter``: count the live rows after the op when the buffer was rebuilt (not
    when they are a view inside the old one: a leave that kept its rows in place)."""
    @functools.wraps(method)
    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        before = _probe(self, ("keys",)).get("keys")
        result = method(self, *args, **kwargs)
        after = _probe(self, ("keys",)).get("keys")
        if after is not None and (before is None or after[:2] != before[:2]) and not _inside(after, before):
            add(op, cache_bytes(self)[0], kind="kv")
        return result

    return wrapper


def install(file: str | os.PathLike[str] | None = None) -> None:
    """Wrap the copying operations of mlx-vlm's caches and the patch (once), and switch the
    ledger on, mirrored to ``file`` (default ``APC_COPY_COUNTER_FILE``; None: no file).

    Install after the overlay (``server_patch.overlay.install``) when serving patched: this
    imports ``mlx_vlm``.
    """
    global _wrapped
    from server_patch import settings

    path = file if file is not None else settings.value(ENV_FILE)
    ledger.switch_on(path)
    if not _wrapped:
        _wrap()
        _wrapped = True
        log.info("apc_copyfree copy counter installed (file=%s)", path or None)


def _wrap() -> None:
    from mlx_vlm import apc as apc_module
    from mlx_vlm.models import cache as c

    # setattr: these replace methods of mlx-vlm's classes (and MlxKV's) in place, on purpose.
    setattr(c.BatchKVCache, "merge", classmethod(_kv_rows_merged(c.BatchKVCache.__dict__["merge"].__func__)))
    setattr(c.BatchKVCache, "extract", _extracted(c.BatchKVCache.extract))
    setattr(c.KVCache, "extract", _extracted(c.KVCache.extract))
    setattr(c.KVCache, "prefix_cache_reserve", _reserve(c.KVCache.prefix_cache_reserve))
    setattr(c.BatchKVCache, "extend", _batch_op(c.BatchKVCache.extend, "extend"))
    setattr(c.BatchKVCache, "filter", _batch_op(c.BatchKVCache.filter, "filter"))
    kv_names, kv_kinds = ("keys", "values"), {"keys": "kv", "values": "kv"}
    setattr(c.KVCache, "update_and_fetch", _watched(c.KVCache.update_and_fetch, kv_names, kv_kinds))
    setattr(c.BatchKVCache, "update_and_fetch", _watched(c.BatchKVCache.update_and_fetch, kv_names, kv_kinds))
    pool_kinds = {"pooled": "kv", "buf_kv": "state", "buf_gate": "state"}
    setattr(c.PoolingCache, "update_and_fetch",
            _watched(c.PoolingCache.update_and_fetch, ("pooled",), pool_kinds))
    setattr(c.PoolingCache, "accumulate_windows", _watched(
        c.PoolingCache.accumulate_windows, ("buf_kv", "buf_gate"), pool_kinds))
    setattr(c.BatchPoolingCache, "update_and_fetch", _watched(
        c.BatchPoolingCache.update_and_fetch, ("pooled",), pool_kinds))
    setattr(c.BatchPoolingCache, "merge",
            classmethod(_after(c.BatchPoolingCache.__dict__["merge"].__func__, "merge")))
    setattr(c.BatchPoolingCache, "extract", _extracted(c.BatchPoolingCache.extract))
    setattr(c.ArraysCache, "merge", classmethod(_after(c.ArraysCache.__dict__["merge"].__func__, "merge")))
    setattr(apc_module, "_clone_prompt_cache_for_apc", _after(apc_module._clone_prompt_cache_for_apc, "clone"))

    from server_patch.state import layout

    prefix = layout.MlxKV.prefix

    @functools.wraps(prefix)
    def counted_prefix(self: layout.MlxKV, length: int) -> layout.MlxKV:
        result = prefix(self, length)
        add("anchor", result.nbytes, kind="kv")
        return result

    setattr(layout.MlxKV, "prefix", counted_prefix)
