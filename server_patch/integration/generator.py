"""What the coordinator may know about the batch generator it serves: which rows are where.

mlx-vlm 0.7.10's ``BatchGenerator`` keeps a prompt batch (rows still prefilling) and a
generation batch (rows decoding), each with ``uids`` and per-layer ``prompt_cache``. The
coordinator holds it weakly (the server owns it) and reads only these attributes, so a
generator that lacks one reads as empty, never as an error.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

from server_patch.speculative.rounds import reports_rounds

_BATCHES = ("_generation_batch", "_prompt_batch")


class RowBatch(Protocol):
    """What the patch reads of an mlx-vlm prompt or generation batch (``GenerationBatch``,
    ``PromptProcessingBatch``; mlx-vlm's classes are untyped): its rows' uids, in order, and
    its per-layer caches (mlx-vlm's cache objects, untyped too)."""

    uids: list[int]
    prompt_cache: list[Any]


class PromptBatch(RowBatch, Protocol):
    """mlx-vlm's ``PromptProcessingBatch``: its rows, and one chunk of their prefill."""

    def prompt_step(self) -> int: ...


class GeneratorView:
    """A weak view of the attached generator: rows by uid, and whether it is plain."""

    def __init__(self) -> None:
        self._ref: Optional[weakref.ref[object]] = None

    def attach(self, generator: object) -> None:
        self._ref = weakref.ref(generator)

    @property
    def generator(self) -> object | None:
        """mlx-vlm's ``BatchGenerator`` (read by attribute name only, so any object will do)."""
        return self._ref() if self._ref is not None else None

    def row_of(self, uid: Optional[int]) -> Optional[tuple[list[Any], int]]:
        """Where row ``uid`` is now: (its batch's caches, its index) in the decoding batch or
        the prompt batch; None if neither holds it."""
        found = self._find(uid)
        if found is None or getattr(found[0], "is_speculative", False):
            return None  # its cache rows follow its rounds, not its uids (``BatchRows.rounds``)
        return list(found[0].prompt_cache), found[1]

    def max_tokens_of(self, uid: Optional[int]) -> Optional[int]:
        """The ``max_tokens`` row ``uid`` was admitted with (mlx-vlm's prompt and generation
        batches keep one per row); None if no batch holds it or it has none."""
        found = self._find(uid)
        if found is None:
            return None
        batch, idx = found
        every = getattr(batch, "_all_uids", None)  # a speculative batch keeps one per row it began with
        if isinstance(every, list) and uid in every:
            idx = every.index(uid)
        limits = getattr(batch, "max_tokens", None)
        return int(limits[idx]) if isinstance(limits, list) and idx < len(limits) else None

    def _find(self, uid: Optional[int]) -> Optional[tuple[RowBatch, int]]:
        """(the batch, the row's index) of row ``uid``: decoding first, then prefilling."""
        generator = self.generator
        for name in _BATCHES:
            batch: Optional[RowBatch] = getattr(generator, name, None)
            uids = list(getattr(batch, "uids", None) or ())
            if batch is not None and uid in uids:
                return batch, uids.index(uid)
        return None

    def plain(self) -> bool:
        """A generator is attached and it has no draft model."""
        generator = self.generator
        return generator is not None and getattr(generator, "draft_model", None) is None

    def verified(self) -> bool:
        """A generator is attached and every row's cache holds only verified tokens whenever
        the coordinator reads it: it has no draft model, or it speculates with a draft kind
        whose committed rounds are reported (``speculative.rounds``: mlx-vlm's
        ``SpeculativeGenerationBatch`` reports no fed ids, and writes draft rows it trims and
        rolls back within a round, between the coordinator's reads)."""
        generator = self.generator
        return generator is not None and (getattr(generator, "draft_model", None) is None
                                          or reports_rounds(generator))

    def active_uids(self) -> set[int] | None:
        """Every row in either batch; None if no generator is attached (nothing is known)."""
        generator = self.generator
        if generator is None:
            return None
        active: set[int] = set()
        for name in _BATCHES:
            active.update(getattr(getattr(generator, name, None), "uids", None) or ())
        return active


__all__ = ["GeneratorView", "PromptBatch", "RowBatch"]
