"""Per-request timing records: two greppable log lines each, and a ring buffer for /admin.

A record is opened at lookup and lives in its request's row (``integration.session``) while
it is filled in at commit, prefill completion and first token; then it is logged and observed
into the book's Prometheus histograms (``metrics``, read by /admin/metrics). Its waits for other
requests' work (``integration.waits``) go on accruing until its row ends (``TimingBook.ended``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, TypedDict

from server_patch import clock
from server_patch.integration.request_metrics import RequestMetrics
from server_patch.observe import ledger
from server_patch.observe.outcomes import Outcome, Phase, Stored
from server_patch.integration.waits import GAPS_KEPT, OWN_STEP, UNATTRIBUTED
from server_patch.lineage import COLD
from server_patch.observe.ledger import Totals

# One inter-token gap (``RequestTiming.close_gap``); ``worst_gap`` is {} before the first.
Gap = TypedDict("Gap", {"ms": float, "from": float, "to": float, "parts": dict[str, float]}, total=False)

log = logging.getLogger("server_patch.lineage")

RING_SIZE = 2048


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
    # Waiting for another's work: queued in LOADING while its restore point's disk file loaded
    # off the generation thread (``integration.loading``), and the decode steps the batch took
    # meanwhile (0, 0: it did not wait).
    loading_ms: float = 0.0
    loading_steps: int = 0
    prefill_ms: float = 0.0
    commit_ms: float = 0.0
    ttft_ms: float = 0.0
    request_id: str = ""
    uid: Optional[int] = None
    captures: list[str] = field(default_factory=list)
    # Reply reuse: generated tokens its entry kept past the prompt when the request ended
    # (0: none, or the entry stayed at the prompt end). Set after the first token is logged.
    reply_tokens: int = 0
    # With the copy counter on (APC_COPY_COUNTER=1): the running totals at lookup, then, from
    # the first token on, the bytes copied since by "op.kind" ({} with the counter off).
    copies: Optional[Totals] = field(default_factory=ledger.mark)
    # ``Outcome`` ("" for a request that reached its first token and went on); for a cancelled
    # one, the ``Phase`` it was in and what its entry kept (``Stored``).
    outcome: str = ""
    phase: str = ""
    stored: str = ""
    # The live oracle (``lineage.misses``): the tokens an unbounded cache would have restored,
    # and what it restored less, ``{reason: tokens}`` (a ``Lost`` each; {}: nothing lost).
    oracle: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    lost_why: str = ""  # why a disk file it would have restored from was rejected
    # What the client changed against the nearest earlier prompt of its namespace
    # (``server_patch.drift``): position, segment, cause, tokens, a short text diff; {}: nothing.
    drift: dict[str, Any] = field(default_factory=dict)
    # Waiting for other requests' work on the generation thread (``integration.waits``): in all,
    # by ``waits.Work`` ({kind: ms}), and its decode steps that work pushed back. They accrue
    # past the first token until the row ends (``ended``: final from then on).
    waited_ms: float = 0.0
    waited: dict[str, float] = field(default_factory=dict)
    delayed_steps: int = 0
    # Its inter-token gaps while it decoded, each split into named parts that add up to it
    # (``integration.waits``: its own ``step``, others' work by kind, ``unattributed``):
    # ``{"ms", "from", "to" (the server's monotonic seconds), "parts": {part: ms}}``. The
    # largest, the ``GAPS_KEPT`` largest that held others' work (largest first), and how many.
    worst_gap: Gap = field(default_factory=lambda: Gap())
    gaps: list[Gap] = field(default_factory=list)
    gap_count: int = 0
    ended: bool = False
    # The book's own marks, not in the JSON: in the ring (``TimingBook._finish``), and the
    # decode step ``waits`` last counted as delayed.
    finished: bool = False
    delay_mark: int = -1
    # The gap now open: since when (None: no token of a decode step yet), what was charged to it.
    gap_from: Optional[float] = None
    gap_parts: dict[str, float] = field(default_factory=dict)

    def close_gap(self, now: float) -> None:
        """A decode step gave it a token at ``now``: the gap since its previous one is over.
        Its parts are what was charged to it meanwhile, and the rest of it ``unattributed``."""
        began, parts = self.gap_from, self.gap_parts
        self.gap_from, self.gap_parts = now, {}
        if began is None:
            return
        ms = (now - began) * 1000
        named = {part: round(v, 3) for part, v in sorted(parts.items(), key=lambda kv: -kv[1])}
        gap: Gap = {"ms": round(ms, 3), "from": began, "to": now,
                    "parts": {**named, UNATTRIBUTED: round(ms - sum(parts.values()), 3)}}
        self.gap_count += 1
        if ms > self.worst_gap.get("ms", -1.0):
            self.worst_gap = gap
        if any(part != OWN_STEP for part in parts):
            kept = sorted([*self.gaps, gap], key=lambda g: -g["ms"])
            self.gaps = kept[:GAPS_KEPT]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for private in PRIVATE:
            out.pop(private, None)
        return out


PRIVATE = ("uid", "finished", "delay_mark", "gap_from", "gap_parts")  # fields of a record its JSON leaves out


def _fmt(**fields: object) -> str:
    return " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


class TimingBook:
    """Records from their opening to the ring: the open ones live in their request's session
    (``integration.session``); finished ones go to a bounded ring, the listeners and ``metrics``.
    It is the ring of the runtime's one ``SessionBook`` (``SessionBook.timings``), not a book of
    its own: every coordinator's scope of that book shares it."""

    def __init__(self, ring_size: int = RING_SIZE) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.ring: deque[RequestTiming] = deque(maxlen=ring_size)
        self.listeners: list[Callable[[RequestTiming], None]] = []  # each finished record, once
        # Records already given to ``listeners`` whose outcome came later (cancelled in decode).
        self.outcome_listeners: list[Callable[[RequestTiming], None]] = []
        # Records already in the ring whose row ended later (their waits final), numbered in
        # the order they ended, for the event stream's ``request_ended`` (``ended_since``).
        self.ended_ring: deque[tuple[int, RequestTiming]] = deque(maxlen=ring_size)
        self._ended_seq = 0
        self.metrics = RequestMetrics()

    def open(self, prompt_tokens: int) -> RequestTiming:
        """A new record, numbered (at lookup)."""
        with self._lock:
            return RequestTiming(next(self._seq), clock.wall(), prompt_tokens)

    def log_restore(self, record: RequestTiming, request_id: object, prefill_s: float) -> None:
        """Its prefill ended: the restore line."""
        record.request_id = str(request_id)
        record.prefill_ms = prefill_s * 1000
        log.info("apc_lineage restore %s", _fmt(
            request=record.request_id, kind=record.restore_kind, restored=record.restored_tokens,
            prompt=record.prompt_tokens, lookup_ms=record.lookup_ms,
            admission_ms=record.admission_ms, kv=record.kv_admission or "-", entry=record.entry_id or "-"))

    def finish(self, record: RequestTiming, request_id: object, ttft_s: float) -> None:
        """Its first token: the timing line, the histograms, the ring and the listeners."""
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

    def finished_record(self, uid: Optional[int]) -> RequestTiming | None:
        """The newest finished record of ``uid`` still in the ring."""
        with self._lock:
            return next((r for r in reversed(self.ring) if r.uid == uid), None)

    def cancel(self, record: RequestTiming, request_id: object, phase: Phase) -> RequestTiming:
        """``record``'s request was cancelled (its client went away) in ``phase``: in prefill
        (no first token) its record ends here and goes to the ring and the listeners like any
        other (not to the latency histograms: it has no first token); in decode (already
        finished) it is marked where it lies in the ring, and told to ``outcome_listeners``."""
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

    def cancelled_queued(self, request_id: object, prompt_tokens: int) -> RequestTiming:
        """A request cancelled while queued (before its prefill, so before any lookup opened
        its record): its record is made now, with the next sequence number, and ends here."""
        with self._lock:
            record = RequestTiming(next(self._seq), clock.wall(), int(prompt_tokens), request_id=str(request_id),
                                   outcome=CANCELLED, phase=QUEUED, stored=Stored.NOTHING, copies={},
                                   ended=True)
        log.info("apc_lineage cancelled %s", _fmt(
            request=record.request_id, phase=QUEUED, prompt=record.prompt_tokens, stored=record.stored))
        self._finish(record)
        return record

    def _finish(self, record: RequestTiming) -> None:
        """A record is complete: into the ring, then to the listeners."""
        with self._lock:
            self.ring.append(record)
            record.finished = True
            settled = record.ended
        self._notify(record)
        if settled:
            self._settled(record)

    def ended(self, record: RequestTiming) -> None:
        """``record``'s row ended (``integration.waits``): its waits are final. One already in
        the ring is told to the event stream again (``ended_since``); one not yet finished (a
        one-token reply's row may leave before the server reports its first token) carries
        them when it is."""
        with self._lock:
            if record.ended:
                return
            record.ended = True
            settled = record.finished
            if settled:
                self._ended_seq += 1
                self.ended_ring.append((self._ended_seq, record))
        if settled:
            self._settled(record)

    def _settled(self, record: RequestTiming) -> None:
        """Finished and ended: its waits go to the histograms (and one log line if it waited)."""
        if record.waited_ms > 0:
            log.info("apc_lineage waited %s", _fmt(
                request=record.request_id, waited_ms=record.waited_ms, delayed_steps=record.delayed_steps,
                **{kind: ms for kind, ms in sorted(record.waited.items())}))
        try:
            self.metrics.observe_waits(record)
        except Exception as exc:  # a metric must never fail a request
            log.debug("apc_lineage wait metrics failed: %s", exc)

    def ended_since(self, seq: int = 0) -> list[tuple[int, dict[str, Any]]]:
        """(number, record) of records whose row ended after number ``seq`` (the event stream)."""
        with self._lock:
            return [(n, r.as_dict()) for n, r in self.ended_ring if n > seq]

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
