"""Queued RAM restores whose merge copy is made off the generation thread (issue 29).

A warm turn that cannot be lent its entry's buffer (a checkpoint below the entry's head, an
anchor, an entry queued for writing, a buffer without room) gets one copy of its whole restored
KV in the batch merge (``copyfree.merge.merge_rows``), on the generation thread: 537 MB in
0.33-0.71 s at 16.4k tokens on the bench preset, every other stream frozen meanwhile. So while
other rows decode, a queued prompt whose look-ahead plan is such a RAM restore of at least
``APC_STAGE_MIN_TOKENS`` tokens (``BatchRows.stageable``) waits in STAGING, still in mlx-vlm's
queue, while that very copy is made on the runtime's stager (``LineageRuntime.stages``, a worker
of its own): rows ``[:length]`` of
each float KV child into fresh buffers with the capacity the merge would give it as a lone row
(``copyfree.merge.stage_rows``). Meanwhile the entry holds a loan receipt
(``LineageCache.lend``: a hold of kind ``LENT``, ``lineage.holds``, the queued request's row's
once it is named), so it is not evicted, written, rewound nor lent, and nothing writes the
rows being read; the receipt ends as soon as the copy has.

At a later step the prompt is admitted alone in its prompt batch (``integration.loading``), and
its lookup, if it plans the very restore point staged (the same entry, length and snapshot),
restores from the staged buffers (``Stage.take``), which the merge adopts as it adopts a lent
buffer: no copy on the generation thread. Anything else fails closed to what happened before:
a plan that changed meanwhile, a copy that failed or took past ``APC_DISK_LOAD_WAIT_MS``, a
prompt that left the queue: the staged buffers are dropped, and the lookup restores (and the
merge copies) as it would have. The same tokens are restored either way.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

from server_patch import clock, settings
from server_patch.copyfree.merge import stage_rows
from server_patch.copyfree.spares import JointSpares
from server_patch.disk import faults
from server_patch.disk.loader import BackgroundLoads
from server_patch.lineage.handles import SnapshotHandle
from server_patch.lineage.model import Entry, Loan, RestorePlan
from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot
from server_patch.state.registry import Arrays

if TYPE_CHECKING:
    from server_patch.integration.runtime import LineageRuntime
    from server_patch.lineage.policy import LineageCache

# ``stage_rows``' answer: the lent part (keys/values in buffers with room) and the layers kept.
Staged = tuple[list[list[Arrays]], list[list[Arrays]]]

log = logging.getLogger("server_patch.copyfree")

STAGER_THREAD = "apc-stage"  # the runtime's stager worker: a staged copy never waits behind a disk load
LATE = "staged copy slower than APC_DISK_LOAD_WAIT_MS"

_ids = itertools.count(1)


@dataclass
class _Job:
    """What the stager thread copies: the entry's KV layers as they were when it started."""

    id: str
    layers: list[list[Arrays]]
    kv_children: list[list[bool]]
    length: int
    capacity: int
    joint: Optional[JointSpares] = None  # the runtime's: its join's buffers are made here too

    def run(self, _job: object = None) -> tuple[Optional[Staged], str]:
        faults.before_stage()
        return stage_rows(self.layers, self.kv_children, self.length, self.capacity, self.joint), ""


@dataclass
class Stage:
    """One queued prompt's staged copy of the restore point its look-ahead planned."""

    entry: Entry
    length: int
    state: Optional[SnapshotHandle]  # the plan's snapshot: the restore point is the same only with this very one
    job: _Job
    started: float  # ``clock.steady()`` when it started
    steps_at_start: int  # the book's decode steps then
    receipt: Optional[Loan] = None  # the cache's loan receipt while the copy runs
    staged: Optional[Staged] = None  # ``stage_rows``' answer, once done
    done: bool = False
    why: str = ""  # why nothing was staged (the copy failed, or was late)

    @property
    def capacity(self) -> int:
        return self.job.capacity

    def take(self, layout: CacheLayout, cache: LineageCache, plan: RestorePlan) -> Optional[list[Any]]:
        """The restored row caches around the staged buffers, if ``plan`` is the restore point
        staged and the cache still holds its entry; else None. Taken once either way: the
        caches are then the buffers' only holders, so the prefill appends in place."""
        staged, self.staged = self.staged, None
        if staged is None or plan.entry is not self.entry or plan.length != self.length \
                or plan.state is not self.state or not cache.holds(self.entry):
            return None
        taken, kept = staged
        state = cast(MlxSnapshot, plan.state)  # the real cache's snapshots are MlxSnapshots
        return layout.build_lent(MlxKV(kept, self.length, lent=True), taken, state, plan.length)


class Stagings:
    """The staged copies of one runtime's queued prompts, on its stager (default: the runtime's,
    ``LineageRuntime.stages``)."""

    def __init__(self, runtime: LineageRuntime, stages: Optional[BackgroundLoads] = None) -> None:
        self.runtime = runtime
        self.stages: BackgroundLoads = runtime.stages if stages is None else stages

    def start(self, plan: RestorePlan, capacity: int, steps: int) -> Optional[Stage]:
        """Start copying ``plan``'s rows into buffers of ``capacity`` rows; None where the cache
        refuses the entry a receipt (queued for writing, or lent): the merge copies then."""
        cache, layout = self.runtime.cache, self.runtime.layout
        receipt = cache.lend(plan)
        if receipt is None:
            return None
        kv_children = [[codec.name == "kv" for codec in layer.codecs] for layer in layout.layers]
        entry = receipt.entry  # the plan's (a lent plan has one); the real cache's KV is an MlxKV
        job = _Job(f"stage-{next(_ids)}", cast(MlxKV, entry.kv).layers, kv_children, plan.length, capacity,
                   self.runtime.spares)
        stage = Stage(entry, plan.length, plan.state, job, clock.steady(), steps, receipt)
        try:
            self.poll(stage)  # submitted
        except Exception:
            self._finish(stage)  # never a receipt left out
            raise
        return stage

    def poll(self, stage: Stage, wait_s: float = 0.0) -> bool:
        """Whether ``stage`` is done (staged, failed or late); the receipt ends once it is."""
        if stage.done:
            return True
        finished, answer = self.stages.poll(self.runtime.cache, stage.job, load=stage.job.run, kept=True,
                                            wait_s=wait_s)
        if finished:
            stage.staged, stage.why = answer
            if stage.staged is None:
                log.warning("apc_copyfree staged copy of entry %s at %d failed (%s): the merge copies",
                            getattr(stage.entry, "id", "?"), stage.length, stage.why)
            self._finish(stage)
        elif (clock.steady() - stage.started) * 1000 >= settings.value("APC_DISK_LOAD_WAIT_MS"):
            stage.why = LATE
            self.drop(stage)
        return stage.done

    def drop(self, stage: Stage) -> None:
        """Nobody will use ``stage``: its copy is dropped (once it finishes) and its receipt ends."""
        self.stages.forget(self.runtime.cache, stage.job)
        stage.staged = None
        self._finish(stage)

    def _finish(self, stage: Stage) -> None:
        stage.done = True
        receipt, stage.receipt = stage.receipt, None
        if receipt is not None:
            self.runtime.cache.end(receipt)


def min_tokens() -> int:
    """``APC_STAGE_MIN_TOKENS``: the shortest restore staged; 0: none."""
    return int(settings.value("APC_STAGE_MIN_TOKENS"))


__all__ = ["LATE", "STAGER_THREAD", "Stage", "Stagings", "min_tokens"]
