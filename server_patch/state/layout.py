"""A model's cache layout, and the two handles the policy stores: KV rows and snapshots.

``CacheLayout.from_model`` classifies every layer (and every ``CacheList`` child) once at
startup. ``split`` turns live per-row caches into references; ``build`` makes fresh cache
objects at a restore length whose KV are views truncated to that length. Nothing is copied:
evaluated MLX arrays are immutable and a slice update copies when another reference exists,
so holding references never lets a later write change a stored state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from server_patch.state.registry import DERIVED, Arrays, Codec, codec_for, is_composite


@dataclass(frozen=True)
class LayerLayout:
    codecs: tuple[Codec, ...]
    composite: bool


def _nbytes(arrays: Arrays) -> int:
    return sum(int(v.nbytes) for v in arrays.values() if isinstance(v, mx.array))


_ROW_AXIS = {"keys": 2, "values": 2, "pooled": 1}


def _kept_rows(key: str, child: Arrays, length: int) -> int:
    """Rows of ``child[key]`` that belong to the first ``length`` tokens."""
    return length // int(child["ratio"]) if key == "pooled" else length


def _row_arrays(child: Arrays) -> list[tuple[str, mx.array]]:
    return [(k, v) for k, v in child.items() if isinstance(v, mx.array)]


@dataclass
class MlxKV:
    """KV handle: per layer, per child, the append-only arrays (views up to ``length``)."""

    layers: list[list[Arrays]]
    length: int

    @property
    def nbytes(self) -> int:
        """Bytes of the used rows only, not of the buffers behind the views."""
        total = 0
        for layer in self.layers:
            for child in layer:
                for key, value in _row_arrays(child):
                    rows = int(value.shape[_ROW_AXIS[key]])
                    if rows:
                        total += int(value.nbytes) // rows * min(rows, _kept_rows(key, child, self.length))
        return total

    def prefix(self, length: int) -> "MlxKV":
        """An independent copy of rows [:length], so an anchor outlives its lineage's buffers."""
        layers = []
        for layer in self.layers:
            out = []
            for child in layer:
                copied = dict(child)
                for key, value in _row_arrays(child):
                    index = [slice(None)] * value.ndim
                    index[_ROW_AXIS[key]] = slice(0, _kept_rows(key, child, length))
                    # mx.array copies; mx.contiguous would return a contiguous view as is,
                    # and the anchor would keep the whole conversation buffer alive.
                    copied[key] = mx.array(value[tuple(index)])
                out.append(copied)
            layers.append(out)
        result = MlxKV(layers, length)
        mx.eval(result.arrays())
        return result

    def arrays(self) -> list[mx.array]:
        return [v for layer in self.layers for child in layer for _, v in _row_arrays(child)]


@dataclass
class MlxSnapshot:
    """Snapshot handle: per layer, per child, the snapshot arrays (references) at ``length``."""

    layers: list[list[Arrays]]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(child) for layer in self.layers for child in layer)

    def arrays(self) -> list[mx.array]:
        return [v for layer in self.layers for child in layer for v in child.values()
                if isinstance(v, mx.array)]


class CacheLayout:
    """The per-layer codecs of one model's prompt cache."""

    def __init__(self, layers: Sequence[LayerLayout]) -> None:
        self.layers = tuple(layers)

    @classmethod
    def from_model(cls, language_model: Any) -> "CacheLayout":
        """Classify ``language_model.make_cache()``; unknown classes raise at startup."""
        caches = language_model.make_cache()
        derived = derived_children(language_model)
        layers = []
        for i, cache in enumerate(caches):
            if is_composite(cache):
                codecs = tuple(DERIVED if j in derived.get(i, ()) else codec_for(child)
                               for j, child in enumerate(cache.caches))
                layers.append(LayerLayout(codecs, True))
            else:
                layers.append(LayerLayout((codec_for(cache),), False))
        return cls(layers)

    def describe(self) -> str:
        """A short string that two processes agree on iff their layouts match (disk headers)."""
        parts = []
        for layer in self.layers:
            names = ",".join(c.name for c in layer.codecs)
            parts.append(f"[{names}]" if layer.composite else names)
        return ";".join(parts)

    def _children(self, caches: Sequence[Any]) -> list[list[tuple[Codec, Any]]]:
        if len(caches) != len(self.layers):
            raise ValueError(f"cache has {len(caches)} layers, layout has {len(self.layers)}")
        out = []
        for layer, cache in zip(self.layers, caches):
            children = list(cache.caches) if layer.composite else [cache]
            if len(children) != len(layer.codecs):
                raise ValueError("cache layer does not match the layout")
            out.append(list(zip(layer.codecs, children)))
        return out

    def split(self, caches: Sequence[Any], length: int) -> tuple[MlxKV, MlxSnapshot]:
        """References to ``caches`` (one row, ``length`` tokens) as (KV rows, snapshot)."""
        rows, snaps = [], []
        for layer in self._children(caches):
            layer_rows, layer_snaps = [], []
            for codec, child in layer:
                r, s = codec.split(child)
                layer_rows.append(r)
                layer_snaps.append(s)
            rows.append(layer_rows)
            snaps.append(layer_snaps)
        kv, snapshot = MlxKV(rows, length), MlxSnapshot(snaps, length)
        # Views are graph nodes on the caller's stream; evaluate them here, on the thread that
        # built them, so the disk writer, the idle ticker and /admin/flush (other threads) only
        # ever read memory. Evaluating a slice copies nothing.
        mx.eval(kv.arrays(), snapshot.arrays())
        return kv, snapshot

    def snapshot(self, caches: Sequence[Any], length: int) -> MlxSnapshot:
        """Only the snapshot part: what a checkpoint holds (its KV rows are the entry's)."""
        return self.split(caches, length)[1]

    def build(self, kv: MlxKV, snapshot: MlxSnapshot, length: int) -> list[Any]:
        """Fresh cache objects at ``length``: KV views truncated, snapshots by reference."""
        if snapshot.length != length:
            raise ValueError(f"snapshot is at {snapshot.length} tokens, restore wants {length}")
        if length > kv.length:
            raise ValueError(f"KV rows hold {kv.length} tokens, restore wants {length}")
        caches = []
        for layer, rows, snaps in zip(self.layers, kv.layers, snapshot.layers):
            built = [codec.build(r, s, length) for codec, r, s in zip(layer.codecs, rows, snaps)]
            if layer.composite:
                from mlx_vlm.models.cache import CacheList

                caches.append(CacheList(*built))
            else:
                caches.append(built[0])
        return caches


def derived_children(language_model: Any) -> dict[int, set[int]]:
    """Cache children that are a function of other children and must never be stored.

    glm5_next's attention ``CacheList`` keeps a projected per-head K/V cache (~64x the latent);
    it is the last child: index 3 with its own indexer, index 1 on shared-indexer layers.
    """
    if "glm5_next" not in type(language_model).__module__:
        return {}
    layers = getattr(language_model, "layers", None)
    if layers is None:
        layers = language_model.model.layers
    derived: dict[int, set[int]] = {}
    for i, layer in enumerate(layers):
        if getattr(layer, "block_type", "") == "linear_attention":
            continue
        derived[i] = {1 if layer.self_attn.indexer is None else 3}
    return derived
