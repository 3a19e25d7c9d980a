"""Reply reuse under speculation: the ids each row of a speculative batch verified, round by round.

mlx-vlm 0.7.10's ``SpeculativeGenerationBatch`` decodes in rounds (``_mtp_rounds_batch``): the
target verifies ``[bonus, draft...]`` for every active row in one forward, and
``commit_speculative_round`` keeps ``accepted + 1`` of them per row (KV rows trimmed, the
recurrent state rolled back to the verified one). So after a commit, cache row ``j`` holds
what it held before plus exactly ``verify_input[j, :accepted[j] + 1]``: fed ids, as a plain
decode step's; a rejected draft never stays. The overlay reports each commit
(``overlay/patches/speculative.py``) and this book turns it into the fed ids of the rows'
tracked replies and the row order of the batch's caches as the last commit left them.

When rows finish, ``view`` hands ``BatchRows.leaving`` a ``VerifiedBatch``: the batch's caches
with the uid of each cache row and the ids verified into it, the shape a plain
``GenerationBatch`` offers (``prompt_cache``, ``uids``, ``_num_tokens``), so the one commit
path serves both. It fails closed: no round seen for this cache, a round whose rows do not
match the cache's, or a cache filtered since the last round give no view, and the rows'
replies are not stored (their entries stay at the prompt end). ``copyfree.replies.validated``
still checks that every KV cache of the row holds prompt + exactly the fed ids.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from server_patch.state import rows

log = logging.getLogger("server_patch.lineage")

#: The draft kinds whose round loop reports its commits (the overlay edits ``_mtp_rounds_batch``).
REPORTED_KINDS = frozenset({"mtp"})


@dataclass
class VerifiedBatch:
    """A speculative batch's rows as its last committed round left them: ``uids[i]`` is cache
    row ``i`` and ``_num_tokens[i]`` the ids verified into it since its prefill end."""

    prompt_cache: list[Any]
    uids: list[Any]
    _num_tokens: list[int]


@dataclass
class _Rounds:
    """One speculative batch's rounds, for the cache list they were verified into."""

    caches: Any  # the batch's ``prompt_cache`` list the rounds ran over (identity)
    order: list[Any] = field(default_factory=list)  # uid of each cache row after the last commit
    verified: dict[Any, int] = field(default_factory=dict)  # ids verified per uid
    broken: bool = False  # a round did not match the cache: nothing from this batch is stored


class RoundBook:
    """Verified rounds per live speculative batch (weakly held: a released batch is forgotten)."""

    def __init__(self) -> None:
        self._batches: "weakref.WeakKeyDictionary[Any, _Rounds]" = weakref.WeakKeyDictionary()

    def committed(self, batch: Any, verify_input: Any, accepted: Sequence[int], active: Sequence[int],
                  feed: Callable[[Any, list[int]], None]) -> None:
        """Round committed: cache row ``j`` took ``verify_input[j, :accepted[j] + 1]`` and is
        ``batch._all_uids[active[j]]``; ``feed(uid, ids)`` extends that row's tracked reply."""
        caches = batch.prompt_cache
        rounds = self._batches.get(batch)
        if rounds is None or rounds.caches is not caches:  # a new batch took this object's place
            rounds = self._batches[batch] = _Rounds(caches)
        all_uids = list(batch._all_uids)
        ids = verify_input.tolist()
        shape_ok = (len(ids) == len(accepted) == len(active) == rows.batch_size(list(caches))
                    and all(0 <= int(i) < len(all_uids) for i in active))
        if rounds.broken or not shape_ok:
            rounds.broken, rounds.order = True, []
            log.warning("apc_lineage speculative round of %d rows does not match its cache of %d: "
                        "no reply of this batch is kept", len(active), rows.batch_size(list(caches)))
            return
        rounds.order = [all_uids[int(i)] for i in active]
        for j, uid in enumerate(rounds.order):
            kept = [int(t) for t in ids[j][: int(accepted[j]) + 1]]
            rounds.verified[uid] = rounds.verified.get(uid, 0) + len(kept)
            feed(uid, kept)

    def view(self, batch: Any) -> Optional[VerifiedBatch]:
        """The batch's rows as the last commit left them; None if that is not provably so."""
        rounds = self._batches.get(batch)
        caches = getattr(batch, "prompt_cache", None)
        if rounds is None or rounds.broken or not rounds.order or rounds.caches is not caches:
            return None
        if rows.batch_size(list(caches)) != len(rounds.order):
            return None
        return VerifiedBatch(list(caches), list(rounds.order), [rounds.verified.get(u, 0) for u in rounds.order])


def reports_rounds(generator: Any) -> bool:
    """The generator speculates with a draft kind whose committed rounds are reported."""
    return getattr(generator, "draft_model", None) is not None and \
        getattr(generator, "draft_kind", None) in REPORTED_KINDS


__all__ = ["REPORTED_KINDS", "RoundBook", "VerifiedBatch", "reports_rounds"]
