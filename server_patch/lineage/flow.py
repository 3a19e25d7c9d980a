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
from server_patch.lineage.misses import REPLY, Lost, Miss
from server_patch.lineage.model import COLD, DISK, Capture, DiskRecord, Entry, RestorePlan, as_tokens
from server_patch.lineage.policy import LineageCache
from server_patch.lineage.shadow import Match

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

# What a loader answers (with no entry) for a file it did not load in time: the request is
# admitted cold and the file kept (``integration.loading``: a load past ``APC_DISK_LOAD_WAIT_MS``).
NOT_LOADED = "disk load slower than APC_DISK_LOAD_WAIT_MS"
# What a loader answers for a file it did not load ahead (the plan turned to it only at the
# lookup itself): the lookup plans again from RAM alone, so nothing loads on the generation
# thread (``integration.loading.RequestDisk``); the file is kept.
NOT_AHEAD = "disk file not loaded ahead of the lookup"


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
    drift_points: tuple[int, ...] = ()  # where clients part from prompts like it (``captures``)
    # The live oracle (``misses``): the prompt's block hashes and match, what this admission
    # met that cost tokens (length, ``Lost``), and the request's miss once counted.
    hashes: np.ndarray | None = None
    match: Match = Match(0)
    steps: list[tuple[int, str]] = field(default_factory=list)
    detail: str = ""  # why a disk file was rejected
    reply_diverged: bool = False  # it restored at an entry's prompt end and diverged inside the reply
    miss: Miss | None = None

    @classmethod
    def admit(cls, cache: LineageCache, tokens: Sequence[int] | np.ndarray, namespace: str = "", *,
              disk: DiskLoader | None = None, settle: Settle | None = None,
              disk_refused: Callable[[], bool] = lambda: False) -> "Admission":
        """Plan until stable (see the module docstring). ``disk_refused``: a disk restore
        must not be used now (it is then cold, its file kept)."""
        admission = cls(cache, as_tokens(tokens), namespace)
        misses = cache.misses
        admission.hashes = misses.hashes(admission.prompt)
        admission.match = misses.match(admission.hashes, namespace, int(admission.prompt.shape[0]))
        admission.plan = admission._settled(disk, settle, disk_refused)
        misses.processed(admission.prompt, namespace, admission.hashes)
        admission.reply_diverged = _inside_reply(admission.plan)
        return admission

    def _settled(self, disk: DiskLoader | None, settle: Settle | None,
                 disk_refused: Callable[[], bool]) -> RestorePlan:
        loaded: set[str] = set()
        ram_only = False  # a loader answered NOT_AHEAD: the disk tier is not planned again
        plan = self.lookup()
        for _ in range(PLANS_MAX):
            if settle is not None and settle(plan):
                pass  # a deferred entry was committed or an entry dropped: plan again
            elif plan.tier == DISK and (disk is None or plan.record is None or plan.record.id in loaded
                                        or disk_refused()):
                # loaded once already and gone again (no room in RAM), or a suspect tier: cold
                unused = disk is None or plan.record is None or plan.record.id in loaded
                self.steps.append((plan.length, Lost.DISK_UNUSED if unused else Lost.CANARY))
                break
            elif plan.tier == DISK:
                record = plan.record
                assert disk is not None and record is not None  # the branch above took the others
                loaded.add(record.id)
                entry, why = disk.load_checked(record)
                if entry is None and why == NOT_LOADED:  # its load ran past the bound: cold, file kept
                    self.steps.append((plan.length, Lost.DISK_UNUSED))
                    self.detail = why
                    break
                if entry is None and why == NOT_AHEAD:  # not loaded ahead: the best RAM point, file kept
                    self.steps.append((plan.length, Lost.DISK_UNUSED))
                    self.detail, ram_only = why, True
                    plan = self.cache.lookup(self.prompt, self.namespace, ram_only=True)
                    continue
                if entry is None:
                    self.steps.append((plan.length, Lost.DISK_REJECTED))
                    self.detail = why or "failed validation"
                if self.cache.promote(record, entry, reason=why) is not None:
                    self.promoted.add(record.id)
            else:
                return plan
            plan = self.cache.lookup(self.prompt, self.namespace, ram_only=ram_only)
        else:
            log.warning("apc_lineage lookup did not settle after %d plans: cold prefill", PLANS_MAX)
            self.steps.append((plan.length, Lost.OTHER))
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
        if entry is None or not at_protected_prompt_end(plan):
            return plan
        if not allowed(plan) or not self.cache.rewind(entry):
            return plan
        again = self.lookup()
        if again.entry is entry and again.length == plan.length:
            self.plan = again
        return self._plan

    def met(self, length: int, reason: str, detail: str = "") -> None:
        """What the request met before its lookup (a disk file rejected while it waited in
        the queue): counted as if this admission had met it."""
        self.steps.append((length, reason))
        self.detail = self.detail or detail

    def refuse(self, reason: str = Lost.OTHER) -> RestorePlan:
        """Admit cold instead (a failed canary, a restore that could not be built); what the
        plan would have restored is lost for ``reason`` (a ``Lost``)."""
        self.steps.append((self._plan.length, reason))
        self.plan = cold(self._plan)
        return self.plan

    def restored(self, admission: str = "") -> None:
        """Count the restore (it happened; ``admission``: how its KV reached the batch)."""
        self.cache.note_restore(self._plan, admission, tier=self.tier)
        self._explain()

    def cold(self) -> None:
        """Count a cold prefill."""
        self.cache.note_cold(self._plan)
        self._explain()

    def _explain(self) -> None:
        """The request against its oracle: why each token it lost was lost (``misses``)."""
        plan = self._plan
        if self.reply_diverged:
            residual = Lost.REPLY
        else:
            residual = Lost.NO_POINT if plan.shared >= self.match.oracle else Lost.OTHER
        hashes = self.hashes if self.hashes is not None else self.cache.misses.hashes(self.prompt)
        self.miss = self.cache.misses.explain(self.match, plan.length, hashes, self.namespace,
                                              self.steps, residual, self.detail)

    def captures(self, *, anchor_len: int | None = None, segments: Iterable[int] = (),
                 drift_points: Iterable[int] = ()) -> list[Capture]:
        """Where prefill must hand over state for this plan (``segments``' last is remembered
        as ``last_start``, for ``commit``; ``drift_points``, ``plan_captures``', are kept by
        thinning while this is the newest turn)."""
        segments = [int(s) for s in segments]
        self.last_start = max(segments, default=0)
        self.drift_points = tuple(int(p) for p in drift_points)
        return self.cache.plan_captures(self.prompt, self._plan, namespace=self.namespace,
                                        anchor_len=anchor_len, segments=segments,
                                        drift_points=self.drift_points)

    @property
    def _keep(self) -> tuple[int, ...]:
        """The newest turn's points this request names (``LineageCache.commit``'s ``keep``):
        where it restored, the point it would restore at without reply reuse, where its last
        message starts, and its drift points."""
        return self._plan.length, self._plan.durable_length, self.last_start, *self.drift_points

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
        self.cache.misses.processed(np.concatenate([self.prompt, as_tokens(reply)]), self.namespace,
                                    kind=REPLY)
        return self.cache.commit_reply(self.prompt, reply, kv=kv, head=head, prompt_head=prompt_head,
                                       captures=captures, namespace=self.namespace,
                                       anchor_label=anchor_label, keep=self._keep,
                                       last_start=self.last_start)


def at_protected_prompt_end(plan: RestorePlan) -> bool:
    """Whether ``plan`` restores at its entry's protected prompt end, below a reply's state:
    where ``Admission.rewind`` may move the entry's head back to."""
    entry = plan.entry
    return plan.checkpoint is not None and entry is not None and bool(entry.prompt_end) \
        and plan.length == entry.prompt_end


def _inside_reply(plan: RestorePlan) -> bool:
    """The plan restores at an entry's protected prompt end and the prompt shares more of the
    entry than that: it diverged inside the reply the entry kept (the client or its template
    did not re-render the reply as it was generated)."""
    entry = plan.entry
    return entry is not None and entry.prompt_end > 0 and plan.length == entry.prompt_end \
        and plan.shared > plan.length


__all__ = ["NOT_AHEAD", "NOT_LOADED", "PLANS_MAX", "Admission", "DiskLoader", "Settle", "at_protected_prompt_end",
           "cold"]
