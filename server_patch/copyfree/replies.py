"""Reply reuse on the server: the ids each tracked row was fed while decoding, and the check
that its cache holds exactly prompt + those ids before an entry's head moves past them.

mlx-vlm 0.7.10's ``GenerationBatch`` keeps no generated ids (``_num_tokens`` counts them;
``token_context`` holds them only while logits processors run), so ``GenerationBatch.next``
reports each step's ids here (``hooks.decoded``, ``overlay/patches/copyfree.py``). Its
pipelining makes the ids it reports exactly the ones the cache took: ``_step`` feeds
``_next_tokens`` and returns the ids it fed, and ``next`` emits them (a stop id included);
the id sampled last is never fed and never reported.

A row is tracked from its prefill end (``LineageCoordinator._commit``) until it leaves the
decoding batch; the book is bounded and forgets rows that are no longer in any batch, so a
row whose leaving was never seen costs nothing but its reply.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from server_patch.state import rows

_TRACKED_MAX = 512


@dataclass
class Reply:
    """One decoding row's prompt, its prompt-end snapshot and the ids fed after the prompt."""

    pending: Any  # the request's ``Pending``: tokens, namespace, captures taken, anchor label
    prompt_head: Any  # the snapshot at the prompt end: kept as the entry's protected checkpoint
    record: Any = None  # its timing record, if any (``reply_tokens`` is filled in at the end)
    fed: list[int] = field(default_factory=list)

    @property
    def fed_length(self) -> int:
        """Tokens the row's cache must hold: the whole prompt and every fed reply id."""
        return int(self.pending.tokens.shape[0]) + len(self.fed)


class ReplyBook:
    """Tracked rows by uid, bounded (oldest forgotten first). Generation thread only, but
    /admin may read its size, so a lock guards the dict."""

    def __init__(self, limit: int = _TRACKED_MAX) -> None:
        self._rows: OrderedDict[Any, Reply] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._rows)

    def track(self, uid: Any, reply: Reply) -> None:
        with self._lock:
            self._rows[uid] = reply
            while len(self._rows) > self._limit:
                self._rows.popitem(last=False)

    def decoded(self, uids: Sequence[Any], tokens: Sequence[int]) -> None:
        """One decode step: ``tokens[i]`` was fed to row ``uids[i]``."""
        if len(uids) != len(tokens):  # not the shape this hook was written for: stop tracking
            for uid in uids:
                self.take(uid)
            return
        for uid, token in zip(uids, tokens):
            reply = self._rows.get(uid)
            if reply is not None:
                reply.fed.append(int(token))

    def take(self, uid: Any) -> Optional[Reply]:
        with self._lock:
            return self._rows.pop(uid, None)

    def sweep(self, active: Iterable[Any]) -> None:
        """Forget rows no batch holds any more (their leaving was never reported)."""
        alive = set(active)
        with self._lock:
            for uid in [u for u in self._rows if u not in alive]:
                del self._rows[uid]


def validated(layout: Any, reply: Reply, batch: Any, idx: int) -> Optional[np.ndarray]:
    """The fed reply ids, if row ``idx`` of ``batch`` provably holds prompt + exactly those:
    the generator counted as many tokens as were reported, and every KV cache of the row
    holds that many rows. None otherwise (the entry then stays at the prompt end)."""
    counts = getattr(batch, "_num_tokens", None)
    if counts is None or idx >= len(counts) or int(counts[idx]) != len(reply.fed):
        return None
    if rows.fed_lengths(layout, list(batch.prompt_cache), idx) != {reply.fed_length}:
        return None
    return np.asarray(reply.fed, dtype=np.int32)


__all__ = ["Reply", "ReplyBook", "validated"]
