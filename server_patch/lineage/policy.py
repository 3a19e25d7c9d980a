"""The lineage cache policy: what to keep, where to restore, what to drop.

One entry per conversation lineage holds the state at its latest prompt; earlier restore points
are checkpoints of the snapshot layers only, sharing the entry's append-only KV rows. Anchors
(system prompt + tools) are separate pinned entries. The policy sees only sized handles, so the
same code drives the real mlx cache and the trace simulator.

Four verbs carry a request: ``lookup`` at admission, ``plan_captures`` before prefill,
``commit`` after prefill (or ``commit_reply`` when the request ends, with reply reuse: the head
moves past the generated reply, the prompt end stays a checkpoint; ``rewind`` moves it back),
``tick`` now and then. The admin verbs (``pin``, ``unpin``, ``evict``, ``flush``) and
``snapshot`` serve operators.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from server_patch.failclosed import fail_closed
from server_patch.lineage.budget import WriteQueue, plan_eviction
from server_patch.lineage.config import LineageConfig, ThinClass
from server_patch.lineage.handles import KVHandle, SnapshotHandle
from server_patch.lineage.holds import (BASE, DEFERRED, EVICT, FORBIDS, LENDING, LENT, LOAD, RESERVED, REWIND,
                                        WRITING, Hold, Holds)
from server_patch.lineage.invariants import InvariantError, hold_violations, loan_violations, violations
from server_patch.lineage.lookup import common_prefix_len
from server_patch.lineage.misses import Lost, MissBook
from server_patch.lineage.model import (
    ANCHOR, COLD, DISK, DIVERGENCE, FINAL, GUARD, PERIODIC, RAM, SEGMENT,
    Capture, Checkpoint, DiskRecord, Entry, Event, EventKind, Loan, RestorePlan, Reason, as_tokens,
)
from server_patch.lineage import anchor_share
from server_patch.lineage.summary import CANCELLED_QUEUED, disk_point_key, hits_key, kv_key
from server_patch.lineage.tally import EntryMap, RecordMap


_log = logging.getLogger("server_patch.lineage")


class DiskTier(Protocol):
    """Where entries go when RAM lets them go; the real one writes safetensors in a thread."""

    def records(self) -> Iterable[DiskRecord]:
        """The index, rebuilt from file headers at start."""
        ...

    def write(self, entry: Entry, done: Callable[[Entry, DiskRecord | None], None]) -> None:
        """Persist ``entry`` in the background and call ``done`` (record, or None on failure)."""
        ...

    def delete(self, record_id: str) -> None: ...

    # Optional attribute ``writes_in_background``: True where ``write`` only queues (its file
    # lands later, on another thread); a tier without it lands each write before ``write``
    # returns (the simulator's), and the budget pass writes what it pushes out (``budget``).


class CacheError(KeyError):
    """An admin request named something the cache does not hold."""


@dataclass
class _Candidate:
    length: int
    kind: str
    entry: Entry | None = None
    checkpoint: Checkpoint | None = None
    record: DiskRecord | None = None


class LineageCache:
    """Entries, checkpoints and anchors over sized state handles. Thread-safe."""

    def __init__(
        self,
        config: LineageConfig | None = None,
        *,
        disk: DiskTier | None = None,
        clock: Callable[[], float] = time.time,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.config = config or LineageConfig()
        self.disk = disk
        self.clock = clock
        self.on_event = on_event
        self.lock = threading.RLock()
        self._entries = EntryMap()  # keeps their bytes as they change (``tally``)
        self._records = RecordMap()
        self._superseded_by: dict[str, str] = {}
        # What requests and the writer hold (``holds``): loads until admitted (``hold``), staged
        # copies' bytes (``reserve``), loans (``lend``), let go one by one (``end``) or all at
        # once (``release``); queued writes (``_queued``, the writer's view of its holds)
        self._holds = Holds()
        self._queued = WriteQueue(self._holds)  # what the disk writer holds: counted in the RAM budget
        self.stats: Counter[str] = Counter()
        self.closed = False  # close(): its model is unloaded, nothing more is stored or written
        self.misses = MissBook.from_config(self.config, clock)  # the live oracle (``misses``)
        if disk is not None:
            for record in disk.records():
                self._records[record.id] = record

    # ------------------------------------------------------------------ reading

    def entries(self) -> list[Entry]:
        with self.lock:
            return sorted(self._entries.values(), key=lambda e: -e.last_used)

    def records(self) -> list[DiskRecord]:
        with self.lock:
            return sorted(self._records.values(), key=lambda r: -r.last_used)

    def get(self, entry_id: str) -> Entry | None:
        with self.lock:
            return self._entries.get(entry_id)

    @property
    def ram_bytes(self) -> int:
        """Bytes of the entries in RAM."""
        with self.lock:
            return self._entries.total

    @property
    def ram_used(self) -> int:
        """What the RAM budget bounds: the entries in RAM, what the disk writer holds of
        entries that left RAM (``budget``), and the files requests hold while they load
        (``holds``)."""
        with self.lock:
            return self.ram_bytes + self._queued.bytes_outside(self._entries) + self._holds.reserved()

    @property
    def disk_bytes(self) -> int:
        with self.lock:
            return self._records.total

    def budgets(self) -> dict[str, int]:
        """Used and limit per budget, for status screens and metrics."""
        with self.lock:
            anchors = self._entries.pinned_anchors()
            anchor_bytes = sum(self._entries.counted(e.id) for e in anchors)
            conv = self._entries.total - anchor_bytes
            queued = self._queued.bytes_outside(self._entries)
            loading = self._holds.reserved()
            return {
                "ram_used": conv + anchor_bytes + queued + loading,
                "ram_limit": self.config.ram_budget_bytes,
                "conversation_bytes": conv,
                "disk_queue_bytes": queued,
                "held_bytes": self._holds.pinned(self._entries.counted),  # in RAM, held for admission
                "loading_bytes": loading,  # files held while they load
                "anchor_bytes": anchor_bytes,
                "anchor_bytes_limit": self.config.anchor_max_bytes,
                "anchor_count": len(anchors),
                "anchor_count_limit": self.config.anchor_max_entries,
                "pinned_on_disk": self._records.pinned_anchors_outside(self._entries),
                "disk_used": self._records.total,
                "disk_limit": self.config.disk_max_bytes,
                "entries": len(self._entries),
                "disk_files": len(self._records),
            }

    # ------------------------------------------------------------------ lookup

    def lookup(self, tokens: Sequence[int] | np.ndarray, namespace: str = "", *,
               counted: bool = True, ram_only: bool = False) -> RestorePlan:
        """The longest restore point for ``tokens`` leaving at least one token to compute.

        RAM wins; the disk index is consulted only for something strictly longer. ``counted``
        False: a look ahead that is no lookup (a queued prompt asking whether its disk file
        must load first, ``integration.loading``), so the stats do not count it. ``ram_only``:
        the disk index is not consulted (a file that was not loaded ahead, ``flow.NOT_AHEAD``).
        """
        prompt = as_tokens(tokens)
        n = int(prompt.shape[0])
        limit = n - 1
        with self.lock:
            if counted:
                self.stats["lookups"] += 1
            best: _Candidate | None = None
            shared = durable = 0
            for entry in self._entries.values():
                if entry.namespace != namespace:
                    continue
                lcp = common_prefix_len(prompt, entry.tokens)
                shared = max(shared, lcp)
                cand = self._best_in_entry(entry, lcp, limit)
                if cand is not None and (best is None or cand.length > best.length):
                    best = cand
                durable = max(durable, self._durable_in_entry(entry, lcp, limit))
            ram_best = best.length if best is not None else 0
            for record in () if ram_only else self._disk_records():
                # A superseded file still restores correctly until its absorber is written (it
                # may hold a turn boundary the absorber has thinned), so it stays visible.
                if record.namespace != namespace or record.id in self._entries:
                    continue
                floor = best.length if best is not None else 0
                if 0 < floor < min(n, record.length) and record.tokens[floor] != prompt[floor]:
                    continue  # its prefix ends by ``floor`` <= ``shared``: no better point (a peer's index is large)
                lcp = common_prefix_len(prompt, record.tokens)
                shared = max(shared, lcp)
                cand = self._best_in_record(record, lcp, limit)
                if cand is not None and cand.length > ram_best and (best is None or cand.length > best.length):
                    best = cand
                    durable = max(durable, cand.length)  # a file keeps no reply marks
            if best is None or best.length < self.config.min_tokens:
                return RestorePlan(0, COLD, shared=shared, prompt_len=n)
            tier = DISK if best.record is not None else RAM
            durable = durable if durable >= self.config.min_tokens else 0
            return RestorePlan(best.length, best.kind, tier, best.entry, best.checkpoint,
                               best.record, shared=shared, prompt_len=n, durable=durable)

    def _disk_records(self) -> Iterable[DiskRecord]:
        """Our own files, then the shared tier's peer files we do not hold (issue 38): a
        peer's wins only where it restores strictly more (``lookup`` keeps the first best)."""
        yield from self._records.values()
        peers = getattr(self.disk, "peers", None)
        for record in peers.records() if peers is not None else ():
            if record.id not in self._records:
                yield record

    @staticmethod
    def _best_in_entry(entry: Entry, lcp: int, limit: int) -> _Candidate | None:
        for length, kind, cp in entry.restore_points():
            if length <= min(lcp, limit):
                return _Candidate(length, kind, entry=entry, checkpoint=cp)
        return None

    @staticmethod
    def _durable_in_entry(entry: Entry, lcp: int, limit: int) -> int:
        """The longest restore point of ``entry`` for this prompt that is no reply state."""
        for length, _, cp in entry.restore_points():
            reply_state = entry.prompt_end > 0 if cp is None else cp.reply_end
            if not reply_state and length <= min(lcp, limit):
                return length
        return 0

    @staticmethod
    def _best_in_record(record: DiskRecord, lcp: int, limit: int) -> _Candidate | None:
        for length, kind in record.restore_points():
            if length <= min(lcp, limit):
                return _Candidate(length, kind, record=record)
        return None

    def note_restore(self, plan: RestorePlan, admission: str = "", *, tier: str | None = None) -> None:
        """Count a restore that really happened (the plumbing calls this once it succeeded);
        ``admission`` says how its KV reached the batch (a ``KVAdmission``); ``tier``: where its
        state came from when that is not the plan's (a file promoted for it: ``DISK``), so it
        counts as ``disk`` as its request record says, with its plan's kind as the point."""
        with self.lock:
            now = self.clock()
            from_disk = plan.hit and (tier or plan.tier) == DISK
            self.stats[hits_key(DISK if from_disk else plan.log_kind)] += 1
            if from_disk:
                self.stats[disk_point_key(plan.kind)] += 1
            if admission:
                self.stats[kv_key(admission)] += 1
            self.stats["reused_tokens"] += plan.length
            self.stats["prefill_tokens"] += max(0, plan.prompt_len - plan.length)
            if plan.entry is not None and plan.entry.id in self._entries:
                self._entries.resized(plan.entry)  # lent just now: counted again until given back
                target: Any = plan.checkpoint or plan.entry
                target.hits += 1
                target.last_hit = now
                plan.entry.last_used = now
                if plan.checkpoint is not None:
                    plan.entry.hits += 1
                    plan.entry.last_hit = now

    def note_cold(self, plan: RestorePlan) -> None:
        """Count a cold prefill (a miss, or a restore that failed validation)."""
        with self.lock:
            self.stats[hits_key(COLD)] += 1
            self.stats["prefill_tokens"] += plan.prompt_len

    def count(self, key: str) -> None:
        """One more ``key`` in the stats (``/admin/stats``): a counter the plumbing keeps, such as
        how a reply commit copied or a prefetched load."""
        with self.lock:
            self.stats[key] += 1

    def note_cancelled_queued(self) -> None:
        """Count a request cancelled while queued: it never reached a lookup, but it is a
        request (``hits.requests`` and the records agree), counted neither hit nor cold."""
        with self.lock:
            self.stats[CANCELLED_QUEUED] += 1

    # ------------------------------------------------------------------ captures

    def plan_captures(
        self,
        tokens: Sequence[int] | np.ndarray,
        plan: RestorePlan,
        *,
        namespace: str = "",
        anchor_len: int | None = None,
        segments: Iterable[int] = (),
        drift_points: Iterable[int] = (),
    ) -> list[Capture]:
        """Lengths inside this prompt's uncached region where prefill must hand over state.

        ``drift_points`` (``server_patch.drift.DriftDetector.points``): where clients were seen
        to part from prompts like this one (its generation prompt's start, where a retry that
        drops the reply lands; a point where this namespace rebuilt its history on resume), each
        captured as a segment whatever its gap to the points above it, where it gains at least
        ``divergence_min_gain`` tokens over the nearest point below it (the plan's durable
        point or another capture): a capture splits the prefill, one more forward per turn.

        Only lengths strictly between the restore point and the prefill end are returned,
        except the anchor, which is pinned wherever it falls (at the prefill end it is the head).
        What a capture gains is measured from the plan's durable point (``RestorePlan.durable``):
        a reply state the plan restores may be thinned first, so it does not make a capture
        that reply-less restores would need look redundant.
        """
        cfg = self.config
        n = len(tokens)
        end = n - cfg.entry_offset  # the entry's own length: its head is not a capture
        start = plan.length
        base = plan.durable_length
        picks: dict[int, str] = {}

        if anchor_len is not None and cfg.min_tokens <= anchor_len <= end and anchor_len > start:
            if not self._has_anchor(tokens, anchor_len, namespace):
                picks[anchor_len] = ANCHOR
        if cfg.guard_tokens > cfg.entry_offset and end - base >= cfg.guard_min_suffix:
            guard = n - cfg.guard_tokens
            if start < guard < end:
                picks.setdefault(guard, GUARD)
        gain_point = min(plan.shared, end)
        if gain_point - base >= max(1, cfg.divergence_min_gain) and start < gain_point < end:
            picks.setdefault(gain_point, DIVERGENCE)
        if cfg.periodic_stride > 0 and end >= 2:
            periodic = ((end - 1) // cfg.periodic_stride) * cfg.periodic_stride
            if start < periodic < end:
                picks.setdefault(periodic, PERIODIC)
        known = sorted(set(int(s) for s in segments))
        inside = [seg for seg in known if start < seg < end]
        past_anchor = 0
        last = inside[-1] if inside else None
        if last is not None and last not in picks and last > base and end - last >= cfg.segment_min_gap \
                and (anchor_len is None or last >= anchor_len):
            # The start of the last message, whatever the gap to the restore point and the other
            # captures: where a re-sent conversation diverges when the client rewrites what
            # follows it (aider's moving reminder, an edit of the last message). Thinning keeps
            # it while this is the newest turn (``_turn_points``).
            picks[last] = SEGMENT
            past_anchor = 1
        taken = sorted({base, end, *picks})
        for seg in inside:
            if seg in picks:
                continue
            if all(abs(seg - other) >= cfg.segment_min_gap for other in taken):
                # Past the anchor they belong to the conversation, whose thinning keeps at most
                # max_checkpoints: asking for more would only hold states during a long prefill.
                if anchor_len is None or seg >= anchor_len:
                    past_anchor += 1
                    if past_anchor > cfg.max_checkpoints:
                        continue
                picks[seg] = SEGMENT
                taken = sorted({*taken, seg})
        for point in sorted(set(int(p) for p in drift_points)):
            below = max([base, *(p for p in picks if p < point)])
            if start < point < end and point - below >= max(1, cfg.divergence_min_gain):
                # Whatever its gap to the points above it, but only where it gains what a
                # divergence point must (each capture splits the prefill: one more forward of
                # the whole model per turn; measured +18 % TTFT on a 21-token warm turn, bench
                # ttft). A retry parting a few tokens past a lower point re-prefills those few.
                picks.setdefault(point, SEGMENT)
        if picks.get(gain_point) == DIVERGENCE and cfg.periodic_stride > 0 and known:
            # The stride point below a divergence point inside the last message (an edit of it
            # diverged there; ``known[-1]`` is where it starts), taken after the segments so it
            # never blocks one. A later prompt restoring at the divergence point and ending
            # before the next stride point is one stock 0.7.10, restoring less, prefills through
            # this point and snapshots; the next edit of the message may diverge anywhere above.
            floor = ((gain_point - 1) // cfg.periodic_stride) * cfg.periodic_stride
            if floor > start and floor >= known[-1]:
                picks.setdefault(floor, PERIODIC)
        return [Capture(length, kind) for length, kind in sorted(picks.items())
                if length >= cfg.min_tokens]

    def _has_anchor(self, tokens: Sequence[int] | np.ndarray, length: int, namespace: str) -> bool:
        prefix = as_tokens(tokens)[:length]
        with self.lock:
            for entry in self._entries.values():
                if entry.is_anchor and entry.namespace == namespace and entry.length == length \
                        and np.array_equal(entry.tokens, prefix):
                    return True
            return any(r.is_anchor and r.namespace == namespace and r.length == length
                       and np.array_equal(r.tokens, prefix) for r in self._records.values())

    # ------------------------------------------------------------------ commit

    def commit(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        kv: KVHandle,
        head: SnapshotHandle,
        captures: Mapping[int, tuple[str, SnapshotHandle]] | None = None,
        namespace: str = "",
        anchor_label: str = "",
        keep: Iterable[int] = (),
        last_start: int = 0,
    ) -> Entry | None:
        """Store the state at the prefill end of prompt ``tokens`` as its lineage's entry.

        ``kv``/``head`` hold the state at ``len(tokens) - entry_offset`` tokens; ``captures``
        maps capture lengths to (kind, snapshot). Entries this one extends are absorbed.
        ``keep``: the request's own lengths among the newest turn's points thinning keeps
        (``Entry.turn_points``; the flow passes where it restored and where its last message
        starts). ``last_start``: where the prompt's last message starts (0: unknown); the turn
        points of an entry this one absorbs that lie inside that message stay turn points.
        """
        prompt = as_tokens(tokens)
        stored = prompt[: prompt.shape[0] - self.config.entry_offset]
        return self._store(stored, kv, head, dict(captures or {}), namespace, anchor_label,
                           keep=tuple(keep), last_start=last_start)

    def commit_reply(
        self,
        tokens: Sequence[int] | np.ndarray,
        reply: Sequence[int] | np.ndarray,
        *,
        kv: KVHandle,
        head: SnapshotHandle,
        prompt_head: SnapshotHandle,
        captures: Mapping[int, tuple[str, SnapshotHandle]] | None = None,
        namespace: str = "",
        anchor_label: str = "",
        keep: Iterable[int] = (),
        last_start: int = 0,
    ) -> Entry | None:
        """Store the state after a request's reply as its lineage's entry (reply reuse).

        ``kv``/``head`` hold the state after every token the model was fed: prompt ``tokens``,
        then ``reply`` (the generated ids fed back; the last sampled one, never fed, excluded).
        ``prompt_head`` is the state at the prompt end (``len(tokens) - entry_offset``), where
        ``commit`` would put the head: it stays a FINAL checkpoint that thinning never drops
        while this is the newest turn, so a regenerate or an edited reply restores there and a
        next prompt never restores fewer tokens than without reply reuse. Entries this one
        extends (the prompt's own entry, if it was committed at its prefill end) are absorbed.
        """
        prompt = as_tokens(tokens)
        end = int(prompt.shape[0]) - self.config.entry_offset
        stored = np.concatenate([prompt, as_tokens(reply)])
        if end >= stored.shape[0]:  # nothing was fed past the prompt end: a plain commit
            return self.commit(tokens, kv=kv, head=head, captures=captures, namespace=namespace,
                               anchor_label=anchor_label, keep=keep, last_start=last_start)
        with self.lock:
            self.stats["reply_commits"] += 1
            self.stats["reply_tokens"] += int(stored.shape[0]) - int(prompt.shape[0])
        return self._store(stored, kv, head, dict(captures or {}), namespace, anchor_label,
                           prompt_end=(end, prompt_head), keep=tuple(keep), last_start=last_start)

    def _store(self, stored: np.ndarray, kv: KVHandle, head: SnapshotHandle,
               captures: dict[int, tuple[str, SnapshotHandle]], namespace: str, anchor_label: str,
               prompt_end: tuple[int, SnapshotHandle] | None = None,
               keep: tuple[int, ...] = (), last_start: int = 0) -> Entry | None:
        """``commit``'s body: ``stored`` are the entry's tokens; ``prompt_end`` the protected
        prompt-end checkpoint of a head that sits past its reply; ``keep`` the request's own
        lengths among the newest turn's points (``_turn_points``)."""
        cfg = self.config
        length = int(stored.shape[0])
        if length < cfg.min_tokens:
            return None
        if self.closed:  # a generation still draining after its model was unloaded
            with self.lock:
                self.stats["refused_closed"] += 1
            return None
        end = prompt_end[0] if prompt_end is not None else 0  # 0: the head is the prompt end
        turn = {end: (FINAL, prompt_end[1])} if prompt_end is not None else {}
        turn_points = self._turn_points(captures, keep)
        with self.lock:
            now = self.clock()
            anchors = []
            for cap_len, (kind, state) in sorted(captures.items()):
                if kind == ANCHOR:
                    anchor = self._store_anchor(stored, cap_len, kv, state, namespace, anchor_label, now)
                    if anchor is not None:
                        self._adopt_captures(anchor, captures, now)
                        anchors.append(anchor)
            same = self._find_identical(stored, namespace)
            if same is not None:
                same.last_used = now
                same.prompt_end = end
                same.turn_points = same.turn_points | turn_points
                self._add_checkpoints(same, {**captures, **turn}, now)
                self._take_in([*anchors, same])
                self._write_anchors(anchors)
                return same if self.holds(same) else None

            entry = Entry(id=uuid.uuid4().hex[:12], tokens=stored, kv=kv, head=head,
                          namespace=namespace, created=now, last_used=now,
                          prompt_end=end, turn_points=turn_points)
            self._add_checkpoints(entry, {**captures, **turn}, now)
            for old in self._absorbable(entry):
                entry.turn_points |= self._points_in_last_message(old, last_start)
                self._absorb(entry, old, now)
            self._entries[entry.id] = entry
            self.stats["stores"] += 1
            self._emit(Event(EventKind.STORE, entry.id, length, entry.nbytes))
            self._thin(entry)
            self._take_in([*anchors, entry])
            self._write_anchors(anchors)
            return entry if self.holds(entry) else None

    @staticmethod
    def _turn_points(captures: Mapping[int, tuple[str, SnapshotHandle]], keep: Iterable[int]) -> frozenset[int]:
        """The newest turn's points thinning keeps (``Entry.turn_points``, served by the longest
        checkpoint at or below each): where it restored (a reply end included: an edit of the
        message after it restores there), the start of its last message (``plan_captures``
        captures it; when the request restored past it, a second edit of that message needs
        the point below it) and its periodic points (the one stock 0.7.10 keeps inside it, and
        the one below a divergence point inside its last message, ``plan_captures``)."""
        periodic = {n for n, (kind, _) in captures.items() if kind == PERIODIC}
        return frozenset(periodic | {n for n in keep if n > 0})

    @staticmethod
    def _points_in_last_message(old: Entry, last_start: int) -> frozenset[int]:
        """``old``'s turn points inside the new prompt's last message (which starts at
        ``last_start``; 0: unknown, none). A prompt that extends ``old`` within one message (an
        edit that kept the whole message and went on) leaves them in the newest turn: stock
        0.7.10 keeps every point it stored inside that message, and the next edit of it may
        diverge at any of them (an earlier turn's periodic point, say)."""
        if last_start <= 0:
            return frozenset()
        return frozenset(n for n in old.turn_points if n >= last_start)

    # ------------------------------------------------------------------ loans

    def lend(self, plan: RestorePlan, owner: Hashable | None = None) -> Loan | None:
        """A receipt for ``plan.entry``'s KV rows, lent to the one request that restores at its
        head: a hold of kind ``LENT`` (``holds``), ``owner``'s (default: the receipt's own, for
        work that ends it itself); None where they may not be lent: the entry is not stored,
        already lent, or queued for writing (the writer reads its rows; the request then
        restores a copy). The one room where an entry becomes lent: until ``end`` (or
        ``release(owner)``) it is not evictable, writable nor rewindable."""
        with self.lock:
            entry = plan.entry
            if entry is None or not self.holds(entry) or not self._allows(entry, LENDING):
                return None
            loan = Loan(entry, entry.length)
            loan.owner = owner if owner is not None else loan
            self._holds.take(loan.owner, entry.id, 0, resident=True, kind=LENT, loan=loan)
            entry.loans += 1
            return loan

    def end(self, loan: Loan) -> None:
        """The borrower is done with the rows (given back, or its own entry absorbed them):
        its hold is let go."""
        with self.lock:
            if loan.ended:
                return
            if (hold := self._holds.of_loan(loan)) is not None:
                self._holds.drop(hold)
            self._ended(loan)

    def own(self, loan: Loan, owner: Hashable) -> None:
        """The loan is ``owner``'s from now on (lent before its request's row was named), so
        ``release(owner)`` lets it go with the rest."""
        with self.lock:
            if not loan.ended and (hold := self._holds.of_loan(loan)) is not None:
                self._holds.own(hold, owner)

    @staticmethod
    def _ended(loan: Loan) -> None:
        if not loan.ended:
            loan.ended = True
            loan.entry.loans -= 1

    # ------------------------------------------------------------------ holds

    def hold(self, owner: Hashable, entry_id: str, nbytes: int) -> bool:
        """``owner`` (a request) holds entry ``entry_id`` until ``release(owner)`` (``holds``):
        counted in the RAM budget with ``nbytes`` while it is not in RAM (its file loads), and
        never evicted while it is. False, nothing taken, where the budget cannot hold it beside
        what others hold: the caller waits its turn. The first hold, or one of an entry already
        held or in RAM, is always granted, so an entry that fits the budget alone restores."""
        with self.lock:
            if not (len(self._holds) == 0 or self._holds.held(entry_id) or entry_id in self._entries):
                held = self._holds.reserved() + self._holds.pinned(self._entries.counted)
                if held + int(nbytes) > self.config.ram_budget_bytes:
                    return False
            hold = self._holds.take(owner, entry_id, nbytes, resident=entry_id in self._entries, kind=LOAD)
            if not hold.resident:  # its bytes now count: what nobody holds makes room at once
                self._enforce_budgets(lossless=not self._writes_in_background())
            return True

    def reserve(self, owner: Hashable, key: str, nbytes: int) -> None:
        """``owner`` holds ``nbytes`` of RAM outside the entries (a staged copy of an entry's
        rows, ``key`` naming it) until ``release(owner)``: counted in the RAM budget, which
        makes room for it now (the copy exists whether or not it fits)."""
        with self.lock:
            self._holds.take(owner, key, nbytes, resident=False, kind=RESERVED)
            self._enforce_budgets(lossless=not self._writes_in_background())

    def reserve_spare(self, owner: Hashable, key: str, nbytes: int) -> bool:
        """``reserve`` for RAM the server can do without (the joint batch buffers made ahead,
        ``copyfree.spares``): held only where the RAM budget has ``nbytes`` free now, so it never
        evicts an entry nor exceeds the budget (a cached conversation is worth more than a join's
        allocation saved); else nothing is held and False."""
        with self.lock:
            if self.ram_used + nbytes > self.config.ram_budget_bytes:
                return False
            self._holds.take(owner, key, nbytes, resident=False, kind=RESERVED)
            return True

    def base(self, owner: Hashable, entry: Entry) -> bool:
        """``owner`` (a decoding request) will extend ``entry`` in place at its commit (its reply
        appended into the buffer's spare rows): a hold of kind ``BASE`` until that commit or
        ``release(owner)``. The entry is not rewound meanwhile, and under RAM pressure it leaves
        only after every conversation entry nobody holds (decision 0013, amended: the budget
        stays a bound; an evicted base makes its row copy at its end, as an operator's evict or
        a reset does). False, nothing taken, where ``entry`` is not stored."""
        with self.lock:
            if not self.holds(entry):
                return False
            self._holds.take(owner, entry.id, 0, resident=True, kind=BASE)
            return True

    def defer(self, owner: Hashable, key: str) -> None:
        """``owner`` (a lone decoding row) holds its own buffer (``key`` naming it) to be
        adopted as its entry at its commit: a hold of kind ``DEFERRED`` until that commit or
        ``release(owner)``. Not counted in the RAM budget (decision 0013: mlx-vlm's batch memory
        while the row decodes, the entry's once committed) and pinning nothing."""
        with self.lock:
            self._holds.take(owner, key, 0, resident=False, kind=DEFERRED)

    def release(self, owner: Hashable, kinds: Iterable[str] | None = None) -> int:
        """Everything ``owner`` holds (of ``kinds``, ``holds``' kinds; default: all) is let go
        (admitted, gone from the queue, or its request ended); what the budget cannot keep now
        may leave RAM. A loan let go here is ended: its owner gave its rows back first (the
        row machine ends a loan by its own events; this is the one sweep at a request's end).
        Returns how many holds it had."""
        with self.lock:
            let_go: list[Hold] = self._holds.release(owner, None if kinds is None else frozenset(kinds))
            for hold in let_go:
                if hold.loan is not None:
                    self._ended(hold.loan)
            if any(hold.kind not in (LENT, DEFERRED) for hold in let_go):  # what it kept may leave RAM
                self._enforce_budgets(lossless=not self._writes_in_background())
            return len(let_go)

    def _writes_in_background(self) -> bool:
        return bool(getattr(self.disk, "writes_in_background", False))

    def rewind(self, entry: Entry) -> bool:
        """Move ``entry``'s head back from past its reply to its prompt end: what the entry
        would be without reply reuse. For a next prompt that did not re-render the reply and
        restores at the prompt end anyway: the head is then where it restores, so the entry can
        lend its buffer (a loan appends at the head and would overwrite the reply's rows).
        The reply's state is given up. Returns False if there is nothing to rewind."""
        with self.lock:
            end = entry.prompt_end
            point = next((c for c in entry.checkpoints if c.length == end), None)
            if not self.holds(entry) or not self._allows(entry, REWIND) or point is None or not 0 < end < entry.length:
                return False
            entry.kv = entry.kv.truncated(end)
            entry.tokens = entry.tokens[:end].copy()
            entry.head, entry.prompt_end, entry.dirty = point.state, 0, True
            entry.checkpoints = [c for c in entry.checkpoints if c.length < end]
            entry.turn_points = frozenset(n for n in entry.turn_points if n < end)
            entry.hits += point.hits
            entry.last_hit = _latest(entry.last_hit, point.last_hit)
            self._entries.resized(entry)
            self.stats["reply_rewinds"] += 1
            self._emit(Event(EventKind.REWIND, entry.id, end, entry.nbytes, Reason.PROMPT_END))
            return True

    def _write_anchors(self, anchors: list[Entry]) -> None:
        """Anchors are what a restarted server needs first: written at once (once in RAM)."""
        for anchor in anchors:
            if self.disk is not None and self.holds(anchor) and self._needs_write(anchor):
                self._write(anchor)

    def _find_identical(self, stored: np.ndarray, namespace: str) -> Entry | None:
        for entry in self._entries.values():
            if not entry.is_anchor and entry.namespace == namespace and entry.length == stored.shape[0] \
                    and np.array_equal(entry.tokens, stored):
                return entry
        return None

    def _add_checkpoints(self, entry: Entry, captures: Mapping[int, tuple[str, SnapshotHandle]],
                         now: float) -> None:
        have = {c.length for c in entry.checkpoints}
        for cap_len, (kind, state) in sorted(captures.items()):
            if kind == ANCHOR or cap_len >= entry.length or cap_len in have:
                continue
            entry.checkpoints.append(Checkpoint(cap_len, kind, state, created=now))
            have.add(cap_len)
            entry.dirty = True
            self._emit(Event(EventKind.CHECKPOINT, entry.id, cap_len, int(state.nbytes), kind))
        entry.checkpoints.sort(key=lambda c: c.length)
        self._thin(entry)  # counts the entry again

    def _adopt_captures(self, anchor: Entry, captures: dict[int, tuple[str, SnapshotHandle]],
                        now: float) -> None:
        """Restore points inside the system+tools prefix belong to the pinned anchor.

        They are what the *next* agent variant needs (the end of the tools block before a
        changed system text, a timestamp), and in a conversation entry they would be the first
        thing thinning drops. Moved, not copied: the conversation entry does not keep them.
        """
        below = {n: c for n, c in captures.items() if n < anchor.length and c[0] != ANCHOR}
        for n in below:
            del captures[n]
        self._add_checkpoints(anchor, below, now)

    def _store_anchor(self, stored: np.ndarray, length: int, kv: KVHandle, state: SnapshotHandle,
                      namespace: str, label: str, now: float) -> Entry | None:
        if length > stored.shape[0] or self._has_anchor(stored, length, namespace):
            return None
        anchor = Entry(id=uuid.uuid4().hex[:12], tokens=stored[:length].copy(), kv=kv.prefix(length),
                       head=state, namespace=namespace, created=now, last_used=now,
                       is_anchor=True, pinned=True, label=label)
        self._entries[anchor.id] = anchor
        self.stats["anchors_pinned"] += 1
        self._emit(Event(EventKind.PIN, anchor.id, length, anchor.nbytes, Reason.CAPTURED))
        return anchor

    def _absorbable(self, new: Entry) -> list[Entry]:
        """Conversation entries whose whole token sequence is a prefix of ``new``."""
        found = []
        for entry in self._entries.values():
            if entry.is_anchor or entry.namespace != new.namespace or entry.length >= new.length:
                continue
            if common_prefix_len(new.tokens, entry.tokens) == entry.length:
                found.append(entry)
        return found

    def _absorb(self, new: Entry, old: Entry, now: float) -> None:
        """``old``'s head becomes a turn-boundary checkpoint of ``new`` (marked ``reply_end`` if
        it sat past its reply); its checkpoints carry over. Its protected prompt end is not
        protected any more and is stamped ``now``, as an absorbed head is: thinning then treats
        it exactly as it would treat that head without reply reuse."""
        have = {c.length for c in new.checkpoints}
        carried = [replace(c, created=now) if old.prompt_end and c.length == old.prompt_end
                   else c for c in old.checkpoints if c.length not in have]
        if old.length not in have:
            carried.append(Checkpoint(old.length, FINAL, old.head, created=now, last_hit=old.last_hit,
                                      hits=old.hits, reply_end=0 < old.prompt_end < old.length))
        new.checkpoints = sorted(new.checkpoints + carried, key=lambda c: c.length)
        new.hits += old.hits
        new.last_hit = _latest(new.last_hit, old.last_hit)  # its hits came with them: "hits 3, last_hit null" never
        del self._entries[old.id]
        if old.on_disk:
            new.supersedes.append(old.id)
        new.supersedes.extend(old.supersedes)
        self._superseded_by[old.id] = new.id
        self.stats["absorbs"] += 1
        self._emit(Event(EventKind.ABSORB, old.id, old.length, old.nbytes, f"into {new.id}"))

    # ------------------------------------------------------------------ thinning

    def _thin(self, entry: Entry) -> None:
        """Keep ``max_checkpoints``; the newest turn's prompt end (reply reuse) is not counted
        and never dropped, so an entry holds every restore point it would hold without. The
        checkpoints serving the newest turn's points (``Entry.turn_points``) are never dropped;
        they count, but for a reply end (``_counted``)."""
        cap = self.config.max_checkpoints
        while len(self._counted(entry)) > cap:
            victim = self._thin_victim(entry)
            if victim is None:
                break
            entry.checkpoints.remove(victim)
            entry.dirty = True
            self.stats["thinned"] += 1
            self._emit(Event(EventKind.THIN, entry.id, victim.length, victim.nbytes, victim.kind))
            self.misses.went(entry, Lost.THINNED, (victim.length,))
        self._entries.resized(entry)

    def _thin_victim(self, entry: Entry) -> Checkpoint | None:
        """Reply ends go first (what they add over the prompt ends is an edit of the message
        after a reply), then the configured classes in order."""
        kept = self._kept_points(entry)
        candidates = [c for c in self._counted(entry) if c.length not in kept]
        replies = [c for c in candidates if c.reply_end]
        if replies:
            return min(replies, key=lambda c: (c.created, c.length))
        guards = [c for c in candidates if c.kind == GUARD]
        newest_guard = max(guards, key=lambda c: (c.created, c.length)) if guards else None

        def klass(cp: Checkpoint) -> str:
            if cp.kind == GUARD:
                return ThinClass.GUARD if cp is newest_guard else ThinClass.STALE_GUARD
            if cp.kind in (FINAL, DIVERGENCE):
                return ThinClass.TURN
            return cp.kind

        for name in self.config.thin_order:
            members = [c for c in candidates if klass(c) == name]
            if members:
                if name == ThinClass.SEGMENT:
                    return self._segment_victim(entry, members)
                return min(members, key=lambda c: (c.created, c.length))
        return None

    def _counted(self, entry: Entry) -> list[Checkpoint]:
        """The checkpoints the cap counts: not the newest turn's prompt end, nor a reply end
        that serves one of its points (reply reuse keeps both on top of what the entry would
        hold without it), nor its generation prompt's start (``_resend_point``)."""
        kept = self._kept_points(entry)
        return [c for c in entry.checkpoints
                if c.length != entry.prompt_end and not (c.reply_end and c.length in kept)
                and not _resend_point(entry, c)]

    @staticmethod
    def _kept_points(entry: Entry) -> set[int]:
        """The checkpoints serving the newest turn's points: for each, the longest at or below it."""
        lengths = sorted(c.length for c in entry.checkpoints)
        kept = set()
        for point in entry.turn_points:
            below = [n for n in lengths if n <= point]
            if below:
                kept.add(below[-1])
        return kept

    @staticmethod
    def _segment_victim(entry: Entry, segments: list[Checkpoint]) -> Checkpoint:
        """Conversations drop their latest boundary (early ones are what other sessions share).

        An anchor spreads its boundaries instead: it drops the one closest to the restore point
        before it, and never its last one (the end of the tools block or of the system text),
        so many tool boundaries cannot push out the one the next agent variant needs.
        """
        if not entry.is_anchor or len(segments) < 2:
            return max(segments, key=lambda c: c.length)
        points = sorted(c.length for c in entry.checkpoints)

        def gap(cp: Checkpoint) -> int:
            before = [p for p in points if p < cp.length]
            return cp.length - (before[-1] if before else 0)

        ordered = sorted(segments, key=lambda c: c.length)
        return min(ordered[:-1], key=lambda c: (gap(c), c.length))

    # ------------------------------------------------------------------ budgets

    def _take_in(self, added: list[Entry]) -> None:
        """Make room for ``added`` (just stored or promoted; the last one is the entry the
        request made) now, never waiting for the disk writer (``budget``): this runs on the
        generation thread, and every decoding stream would wait with it. A tier whose writes
        land at once (the simulator's) has everything pushed out written; one that writes in
        the background (``DiskTier.writes_in_background``, the real store) frees RAM at once
        instead: entries already on disk first, and the least recently used entry without room
        in the writer's queue leaves RAM unwritten (``evicted_unwritten``). Metadata only."""
        self._enforce_budgets(keep=added[-1], lossless=not self._writes_in_background())

    def _enforce_budgets(self, keep: Entry | None = None, *, lossless: bool = False) -> None:
        """Anchor caps, then the RAM budget (see ``budget`` for what it counts and when an
        entry may leave RAM unwritten). Lent entries and entries whose write is in flight
        cannot leave: the passes go on over the others and stop only when none is left."""
        cfg = self.config
        for anchor in anchor_share.over_cap(self._entries.pinned_anchors(), size=lambda a: self._entries.counted(a.id),
                                            evictable=self._evictable, max_entries=cfg.anchor_max_entries,
                                            max_bytes=cfg.anchor_max_bytes):  # fair shares across API keys
            self._evict_ram(anchor, Reason.ANCHOR_CAP)
        excess = self.ram_used - cfg.ram_budget_bytes
        if excess <= 0:
            return
        chosen = plan_eviction(self._eviction_order(keep), excess,
                               self._needs_write, keep, lossless=lossless,
                               size=lambda e: self._entries.counted(e.id))
        written = {id(e) for e in chosen.written}
        for victim in chosen.victims:
            self._evict_ram(victim, Reason.RAM_BUDGET, write=id(victim) in written)

    def _evictable(self, entry: Entry) -> bool:
        """Not lent, not held by a request waiting for its admission (``hold``) nor by a
        decoding request's commit (``base``), and no write in flight (evicting it would free
        nothing until the write lands, and no pass waits for the writer)."""
        return self._allows(entry, EVICT)

    def _allows(self, entry: Entry, verb: str) -> bool:
        """Whether the holds on ``entry`` let ``verb`` (``holds``: evict, rewind, write, lend)
        be done to it: the one check (``holds.FORBIDS``; a loan names the entry object, so
        ``Entry.lent`` answers for its hold)."""
        return not (entry.lent and verb in FORBIDS[LENT]) and not self._holds.forbids(entry.id, verb)

    def _needs_write(self, entry: Entry) -> bool:
        """Whether leaving RAM loses state the disk lacks and no queued write will hold (a
        file deleted for the disk cap included: it is written again when it leaves RAM)."""
        return self.disk is not None and (entry.dirty or not entry.on_disk) \
            and not self._queued.holds(entry.id)

    def _eviction_order(self, keep: Entry | None) -> list[Entry]:
        """Evictable entries, least recently used first: conversations, then pinned anchors,
        then ``keep`` (the entry this pass was started for), and last of all those a decoding
        request's commit will extend (``BASE`` holds, decision 0013 amended: they leave only when
        nothing else can, so the budget stays a bound and their row copies at its end)."""
        others = (e for e in self._entries.values() if e is not keep and self._evictable(e))
        candidates = sorted(others, key=lambda e: e.last_used)
        ordinary = [e for e in candidates if not (e.is_anchor and e.pinned)]
        based = [e for e in ordinary if self._holds.based(e.id)]
        unbased = [e for e in ordinary if not self._holds.based(e.id)]
        pinned = [e for e in candidates if e.is_anchor and e.pinned]
        last = [keep] if keep is not None and self.holds(keep) and self._evictable(keep) else []
        return unbased + pinned + last + based

    def _evict_ram(self, entry: Entry, reason: str, *, write: bool = True) -> None:
        """Drop ``entry`` from RAM; what the disk lacks is written first (in the background)
        unless the budget has no room for it in the writer's queue (``write=False``)."""
        unwritten = self._needs_write(entry) and not write
        if write and self._needs_write(entry):
            self._write(entry)
        self._entries.pop(entry.id, None)
        self.stats["evictions"] += 1
        if unwritten:
            self.stats["evicted_unwritten"] += 1
        self._emit(Event(EventKind.EVICT, entry.id, entry.length, entry.nbytes,
                         f"{reason}, {Reason.UNWRITTEN}" if unwritten else reason))
        self.misses.went(entry, reason if unwritten or self.disk is None else
                         Lost.DISK_UNUSED if self._queued.holds(entry.id) else None)

    # ------------------------------------------------------------------ disk

    def tick(self, now: float | None = None) -> int:
        """Write entries that have been idle for ``disk_write_delay_s``; returns how many."""
        if self.disk is None:
            return 0
        with self.lock:
            now = self.clock() if now is None else now
            idle = [e for e in self._entries.values()
                    if e.dirty and self._allows(e, WRITING) and now - e.last_used >= self.config.disk_write_delay_s]
            for entry in idle:
                self._write(entry)
            return len(idle)

    def flush(self) -> int:
        """Write every entry whose state changed since its last write (before a restart);
        returns how many were queued. An entry whose file went for the disk cap is not
        rewritten: the cap keeps the most recent files."""
        if self.disk is None:
            return 0
        with self.lock:
            dirty = [e for e in self._entries.values() if e.dirty and self._allows(e, WRITING)]
            for entry in dirty:
                self._write(entry)
            return len(dirty)

    def _write(self, entry: Entry) -> None:
        assert self.disk is not None
        if self.closed:
            return  # stays dirty: the runtime's close already flushed what it could
        entry.dirty = False
        self._queued.add(entry.id, entry.nbytes)  # before: a writer may call back at once
        try:
            self.disk.write(entry, self._written)
        except Exception as exc:  # stays dirty: the next tick or flush tries again
            self._queued.done(entry.id)
            entry.dirty = True
            self.stats["disk_write_failures"] += 1
            self._emit(Event(EventKind.DISK_WRITE_FAILED, entry.id, entry.length, 0, str(exc)))

    def _written(self, entry: Entry, record: DiskRecord | None) -> None:
        """Writer callback: index the file, delete what it supersedes, keep the disk cap."""
        with self.lock:
            self._queued.done(entry.id)
            if record is None:
                entry.dirty = True
                self.stats["disk_write_failures"] += 1
                return
            absorber = self._resolve_absorber(entry.id)
            record.pinned = entry.pinned
            self._records[record.id] = record
            entry.on_disk = True
            self.stats["disk_writes"] += 1
            self.stats["disk_bytes_written"] += record.nbytes
            self._emit(Event(EventKind.DISK_WRITE, entry.id, entry.length, record.nbytes))
            if absorber is not None:
                # Absorbed while its write was in flight: the absorber's file will supersede it.
                if absorber.on_disk and not absorber.dirty:
                    self._delete_record(record.id, Reason.SUPERSEDED)
                else:
                    absorber.supersedes.append(record.id)
            for old_id in entry.supersedes:
                self._delete_record(old_id, Reason.SUPERSEDED)
            entry.supersedes.clear()
            if record.nbytes > self.config.disk_max_bytes:  # can never fit: it goes, not the others
                self._delete_record(record.id, Reason.DISK_CAP)
                self.stats["disk_evictions"] += 1
            self._enforce_disk_cap()

    def absorbed_into(self, entry_id: str) -> str | None:
        """The entry that absorbed ``entry_id`` (its conversation's longer entry), followed
        along later absorptions to the last one; None if it was never absorbed."""
        with self.lock:
            seen, current = {entry_id}, self._superseded_by.get(entry_id)
            while current is not None and (following := self._superseded_by.get(current)) not in seen | {None}:
                seen.add(current)
                current = following
            return current

    def _resolve_absorber(self, entry_id: str) -> Entry | None:
        seen = set()
        current = self._superseded_by.get(entry_id)
        while current is not None and current not in seen:
            seen.add(current)
            if current in self._entries:
                return self._entries[current]
            current = self._superseded_by.get(current)
        return None

    def _delete_record(self, record_id: str, reason: str) -> None:
        record = self._records.pop(record_id, None)
        if record is None:
            return
        if self.disk is not None:
            self.disk.delete(record_id)
        entry = self._entries.get(record_id)
        if entry is not None:
            # Not dirty: its state did not change, it is only not on disk any more. An idle
            # tick does not write it again (that would delete another file, forever); leaving
            # RAM does (``_needs_write``), and the disk cap then keeps the most recent files.
            entry.on_disk = False
        self.stats["disk_deletes"] += 1
        self._emit(Event(EventKind.DISK_DELETE, record_id, record.length, record.nbytes, reason))
        if entry is None and reason == Reason.DISK_CAP:
            self.misses.went(record, reason)

    def _enforce_disk_cap(self) -> None:
        """Evict least recently used files; pinned anchors are the last candidates, not exempt."""
        cap = self.config.disk_max_bytes
        total = self._records.total
        if total <= cap:
            return
        target = cap * self.config.disk_low_watermark
        for record in sorted(self._records.values(), key=lambda r: (r.pinned, r.last_used)):
            if total <= target:
                break
            total -= record.nbytes
            self._delete_record(record.id, Reason.DISK_CAP)
            self.stats["disk_evictions"] += 1

    def promote(self, record: DiskRecord, entry: Entry | None, reason: str = "") -> Entry | None:
        """Put a loaded disk entry into RAM, or forget a record whose file failed validation
        (``entry`` None; ``reason`` says why, in the event)."""
        with self.lock:
            if entry is None:
                self._records.pop(record.id, None)
                self.stats["disk_rejects"] += 1
                self._emit(Event(EventKind.DISK_REJECT, record.id, record.length, record.nbytes,
                                 reason or Reason.FAILED_VALIDATION))
                self.misses.went(record, Lost.DISK_REJECTED)
                return None
            now = self.clock()
            entry.on_disk, entry.dirty = True, False
            if getattr(record, "store", None) is not None:  # a peer's file: ours only once we write it
                entry.on_disk, entry.dirty = False, True
            entry.last_used = now
            entry.pinned = record.pinned
            record.last_used = now
            self._entries[entry.id] = entry
            self._holds.settle(entry.id)  # a request's hold pins it from now on
            self._emit(Event(EventKind.PROMOTE, entry.id, entry.length, entry.nbytes))
            self._take_in([entry])
            return entry if self.holds(entry) else None

    # ------------------------------------------------------------------ admin verbs

    def pin(self, entry_id: str) -> Entry:
        with self.lock:
            entry = self._require(entry_id)
            entry.pinned = True
            entry.is_anchor = True
            if entry.id in self._records:
                self._records[entry.id].pinned = True
            self._entries.resized(entry)  # an anchor now
            self._emit(Event(EventKind.PIN, entry.id, entry.length, entry.nbytes, Reason.OPERATOR))
            self._enforce_budgets(keep=entry)
            return entry

    def unpin(self, entry_id: str) -> Entry:
        with self.lock:
            entry = self._require(entry_id)
            entry.pinned = False
            if entry.id in self._records:
                self._records[entry.id].pinned = False
            self._emit(Event(EventKind.UNPIN, entry.id, entry.length, entry.nbytes))
            return entry

    def evict(self, entry_id: str, reason: str = Reason.OPERATOR) -> int:
        """Remove an entry or anchor from RAM and disk; returns the bytes freed. ``reason``: who
        asked (an operator, or apcctl restart removing its probe anchor)."""
        with self.lock:
            entry = self._entries.pop(entry_id, None)
            record = self._records.get(entry_id)
            if entry is None and record is None:
                raise CacheError(entry_id)
            self._holds.unsettle(entry_id)  # an operator's evict wins; a holder plans again
            freed = (entry.nbytes if entry is not None else 0) + (record.nbytes if record else 0)
            if record is not None:
                self._delete_record(entry_id, reason)
            if entry is not None:
                for old_id in entry.supersedes:
                    self._delete_record(old_id, reason)
            self.stats["operator_evictions" if reason == Reason.OPERATOR else "probe_evictions"] += 1
            gone = entry if entry is not None else record
            assert gone is not None  # raised CacheError above when both are None
            self._emit(Event(EventKind.EVICT, entry_id, gone.length, freed, reason))
            self.misses.went(gone, reason)
            return freed

    def drop(self, entry_id: str, reason: str) -> bool:
        """Forget a RAM entry whose state can no longer be trusted; its disk file, if any,
        holds an older valid state and stays. Returns whether it was there."""
        with self.lock:
            entry = self._entries.pop(entry_id, None)
            if entry is None:
                return False
            self._holds.unsettle(entry_id)
            self.stats["dropped"] += 1
            self._emit(Event(EventKind.EVICT, entry.id, entry.length, entry.nbytes, reason))
            self.misses.went(entry, reason)
            return True

    def holds(self, entry: Entry) -> bool:
        """Whether ``entry`` (this very object) is still one of the stored entries."""
        with self.lock:
            return self._entries.get(entry.id) is entry

    def check(self) -> None:
        """Raise ``InvariantError`` naming every invariant the state breaks (``invariants``):
        the tallies, checkpoint order, prompt ends, loans in the write queue, supersede cycles.
        One pass, no mlx work: the tests run it after every verb."""
        with self.lock:
            found = violations(self._entries, self._records, self._queued, self._superseded_by)
            found += loan_violations(self._entries, self._holds.loans())
            found += hold_violations(self._entries, self._holds)
        if found:
            raise InvariantError(found)

    def clear(self) -> None:
        """Forget RAM entries, anchors included (disk files stay): mlx-vlm's ``/v1/cache/reset``
        (``integration.runtime``). A lent entry's loan then ends with its entry gone (dropped)."""
        with self.lock:
            for entry in list(self._entries.values()):
                self._holds.unsettle(entry.id)
                self._emit(Event(EventKind.EVICT, entry.id, entry.length, entry.nbytes, Reason.RESET))
                self.misses.went(entry, Reason.RESET)
            self._entries.clear()
            self.stats["resets"] += 1

    def close(self) -> None:
        """Store and write nothing more (the runtime is closed: its model was unloaded or
        replaced); lookups still answer from what is held until the cache is dropped."""
        with self.lock:
            self.closed = True

    def _require(self, entry_id: str) -> Entry:
        entry = self._entries.get(entry_id)
        if entry is None:
            raise CacheError(entry_id)
        return entry

    def _emit(self, event: Event) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception as exc:  # an observer must never break the cache (but in tests)
                fail_closed(exc, f"lineage event observer ({event.kind})", log=_log, level=logging.DEBUG)


# Tokens below the newest turn's prompt end where its generation prompt may start.
RESEND_WINDOW = 8


def _resend_point(entry: Entry, cp: Checkpoint) -> bool:
    """``cp`` is the newest turn's generation-prompt start (a drift point, ``plan_captures``):
    where a retry that drops the reply restores. Like the prompt end it is kept on top of the
    cap while its turn is the newest; the next turn makes it an ordinary segment, thinned first."""
    end = entry.prompt_end
    return bool(end) and end - RESEND_WINDOW <= cp.length < end and cp.kind == SEGMENT \
        and cp.length in entry.turn_points


def _latest(*times: float | None) -> float | None:
    """The latest of ``times`` that is known (None if none is): hits carried over bring their time."""
    return max((t for t in times if t is not None), default=None)
