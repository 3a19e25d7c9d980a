"""One request's sequence of policy calls, written once for the server and the simulator.

A request is admitted by planning until the plan is stable: whatever it would restore from
must first be made real (a deferred entry committed, a loan of its rows ended: the caller's
``settle`` hook), and a disk restore point is loaded and promoted (or its file rejected),
after which it plans again, so the admitted plan was swept like the first one. A prompt that
restores at an entry's protected prompt end may rewind the entry there first (reply reuse:
the server does it to lend the buffer). Then the plan is restored or prefilled cold, its
captures are planned, and the state is committed at the prefill end (``commit``) or, with
reply reuse, after the reply (``commit_reply``).

Pure policy: no mlx, no mlx-vlm. The disk tier is anything with ``load_checked(record)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from server_patch.lineage.handles import KVHandle, SnapshotHandle
from server_patch.lineage.model import COLD, DISK, Capture, DiskRecord, Entry, RestorePlan, as_tokens
from server_patch.lineage.policy import LineageCache

log = logging.getLogger("server_patch.lineage")

# Plans a lookup may make before it settles (each re-plan follows progress: a deferred entry
# committed, a loan ended, a disk file loaded or rejected); past that it prefills cold.
PLANS_MAX = 8


class DiskLoader(Protocol):
    """Reads a disk record back into an entry for ``LineageCache.promote``."""

    def load_checked(self, record: DiskRecord) -> tuple[Entry | None, str]:
        """The rebuilt entry, or None and why its file was rejected."""
        ...


Settle = Callable[[RestorePlan], bool]  # make the plan real; True: something changed, plan again


def cold(plan: RestorePlan) -> RestorePlan:
    """The cold plan for the same prompt (what a miss or a failed restore admits)."""
    return RestorePlan(0, COLD, shared=plan.shared, prompt_len=plan.prompt_len)


@dataclass
class Admission:
    """One request through the cache: its prompt, namespace and admitted plan."""

    cache: LineageCache
    prompt: np.ndarray
    namespace: str = ""
    plan: RestorePlan | None = None
    promoted: set[str] = field(default_factory=set)  # ids of entries this admission loaded from disk
    last_start: int = 0  # where the prompt's last message starts (its last segment; 0: unknown)

    @classmethod
    def admit(cls, cache: LineageCache, tokens: Sequence[int] | np.ndarray, namespace: str = "", *,
              disk: DiskLoader | None = None, settle: Settle | None = None,
              disk_refused: Callable[[], bool] = lambda: False) -> "Admission":
        """Plan until stable (see the module docstring). ``disk_refused``: a disk restore
        must not be used now (it is then cold, its file kept)."""
        admission = cls(cache, as_tokens(tokens), namespace)
        admission.plan = admission._settled(disk, settle, disk_refused)
        return admission

    def _settled(self, disk: DiskLoader | None, settle: Settle | None,
                 disk_refused: Callable[[], bool]) -> RestorePlan:
        loaded: set[str] = set()
        plan = self.lookup()
        for _ in range(PLANS_MAX):
            if settle is not None and settle(plan):
                pass  # a deferred entry was committed or an entry dropped: plan again
            elif plan.tier == DISK and (disk is None or plan.record.id in loaded or disk_refused()):
                break  # loaded once already and gone again (no room in RAM), or a suspect tier: cold
            elif plan.tier == DISK:
                loaded.add(plan.record.id)
                entry, why = disk.load_checked(plan.record)
                if self.cache.promote(plan.record, entry, reason=why) is not None:
                    self.promoted.add(plan.record.id)
            else:
                return plan
            plan = self.lookup()
        else:
            log.warning("apc_lineage lookup did not settle after %d plans: cold prefill", PLANS_MAX)
        return cold(plan)

    def lookup(self) -> RestorePlan:
        return self.cache.lookup(self.prompt, self.namespace)

    @property
    def tier(self) -> str | None:
        """Where the admitted plan's state came from: DISK if this admission promoted it."""
        plan = self._plan
        if plan.hit and plan.entry is not None and plan.entry.id in self.promoted:
            return DISK
        return plan.tier

    @property
    def _plan(self) -> RestorePlan:
        assert self.plan is not None, "admit() first"
        return self.plan

    def rewind(self, allowed: Callable[[RestorePlan], bool] = lambda plan: True) -> RestorePlan:
        """A plan at an entry's protected prompt end (the prompt did not re-render the reply)
        rewinds the entry there (``LineageCache.rewind``) when ``allowed``, and plans again,
        so the head is where it restores. The old plan stays (still buildable) unless the new
        one is that very head."""
        plan = self._plan
        entry = plan.entry
        if plan.checkpoint is None or entry is None or not entry.prompt_end or plan.length != entry.prompt_end:
            return plan
        if not allowed(plan) or not self.cache.rewind(entry):
            return plan
        again = self.lookup()
        if again.entry is entry and again.length == plan.length:
            self.plan = again
        return self._plan

    def refuse(self) -> RestorePlan:
        """Admit cold instead (a failed canary, a restore that could not be built)."""
        self.plan = cold(self._plan)
        return self.plan

    def restored(self, admission: str = "") -> None:
        """Count the restore (it happened; ``admission``: how its KV reached the batch)."""
        self.cache.note_restore(self._plan, admission)

    def cold(self) -> None:
        """Count a cold prefill."""
        self.cache.note_cold(self._plan)

    def captures(self, *, anchor_len: int | None = None, segments: Iterable[int] = ()) -> list[Capture]:
        """Where prefill must hand over state for this plan (``segments``' last is remembered
        as ``last_start``, for ``commit``)."""
        segments = [int(s) for s in segments]
        self.last_start = max(segments, default=0)
        return self.cache.plan_captures(self.prompt, self._plan, namespace=self.namespace,
                                        anchor_len=anchor_len, segments=segments)

    @property
    def _keep(self) -> tuple[int, int, int]:
        """The newest turn's points this request names (``LineageCache.commit``'s ``keep``):
        where it restored, the point it would restore at without reply reuse, and where its
        last message starts."""
        return self._plan.length, self._plan.durable_length, self.last_start

    def commit(self, *, kv: KVHandle, head: SnapshotHandle,
               captures: Mapping[int, tuple[str, SnapshotHandle]] | None = None,
               anchor_label: str = "") -> Entry | None:
        """The state at the prefill end becomes the lineage's entry."""
        return self.cache.commit(self.prompt, kv=kv, head=head, captures=captures,
                                 namespace=self.namespace, anchor_label=anchor_label,
                                 keep=self._keep, last_start=self.last_start)

    def commit_reply(self, reply: Sequence[int] | np.ndarray, *, kv: KVHandle, head: SnapshotHandle,
                     prompt_head: SnapshotHandle,
                     captures: Mapping[int, tuple[str, SnapshotHandle]] | None = None,
                     anchor_label: str = "") -> Entry | None:
        """The state after the reply becomes the entry; the prompt end stays its checkpoint."""
        return self.cache.commit_reply(self.prompt, reply, kv=kv, head=head, prompt_head=prompt_head,
                                       captures=captures, namespace=self.namespace,
                                       anchor_label=anchor_label, keep=self._keep,
                                       last_start=self.last_start)


__all__ = ["PLANS_MAX", "Admission", "DiskLoader", "Settle", "cold"]
