"""What a shared row's reply commit and a warm turn's merge copy cost on the generation thread.

``apcctl bench copies --context 16384 --reply 300`` (or ``python -m apcctl.lab.bench.reply_copy``): on the ``bench`` preset's
cache shapes (its KV weighs per token what the real model's does, ``apcctl.lab.tinymodel.presets``)
it times, in-process, the three copies issue 29 names, each to the end of its compute
(``mx.eval``):

* ``row copy``: today's fallback when a row that shared a batch ends, the whole row
  (``state.rows.kv_rows(copy=True)``, context + reply rows);
* ``append``: the bounded commit, only the reply's rows written into the spare rows of the
  entry's own buffer (``state.rows.append_rows`` into ``MlxKV.lend``'s buffers);
* ``merge``: a warm turn that cannot be lent, copied into a batch buffer with room
  (``copyfree.merge.merge_kv``), in one piece and as ``--slice``-row slices (what one decode
  step would wait for if the merge ran between steps).

The caches are filled with random rows, not prefilled (copy cost depends on bytes, not
values), so a 16k context takes seconds, not minutes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import mlx.core as mx


def bench_layout(context: int) -> tuple[Any, list[Any], Any]:
    """The bench preset's language model (random weights), its layout, and a single-row cache
    prefilled for 4 tokens (to learn every child's row shape)."""
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import LanguageModel

    from apcctl.lab.tinymodel.config import make_config
    from apcctl.lab.tinymodel.presets import PRESETS
    from server_patch.state.layout import CacheLayout

    text = make_config(PRESETS["bench"], defaultdict(int), 512)["text_config"]
    model = LanguageModel(TextConfig.from_dict(text))
    layout = CacheLayout.from_model(model)
    probe = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=probe).logits)
    return layout, probe, model


def shared_batch(probe: list[Any], rows: int, capacity: int) -> list[Any]:
    """Two-row ``BatchKVCache`` children (random rows, ``rows`` held, ``capacity`` allocated)
    shaped like ``probe``'s KV children; other children stay as probed."""
    from mlx_vlm.models.cache import BatchKVCache, BatchPoolingCache, CacheList, KVCache, PoolingCache

    def grow(child: Any) -> Any:
        if type(child) is KVCache and child.keys is not None:
            batch = BatchKVCache([0, 0])
            k, v = child.keys, child.values
            batch.keys = mx.random.normal((2, k.shape[1], capacity, k.shape[3])).astype(k.dtype)
            batch.values = mx.random.normal((2, v.shape[1], capacity, v.shape[3])).astype(v.dtype)
            batch._idx, batch.offset = rows, mx.array([rows, rows])
            return batch
        if type(child) is PoolingCache and child.pooled is not None:
            pool = BatchPoolingCache(child.ratio)
            p = child.pooled
            pool.pooled = mx.random.normal((2, rows // int(child.ratio), *p.shape[2:])).astype(p.dtype)
            pool.remainder = [0, 0]
            return pool
        return child

    out = [CacheList(*[grow(c) for c in cache.caches]) if type(cache) is CacheList else grow(cache)
           for cache in probe]
    mx.eval([c for layer in out for c in _arrays(layer)])
    return out


def _arrays(cache: Any) -> list[mx.array]:
    from mlx_vlm.models.cache import CacheList

    children = cache.caches if type(cache) is CacheList else [cache]
    return [x for child in children for x in (getattr(child, "keys", None), getattr(child, "values", None),
                                              getattr(child, "pooled", None)) if isinstance(x, mx.array)]


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Milliseconds of ``fn`` to the end of its compute, ``repeat`` times."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1000)
    return times


def run(context: int, reply: int, slice_rows: int, repeat: int) -> dict[str, Any]:
    from mlx_vlm.models.cache import KVCache

    from server_patch.copyfree import merge
    from server_patch.state import rows
    from server_patch.state.layout import MlxKV

    layout, probe, _ = bench_layout(context)
    length = context + reply
    shared = shared_batch(probe, length, merge.capacity(length))
    row_copy = timed(lambda: rows.kv_rows(layout, shared, 1, length, copy=True).arrays(), repeat)
    copied = _kv_bytes(rows.kv_rows(layout, shared, 1, length, copy=True).layers)

    def append() -> list[mx.array]:
        entry = rows.kv_rows(layout, shared, 0, context, copy=True)  # the entry: its own buffer
        padded = MlxKV([[{k: (merge.padded(v, merge.capacity(length + 512) - context) if k in ("keys", "values")
                              else v) for k, v in child.items()} for child in layer] for layer in entry.layers],
                       context)
        mx.eval(padded.arrays())
        del entry
        taken = padded.lend()
        start = time.perf_counter()
        layers, written, _ = rows.append_rows(layout, shared, 1, taken, context, length)
        mx.eval([v for layer in layers for child in layer for v in child.values() if isinstance(v, mx.array)])
        append_ms.append((time.perf_counter() - start) * 1000)
        appended.append(written)
        return []

    append_ms: list[float] = []
    appended: list[int] = []
    for _ in range(repeat):
        append()
    per_token = _kv_bytes(rows.kv_rows(layout, shared, 1, 1, copy=True).layers)
    kv_rows = [c for c in rows.row_caches(layout, shared, 1, kv=True, length=context, copy=True)]
    singles = [child for cache in kv_rows for child in (cache.caches if hasattr(cache, "caches") else [cache])
               if type(child) is KVCache and child.keys is not None]
    cap = merge.capacity(context + 256 + 512)
    whole = timed(lambda: [c.keys for c in (merge.merge_kv([s], cap) for s in singles)], repeat)
    sliced = []
    for _ in range(repeat):
        for lo in range(0, context, slice_rows):
            hi = min(context, lo + slice_rows)
            part = [KVCache() for _ in singles]
            for p, s in zip(part, singles):
                p.keys, p.values, p.offset = s.keys[..., lo:hi, :], s.values[..., lo:hi, :], hi - lo
            sliced.extend(timed(lambda: [merge.merge_kv([p], hi - lo).keys for p in part], 1))
    return {
        "context": context, "reply": reply, "kv_bytes_per_token": per_token,
        "row_copy_ms": _stats(row_copy), "row_copy_bytes": copied,
        "append_ms": _stats(append_ms), "append_bytes": appended[0],
        "merge_ms": _stats(whole), "merge_bytes": sum(int(x.keys.nbytes) + int(x.values.nbytes) for x in singles),
        "merge_slice_rows": slice_rows, "merge_slice_ms": _stats(sliced),
        "merge_slices": -(-context // slice_rows),
    }


def _kv_bytes(layers: list[list[dict]]) -> int:
    """Bytes of the float KV rows (``keys``/``values``) of a handle's layers."""
    return sum(int(v.nbytes) for layer in layers for child in layer for k, v in child.items()
               if k in ("keys", "values"))


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1), "max": round(max(values), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--reply", type=int, default=300)
    parser.add_argument("--slice", type=int, default=2048, dest="slice_rows")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(run(args.context, args.reply, args.slice_rows, args.repeat), indent=1))


if __name__ == "__main__":
    main()
