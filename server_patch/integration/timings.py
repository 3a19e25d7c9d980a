"""Per-request timing records: two greppable log lines each, and a ring buffer for /admin.

A record is opened at lookup (keyed by the prompt), bound to the generator's uid when the
prompt batch is built, filled in at commit, prefill completion and first token, then logged
and observed into the book's Prometheus histograms (``metrics``, read by /admin/metrics).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable

from server_patch import clock
from server_patch.admin.metrics import RequestMetrics
from server_patch.copyfree import ledger
from server_patch.lineage import COLD

log = logging.getLogger("server_patch.lineage")

RING_SIZE = 2048
_PENDING_MAX = 256


class Outcome(StrEnum):
    """How a request ended, when not by itself ("" in its record: it went on past its first token)."""

    CANCELLED = "cancelled"  # its client went away


class Phase(StrEnum):
    """Where a cancelled request was."""

    QUEUED = "queued"  # before its prefill and lookup: its record is made at the cancel
    PREFILL = "prefill"  # no first token: its record ends there
    DECODE = "decode"  # after its first token


class Stored(StrEnum):
    """What a cancelled request's entry kept."""

    NOTHING = "nothing"
    PROMPT = "prompt"  # the prompt-end commit
    REPLY = "reply"  # reply reuse kept what was fed


CANCELLED = Outcome.CANCELLED
QUEUED, PREFILL, DECODE = Phase.QUEUED, Phase.PREFILL, Phase.DECODE


@dataclass
class RequestTiming:
    """What one request cost, split where an operator can act on it."""

    seq: int
    started: float
    prompt_tokens: int
    restore_kind: str = COLD
    restored_tokens: int = 0
    entry_id: str = ""
    # How the restored KV reached the batch: "lent" (the entry's own buffer, no copy),
    # "copied" (the one merge copy), "" (cold).
    kv_admission: str = ""
    lookup_ms: float = 0.0
    admission_ms: float = 0.0
    prefill_ms: float = 0.0
    commit_ms: float = 0.0
    ttft_ms: float = 0.0
    request_id: str = ""
    uid: Any = None
    captures: list[str] = field(default_factory=list)
    # Reply reuse: generated tokens its entry kept past the prompt when the request ended
    # (0: none, or the entry stayed at the prompt end). Set after the first token is logged.
    reply_tokens: int = 0
    # With the copy counter on (APC_COPY_COUNTER=1): the running totals at lookup, then, from
    # the first token on, the bytes copied since by "op.kind" ({} with the counter off).
    copies: Any = field(default_factory=ledger.mark)
    # ``Outcome`` ("" for a request that reached its first token and went on); for a cancelled
    # one, the ``Phase`` it was in and what its entry kept (``Stored``).
    outcome: str = ""
    phase: str = ""
    stored: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("uid", None)
        return out


def _fmt(**fields: Any) -> str:
    return " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


class TimingBook:
    """Open records by prompt key and by uid; finished records in a bounded ring and in ``metrics``."""

    def __init__(self, ring_size: int = RING_SIZE) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._by_key: OrderedDict[Any, RequestTiming] = OrderedDict()
        self._by_uid: OrderedDict[Any, RequestTiming] = OrderedDict()
        self.ring: deque[RequestTiming] = deque(maxlen=ring_size)
        self.listeners: list[Callable[[RequestTiming], None]] = []  # each finished record, once
        # Records already given to ``listeners`` whose outcome came later (cancelled in decode).
        self.outcome_listeners: list[Callable[[RequestTiming], None]] = []
        self.metrics = RequestMetrics()

    def open(self, key: Any, prompt_tokens: int) -> RequestTiming:
        with self._lock:
            record = RequestTiming(next(self._seq), clock.wall(), prompt_tokens)
            self._by_key[key] = record
            while len(self._by_key) > _PENDING_MAX:
                self._by_key.popitem(last=False)
            return record

    def by_key(self, key: Any) -> RequestTiming | None:
        with self._lock:
            return self._by_key.get(key)

    def bind(self, uid: Any, key: Any) -> None:
        """Attach the record opened for prompt ``key`` to the generator's ``uid``."""
        with self._lock:
            record = self._by_key.pop(key, None)
            if record is None:
                return
            record.uid = uid
            self._by_uid[uid] = record
            while len(self._by_uid) > _PENDING_MAX:
                self._by_uid.popitem(last=False)

    def by_uid(self, uid: Any) -> RequestTiming | None:
        with self._lock:
            return self._by_uid.get(uid)

    def prefill_completed(self, uid: Any, request_id: str, prefill_s: float) -> None:
        record = self.by_uid(uid)
        if record is None:
            return
        record.request_id = str(request_id)
        record.prefill_ms = prefill_s * 1000
        log.info("apc_lineage restore %s", _fmt(
            request=record.request_id, kind=record.restore_kind, restored=record.restored_tokens,
            prompt=record.prompt_tokens, lookup_ms=record.lookup_ms,
            admission_ms=record.admission_ms, kv=record.kv_admission or "-", entry=record.entry_id or "-"))

    def first_token(self, uid: Any, request_id: str, ttft_s: float) -> None:
        with self._lock:
            record = self._by_uid.pop(uid, None)
        if record is None:
            return
        record.request_id = record.request_id or str(request_id)
        record.ttft_ms = ttft_s * 1000
        record.copies = ledger.since(record.copies)
        log.info("apc_lineage timing %s", _fmt(
            request=record.request_id, kind=record.restore_kind, prefill_ms=record.prefill_ms,
            commit_ms=record.commit_ms, ttft_ms=record.ttft_ms,
            captures=",".join(record.captures) or "-"))
        try:
            self.metrics.observe(record)
        except Exception as exc:  # a metric must never fail a request
            log.debug("apc_lineage request metrics failed: %s", exc)
        self._finish(record)

    def cancelled(self, uid: Any, request_id: Any) -> RequestTiming | None:
        """Request ``uid`` was cancelled (its client went away; called once the generator let
        it go, so what its entry kept is known). A record with no first token yet ends here,
        cancelled in prefill, and goes to the ring and the listeners like any other (not to
        the latency histograms: it has no first token); one already finished is marked
        cancelled in decode where it lies in the ring, and told to ``outcome_listeners``."""
        with self._lock:
            record, phase = self._by_uid.pop(uid, None), PREFILL
            if record is None:
                record = next((r for r in reversed(self.ring) if r.uid == uid), None)
                phase = DECODE
        if record is None:
            return None
        record.outcome, record.phase = CANCELLED, phase
        record.stored = (Stored.REPLY if record.reply_tokens else
                         Stored.PROMPT if record.commit_ms > 0 else Stored.NOTHING)
        record.request_id = record.request_id or str(request_id)
        log.info("apc_lineage cancelled %s", _fmt(
            request=record.request_id, phase=phase, kind=record.restore_kind,
            restored=record.restored_tokens, prompt=record.prompt_tokens, stored=record.stored))
        if phase == PREFILL:
            record.copies = ledger.since(record.copies)
            self._finish(record)
        else:
            self._notify(record, self.outcome_listeners)
        return record

    def cancelled_queued(self, request_id: Any, prompt_tokens: int) -> RequestTiming:
        """A request cancelled while queued (before its prefill, so before any lookup opened
        its record): its record is made now, with the next sequence number, and ends here."""
        with self._lock:
            record = RequestTiming(next(self._seq), clock.wall(), int(prompt_tokens), request_id=str(request_id),
                                   outcome=CANCELLED, phase=QUEUED, stored=Stored.NOTHING, copies={})
        log.info("apc_lineage cancelled %s", _fmt(
            request=record.request_id, phase=QUEUED, prompt=record.prompt_tokens, stored=record.stored))
        self._finish(record)
        return record

    def _finish(self, record: RequestTiming) -> None:
        """A record is complete: into the ring, then to the listeners."""
        with self._lock:
            self.ring.append(record)
        self._notify(record)

    def _notify(self, record: RequestTiming, listeners: list[Callable[[RequestTiming], None]] | None = None) -> None:
        for listener in list(self.listeners if listeners is None else listeners):
            try:
                listener(record)
            except Exception:
                pass

    def since(self, seq: int = 0) -> list[dict[str, Any]]:
        """Finished records newer than ``seq`` (for polling with ``since=``)."""
        with self._lock:
            return [r.as_dict() for r in self.ring if r.seq > seq]

    def all(self) -> Iterable[RequestTiming]:
        with self._lock:
            return list(self.ring)
