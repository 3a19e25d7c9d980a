"""Reply reuse on the server: the ids each tracked row was fed while decoding, and the check
that its cache holds exactly prompt + those ids before an entry's head moves past them.

mlx-vlm 0.7.10's ``GenerationBatch`` keeps no generated ids (``_num_tokens`` counts them;
``token_context`` holds them only while logits processors run), so ``GenerationBatch.next``
reports each step's ids here (``hooks.decoded``, ``overlay/patches/copyfree.py``). Its
pipelining makes the ids it reports exactly the ones the cache took: ``_step`` feeds
``_next_tokens`` and returns the ids it fed, and ``next`` emits them (a stop id included);
the id sampled last is never fed and never reported.

A row is tracked from its prefill end until it leaves the decoding batch (its row's ``reply``,
``integration.session``); a row no batch holds any more at a lookup has ended unseen
(``BatchRows.sweep``, the one sweep), so a row whose leaving was never seen costs nothing but
its reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from server_patch.state import rows
from server_patch.state.layout import CacheLayout, MlxSnapshot

if TYPE_CHECKING:
    from server_patch.copyfree.append import Base
    from server_patch.integration.generator import RowBatch
    from server_patch.integration.pending import Pending
    from server_patch.integration.timings import RequestTiming


@dataclass
class Reply:
    """One decoding row's prompt, its prompt-end snapshot and the ids fed after the prompt."""

    pending: Pending  # the request's prompt: tokens, namespace, captures taken, anchor label
    prompt_head: MlxSnapshot  # the snapshot at the prompt end: kept as the entry's protected checkpoint
    record: Optional[RequestTiming] = None  # its timing record, if any (``reply_tokens`` is filled in at the end)
    fed: list[int] = field(default_factory=list)
    base: Optional[Base] = None  # its prompt-end entry, once stored: the reply appends there

    @property
    def fed_length(self) -> int:
        """Tokens the row's cache must hold: the whole prompt and every fed reply id."""
        return int(self.pending.tokens.shape[0]) + len(self.fed)


def validated(layout: CacheLayout, reply: Reply, batch: RowBatch, idx: int) -> Optional[np.ndarray]:
    """The fed reply ids, if row ``idx`` of ``batch`` provably holds prompt + exactly those:
    the generator counted as many tokens as were reported, and every KV cache of the row
    holds that many rows. None otherwise (the entry then stays at the prompt end)."""
    counts = getattr(batch, "_num_tokens", None)
    if counts is None or idx >= len(counts) or int(counts[idx]) != len(reply.fed):
        return None
    if rows.fed_lengths(layout, list(batch.prompt_cache), idx) != {reply.fed_length}:
        return None
    return np.asarray(reply.fed, dtype=np.int32)


__all__ = ["Reply", "validated"]
