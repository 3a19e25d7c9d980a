"""The real ``LineageCache`` driven by trace time, over sized handles and an in-memory disk.

Per request the adapter runs the server's own request flow (``server_patch.lineage.flow``)
after a ``tick`` (idle disk writes): admission (plan, load and promote a disk hit, plan again),
``rewind`` of an entry a prompt restores at its prompt end (as the server does before lending
a buffer), the restore or cold count, captures with the trace's anchor length and segments,
then ``commit`` of the state at n - 1 with one snapshot per capture, or, with reply reuse and a
trace that carries the request's reply, ``commit_reply``: the state after prompt + reply, the
n - 1 state kept as its checkpoint. Stored bytes: the entry's KV rows are one row-extraction copy per commit that creates an
entry; checkpoints are references to recurrent states prefill produced anyway (0 copies); an
anchor copies its KV prefix (``KVHandle.prefix``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from apcctl.lab.sim.policies.base import Ledger, Served
from apcctl.lab.sim.sizes import StateSizes
from apcctl.lab.sim.trace import Request
from server_patch.lineage import (
    COLD, Checkpoint, DiskRecord, Entry, Event, EventKind, LineageCache, LineageConfig, Reason, SizedKV,
    SizedSnapshot,
)
from server_patch.boundaries.kinds import Kind
from server_patch.drift import DriftDetector, DriftSettings
from server_patch.lineage.flow import Admission


@dataclass
class MemoryDisk:
    """A ``DiskTier`` that keeps records in a dict and counts bytes; writes complete at once."""

    ledger: Ledger
    files: dict[str, DiskRecord] = field(default_factory=dict)
    clock: Callable[[], float] = lambda: 0.0

    @property
    def held(self) -> int:
        return sum(r.nbytes for r in self.files.values())

    def records(self) -> list[DiskRecord]:
        return list(self.files.values())

    def write(self, entry: Entry, done: Callable[[Entry, DiskRecord | None], None]) -> None:
        record = DiskRecord(
            id=entry.id, tokens=entry.tokens.copy(), namespace=entry.namespace,
            checkpoints=tuple((c.length, c.kind) for c in entry.checkpoints),
            nbytes=entry.nbytes, last_used=self.clock(), is_anchor=entry.is_anchor,
            pinned=entry.pinned, label=entry.label,
        )
        self.files[record.id] = record  # a rewrite of the same entry replaces its file
        self.ledger.disk_bytes_written += record.nbytes
        done(entry, record)

    def delete(self, record_id: str) -> None:
        record = self.files.pop(record_id, None)
        if record is not None:
            self.ledger.disk_bytes_deleted += record.nbytes


class LineagePolicy:
    """``lineage`` (segments passed to ``plan_captures``), ``lineage-nosegments``, or
    ``lineage-nodrift`` (no drift points: the server with ``APC_DRIFT_POINTS=0``)."""

    def __init__(self, sizes: StateSizes, *, segments: bool = True, drift: bool = True,
                 config: LineageConfig | None = None) -> None:
        self.name = "lineage" if segments and drift else "lineage-nodrift" if segments else "lineage-nosegments"
        self.sizes = sizes
        self.use_segments = segments
        # The server's drift detector, without a decoder: its restore points (``points``).
        self.drift = DriftDetector(DriftSettings(text=False, absorb=drift))
        self.ledger = Ledger()
        self.now = 0.0
        self.disk = MemoryDisk(self.ledger, clock=lambda: self.now)
        self._anchor_ids: set[str] = set()
        self.cache = LineageCache(config or LineageConfig(), disk=self.disk,
                                  clock=lambda: self.now, on_event=self._on_event)
        self.cache.misses.sequence_listeners.append(self.drift.observe_sequence)

    # ------------------------------------------------------------------ per request

    def serve(self, req: Request) -> Served:
        self._advance(req.t)
        self.drift.observe(req.tokens, req.namespace, kinds={s: Kind.MESSAGE for s in req.segments},
                           gen_start=req.gen_start)
        flow = Admission.admit(self.cache, req.tokens, req.namespace, disk=self)
        plan = flow.rewind()  # the server rewinds to lend the buffer: same length
        if plan.hit:
            flow.restored()
        else:
            flow.cold()
        captures = flow.captures(anchor_len=req.anchor_len,
                                 segments=req.segments if self.use_segments else (),
                                 drift_points=self.drift.points(req.tokens, req.namespace, req.gen_start,
                                                                req.blocks))
        snap = self.sizes.snapshot_bytes
        taken = {c.length: (c.kind, SizedSnapshot(snap)) for c in captures}
        if self.cache.config.reply_reuse and req.reply is not None:
            # The request ends: the head moves past the reply it generated (a lone row's own
            # buffer, adopted), the prompt end stays a checkpoint.
            kv = SizedKV(self.sizes.kv_per_token, req.n + int(req.reply.shape[0]))
            entry = flow.commit_reply(req.reply, kv=kv, head=SizedSnapshot(snap),
                                      prompt_head=SizedSnapshot(snap), captures=taken)
        else:
            kv = SizedKV(self.sizes.kv_per_token, req.n - self.cache.config.entry_offset)
            entry = flow.commit(kv=kv, head=SizedSnapshot(snap), captures=taken)
        if entry is not None and entry.kv is kv:
            self.ledger.bytes_cloned += kv.nbytes  # the row extraction this entry now holds
        return Served(plan.length, f"{flow.tier}:{plan.kind}" if plan.hit else COLD)

    def _advance(self, t: float) -> None:
        """Trace time drives the clock; idle entries are written as the server's tick would."""
        self.now = max(self.now, t)
        self.cache.tick(self.now)

    def load_checked(self, record: DiskRecord) -> tuple[Entry | None, str]:
        """The flow's ``DiskLoader``: what the plumbing does on a disk hit (read the file,
        rebuild the entry; the flow promotes it and plans again)."""
        snap = self.sizes.snapshot_bytes
        entry = Entry(
            id=record.id, tokens=record.tokens.copy(), kv=SizedKV(self.sizes.kv_per_token, record.length),
            head=SizedSnapshot(snap), namespace=record.namespace, created=self.now,
            last_used=self.now, is_anchor=record.is_anchor, pinned=record.pinned, label=record.label,
            checkpoints=[Checkpoint(length, kind, SizedSnapshot(snap), created=self.now)
                         for length, kind in record.checkpoints],
        )
        self.ledger.disk_bytes_read += record.nbytes
        return entry, ""

    def _on_event(self, event: Event) -> None:
        if event.kind == EventKind.PIN and event.detail == Reason.CAPTURED:
            self._anchor_ids.add(event.entry_id)
            self.ledger.bytes_cloned += self.sizes.kv_bytes(event.length)  # KVHandle.prefix copy
        elif event.kind == EventKind.EVICT and event.detail != Reason.OPERATOR:
            if event.entry_id in self._anchor_ids:
                self.ledger.anchor_evictions += 1
            else:
                self.ledger.evictions += 1
        elif event.kind == EventKind.DISK_DELETE and event.detail == Reason.DISK_CAP:
            self.ledger.disk_evictions += 1

    # ------------------------------------------------------------------ end and sampling

    def finish(self, end_time: float) -> None:
        """The server keeps running after the trace: idle entries get written 30 s later.

        That tail is counted as traffic (it is what a live server writes); ``flush()`` would
        write the same set, since by then every dirty entry is idle.
        """
        self._advance(end_time + self.cache.config.disk_write_delay_s)

    def ram_bytes(self) -> int:
        return self.cache.ram_bytes

    def disk_bytes(self) -> int:
        return self.disk.held

    def checkpoint_bytes(self) -> int:
        return sum(e.checkpoint_bytes for e in self.cache.entries())

    def stats(self) -> dict[str, int]:
        return dict(self.cache.stats)
