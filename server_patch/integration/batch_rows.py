"""A row's buffers from restore to leaving the batch: loans, deferred entries, tracked replies.

The coordinator answers mlx-vlm's verbs; what happens to a row's KV buffers in between is
decided here, over the rows of the ``SessionBook`` (``integration.session``: one record per
request) with the mechanics of ``server_patch.copyfree``, and the generator's rows:

* at admission a lone request that extends an entry at its head is *lent* the entry's buffer
  (``may_lend``), or the entry is rewound to the protected prompt end it restores at so it
  can be (``may_rewind``); anything it would restore from is made real first (``settle``);
* at the prefill end a lone row is *deferred* (its buffer adopted when nothing writes it any
  more), a row sharing its batch is copied out once (with reply reuse into buffers with room
  for its reply, or deferred to its end where it restored at an entry's head: its reply is
  appended to that entry's buffer) (``prefill_end``), and the row is tracked to move its entry
  past its reply;
* when rows leave the decoding batch, are concatenated into a shared one, or are removed
  mid-prefill (``leaving``, ``joining``, ``removed``), deferred entries are committed, replies
  kept, and loans end.

Two commit verbs, each for the row whose state it commits, never another's: the prompt end
(``prefill_end`` copies it out at once, or defers it; ``commit_prompt`` commits a deferral
later, adopted or copied) and ``commit_finished`` (it leaves the decoding batch: past its
reply where the row checks out, else its deferred prompt-end state). The prompt end is stored
through ``commit_prompt`` alone (the prefill end's immediate copy too), the reply through the flow's reply commit. A lookup that would restore from a deferred entry does not commit it:
it tells that row (``surface``, an event of the deferred row's own life), which commits its
own prompt-end state; a row nobody decodes any more is told the same (``orphan``).

Every step runs on the generation thread, the only one that writes caches.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Protocol, Sequence, cast

import numpy as np

from server_patch.copyfree import append as appending
from server_patch.copyfree import deferred as deferral
from server_patch.copyfree import lease as lending
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.deferred import Deferred
from server_patch.copyfree.lease import Lease
from server_patch.copyfree.replies import Reply
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.integration import waits
from server_patch.integration.generator import GeneratorView, RowBatch
from server_patch.integration.pending import Pending, RequestKey
from server_patch.integration.session import SessionBook, Session, SessionState
from server_patch.integration.runtime import LineageRuntime
from server_patch.lineage import DISK, KVAdmission, RestorePlan, flow
from server_patch.lineage.holds import BASE, DEFERRED
from server_patch.lineage.model import Entry
from server_patch.speculative.rounds import RoundBook
from server_patch.state import rows
from server_patch.state.layout import MlxKV, MlxSnapshot

log = logging.getLogger("server_patch.lineage")


class Commits(Protocol):
    """Where a row's state becomes an entry (the request flow's commits)."""

    def store(self, pending: Pending, kv: MlxKV, head: MlxSnapshot) -> bool:
        """At the prompt end."""
        ...

    def store_reply(self, pending: Pending, fed: np.ndarray, /, *, kv: MlxKV, head: MlxSnapshot,
                    prompt_head: MlxSnapshot, captures: dict[int, tuple[str, MlxSnapshot]]) -> Optional[Entry]:
        """Past the reply."""
        ...

    def note_commit(self, row: Session, start: float) -> None:
        """The commit's time and captures, on the request's timing record."""
        ...


class BatchRows:
    """What happens to the KV buffers of one runtime's rows: loans, deferrals, replies."""

    def __init__(self, runtime: LineageRuntime, settings: CopyFreeSettings, generator: GeneratorView,
                 commits: Commits, book: SessionBook) -> None:
        self.runtime, self.settings, self.generator, self.commits = runtime, settings, generator, commits
        self.book = book
        self.rounds = RoundBook()  # a speculative batch's committed rounds (reply reuse)

    # ------------------------------------------------------------------ admission

    def sweep(self) -> None:
        """Before a lookup: rows no batch holds any more whose leaving nobody saw end now, each
        by an event of its own life (``left_unseen``). The one sweep of rows, replies, deferrals
        and their holds alike."""
        active = self.generator.active_uids()
        if active is None:
            return
        for row in self.book.rows():
            if row.uid is not None and row.uid not in active and (
                    row.state == SessionState.DECODING or row.deferral is not None):
                self.left_unseen(row)

    def left_unseen(self, row: Session) -> None:
        """``row`` is in no batch and nothing saw it leave: its reply is forgotten, its deferred
        prompt-end state committed (``surface``, orphan: a lone row's buffer adopted), its loan
        ended, and it has ended (what it holds of the cache is let go)."""
        row.reply = None
        if row.deferral is not None:
            self.surface(row, orphan=True)
        if row.loan is not None:
            self._end_loan(row, None, reason="orphan")
        self._end(row, "left unseen")

    def settle(self, prompt: np.ndarray, namespace: str, plan: RestorePlan, reclaimed: set[str]) -> bool:
        """The flow's settle hook: commit deferred entries this plan would miss, end loans of
        the rows it needs (their ids go into ``reclaimed``). True: plan again."""
        active = self.generator.active_uids()
        if self._surface(prompt, namespace, plan.length):
            return True  # a deferred entry was committed: there may be a longer restore point
        return self._sweep_loans(plan.entry, reclaimed, active)

    def _surface(self, prompt: np.ndarray, namespace: str, restorable: int) -> bool:
        """Tell deferred rows a lookup would restore from (``restorable``: what it restores
        now) to commit (rows nobody writes any more ended at the ``sweep``). True if one was
        committed (plan again)."""
        surfaced = False
        for row in self.book.deferred():
            if row.deferral is not None and deferral.surfaces(row.deferral, prompt, namespace, restorable) \
                    and self.surface(row, orphan=False):
                surfaced = True
        return surfaced

    def surface(self, row: Session, *, orphan: bool) -> bool:
        """An event of ``row``'s own life: its deferred prompt-end state is wanted now (a
        lookup would restore from it) or nobody decodes it any more (``orphan``: its buffer is
        adopted, its reply forgotten). It commits its own state (``commit_prompt``): from its
        own buffer (a lone row), else from its row in the decoding batch, found by uid. False
        if that row is gone unseen: no entry, never garbage."""
        deferred = row.deferral
        if deferred is None:
            return False
        if orphan:
            row.reply = None
        reason = "orphan" if orphan else "lookup"
        if not deferred.shared:
            self.commit_prompt(row, deferred.caches, 0, adopt=orphan, reason=reason)
        elif (found := self.generator.row_of(row.uid)) is not None:
            self.commit_prompt(row, found[0], found[1], adopt=False, reason=reason)
        else:  # its row is gone and nothing saw it leave: no entry, never garbage
            row.deferral = None
            self._let_go(row)
            self.book.tidy(row)
            log.warning("apc_lineage deferred entry of %d tokens lost: its row left unseen",
                        deferred.pending.final)
            return False
        return True

    def _sweep_loans(self, entry: Optional[Entry], reclaimed: set[str], active: Optional[set[int]]) -> bool:
        """Before a lookup builds anything: end the loan of ``entry`` (the rows this prompt
        needs; its id goes into ``reclaimed``), loans whose borrower is not ``active`` any
        more, and loans never merged (their batch was not a lone row). True if an entry had
        to be dropped."""
        dropped = False
        for row in self.book.lent():
            lease = row.loan
            if lease is None:  # ``lent`` holds rows with a loan
                continue
            if entry is lease.entry:
                reason = "shared"
                reclaimed.add(lease.entry.id)
            elif not lease.merged:
                reason = "unmerged"
            elif active is not None and row.uid is not None and row.uid not in active:
                reason = "orphan"
            else:
                continue
            dropped = not self._end_loan(row, reason=reason) or dropped
        return dropped

    def may_rewind(self, plan: RestorePlan) -> bool:
        """A prompt that restores at an entry's protected prompt end (it did not re-render the
        reply) would be lent the buffer if the head sat there: the flow may rewind the entry
        (give up the reply's state, ``LineageCache.rewind``) so the turn appends in place as it
        would without reply reuse instead of copying the entry."""
        entry = plan.entry
        if not self._lendable_layout() or entry is None or entry.is_anchor or not self.generator.verified():
            return False
        return lending.has_room(entry.kv, plan.prompt_len + self.settings.decode_reserve)

    def may_lend(self, plan: RestorePlan) -> bool:
        """A lone-request loan is possible: a RAM entry restored at its own head, whose
        adopted buffer already has room for the suffix and the decode reserve."""
        entry = plan.entry
        if not self._lendable_layout() or plan.checkpoint is not None or entry is None:
            return False
        if entry.is_anchor or plan.length != entry.length or not self.generator.verified():
            return False
        return lending.lendable(entry.kv, plan.length, plan.prompt_len + self.settings.decode_reserve)

    def _lendable_layout(self) -> bool:
        """Lending is on and every KV layer is float: a quantized layer (``--kv-bits``) is
        merged by mlx-vlm's packed merge, which copies, so there is no buffer to lend."""
        return self.settings.lending and not self.runtime.layout.packed

    def stageable(self, plan: RestorePlan, min_tokens: int) -> bool:
        """A queued prompt's look-ahead ``plan`` is a RAM restore of at least ``min_tokens``
        (0: none) that the merge would copy, as a lone row, on the generation thread: neither
        lent its entry's buffer nor rewound so it could be. Its copy may be staged ahead
        (``integration.staging``)."""
        entry = plan.entry
        if min_tokens <= 0 or not plan.hit or entry is None or plan.tier == DISK or plan.length < min_tokens:
            return False
        if not self.settings.enabled or self.runtime.layout.packed or not self.generator.verified():
            return False
        return not self.may_lend(plan) and not (flow.at_protected_prompt_end(plan) and self.may_rewind(plan))

    def staged_capacity(self, prompt_len: int) -> int:
        """The rows the merge gives a lone restored row of a ``prompt_len``-token prompt."""
        headroom = self.settings.lend_headroom if self.settings.lending else 0
        return copyfree_merge.capacity(prompt_len + self.settings.decode_reserve + headroom)

    def restore(self, row: Optional[Session], key: RequestKey, plan: RestorePlan,
                reclaimed: set[str]) -> tuple[list[Any], Optional[Lease]]:
        """The restored row caches (truncated views, the buffers staged while ``row``, the
        request's row if it has one yet, queued, or the entry's own lent buffers) and the loan
        (a ``Lease``, None otherwise). ``key``: its request key. Raises if they cannot be built
        (a lent entry cannot)."""
        entry = plan.entry
        assert entry is not None
        if row is not None:
            row.staged = False
        if row is not None and row.stage is not None:
            stage, row.stage = row.stage, None  # taken once: used here or dropped
            staged = stage.take(self.runtime.layout, self.runtime.cache, plan)
            if staged is not None:
                row.staged = True  # the merge adopts it
                return staged, None
        if not self.book.lent_to(key) and entry.id not in reclaimed and self.may_lend(plan):
            lease = lending.lend_entry(self.runtime.layout, self.runtime.cache, plan)
            if lease is not None:
                return lease.holder, lease
        # the real cache's handles are the mlx ones (the simulator's sized ones never get here)
        kv, state = cast(MlxKV, entry.kv), cast(MlxSnapshot, plan.state)
        return self.runtime.layout.build(kv, state, plan.length), None

    @waits.unit(waits.Work.RESTORE, waits.merged_rows)
    def merge(self, found: Sequence[Optional[Session]], row_caches: Sequence[Sequence[Any]],
              prefix_lens: Sequence[int], suffixes: Sequence[int]) -> Optional[list[Any]]:
        """One copy per restored row (``found``: each one's row, None for a cold one) into
        buffers with room for the suffix and the decode reserve; none when a lone row was lent
        its entry's buffer. None: stock's merge."""
        lent = [row if row is not None and row.loan is not None else None for row in found]
        lone = lent[0] if len(found) == 1 else None
        staged = len(found) == 1 and found[0] is not None and found[0].staged  # adopted, as a loan is
        for row in found:
            if row is not None:
                row.staged = False
        for row in lent:
            if row is not None and row is not lone:  # rows sharing a batch: the merge copies
                self._end_loan(row, reason="batch")
        headroom = self.settings.lend_headroom if len(found) == 1 and self.settings.lending else 0
        caches = copyfree_merge.merge_rows(row_caches, prefix_lens, suffixes, self.settings.decode_reserve,
                                           headroom=headroom, lend=lone is not None or staged)
        if lone is not None:
            if caches is None:
                self._end_loan(lone, reason="fallback")
            else:
                lease = lone.loan
                assert lease is not None  # ``lent`` holds rows with a loan
                lease.holder, lease.merged = list(caches), True
        return caches

    def admission_of(self, row: Optional[Session], lease: Optional[Lease]) -> KVAdmission:
        """How a restored row's KV reaches the batch: its entry's buffer, a staged copy, or the
        merge's copy."""
        if lease is not None:
            return KVAdmission.LENT
        return KVAdmission.STAGED if row is not None and row.staged else KVAdmission.COPIED

    # ------------------------------------------------------------------ prefill end

    @waits.unit(waits.Work.COMMIT, waits.one_row)
    def prefill_end(self, row: Session, prompt_cache: Sequence[Any], batch_idx: Optional[int],
                    uid: Optional[int]) -> bool:
        """Commit the row's entry at its prompt end: deferred (a lone row; with reply reuse a
        shared one that restored at an entry's head, whose buffer its reply is appended to when
        it ends) or copied out now (with reply reuse into buffers with room for the reply, so
        that when the row ends only its reply rows are written, ``copyfree.append``)."""
        start = time.perf_counter()
        pending, layout = row.pending, self.runtime.layout
        if uid is not None and row.uid is None:  # stored before its batch was bound: bound now
            self.book.bind(row.key, uid)
        lone = self._deferrable(prompt_cache, uid)
        reuse = self.settings.enabled and self.reply_reuse(pending, uid)
        base = None
        if lone or (reuse and self.generator.plain() and self._base_has_room(pending, uid)):
            head = rows.capture(layout, prompt_cache, batch_idx, pending.final)
            row.deferral = Deferred(pending, head, list(prompt_cache) if lone else [], uid,
                                    time.monotonic(), shared=not lone)
            if lone:  # its own buffer, adopted at its commit
                self.runtime.cache.defer(row, f"deferred:{uid}")
            else:  # the entry it restored at the head of: its reply is appended there
                self._hold_base(row, appending.restored_base(pending))
            committed = True
        else:
            room = self._reply_capacity(pending, uid) if reuse else 0
            kv = appending.copy_with_room(layout, prompt_cache, batch_idx, pending.final, room)
            head = rows.capture(layout, prompt_cache, batch_idx, pending.final)
            committed = self.commit_prompt(row, list(prompt_cache), batch_idx, adopt=False, reason="prefill-end",
                                           copied=(kv, head))
            base = appending.Base(kv, pending.final) if committed and reuse else None
            if base is not None:
                log.info("apc_copyfree commit uid=%s mode=copy reason=prefill-end tokens=%d kv_bytes=%d "
                         "buffer_rows=%d", uid, pending.final, kv.nbytes, kv.capacity())
        self._decoding(row, head, uid, "prefill end")
        if row.reply is not None and base is not None:  # its reply is appended there
            row.reply.base = base
            self._hold_base(row, base)
        self.commits.note_commit(row, start)
        if uid is None:  # the single-sequence path: no later event will come
            self._end(row, "prefill end")
        else:
            self.book.tidy(row)
        return committed

    def resent(self, row: Session, uid: int) -> None:
        """A prompt restored at its own prompt end has nothing to prefill: it is at its prefill
        end now, its restored state its prompt-end snapshot (no store will commit it)."""
        self._decoding(row, cast(MlxSnapshot, row.pending.plan.state), uid, "resend")

    def _decoding(self, row: Session, head: MlxSnapshot, uid: Optional[int], event: str) -> None:
        """Past the prefill end: its reply tracked from ``head``."""
        row.move(SessionState.DECODING, event)
        self.track_reply(row, head, uid)

    def _store(self, pending: Pending, kv: MlxKV, head: MlxSnapshot) -> bool:
        """The one store of a prompt-end entry."""
        committed = self.commits.store(pending, kv, head)
        self._settle_loans()  # a loan whose entry the commit absorbed is over
        return committed

    def _deferrable(self, prompt_cache: Sequence[Any], uid: Optional[int]) -> bool:
        """A lone row whose cache holds only verified rows when read (``GeneratorView.verified``):
        its buffer is its own to hand over."""
        if not (self.settings.enabled and self.settings.adopt) or uid is None or not self.generator.verified():
            return False
        return rows.batch_size(prompt_cache) == 1

    # ------------------------------------------------------------------ the two commit verbs

    @waits.unit(waits.Work.COMMIT, waits.one_row)
    def commit_finished(self, row: Session, batch: RowBatch, idx: int, *, alone: bool) -> None:
        """Row ``idx`` of ``batch`` leaves the decoding batch: its entry moves past its reply
        where the row checks out, else its deferred prompt-end state is committed (its buffer
        adopted where ``alone``, else copied)."""
        reply, row.reply = row.reply, None
        if reply is not None and self._keep_reply(reply, batch, idx, alone=alone, deferred=row.deferral):
            row.deferral = None
            self._let_go(row)
            self.book.tidy(row)
        else:
            self._commit_prompt(row, list(batch.prompt_cache), idx, adopt=alone, reason="end")

    @waits.unit(waits.Work.COMMIT, waits.one_row)
    def commit_prompt(self, row: Session, caches: list[Any], idx: Optional[int], *, adopt: bool, reason: str,
                      copied: Optional[tuple[MlxKV, MlxSnapshot]] = None) -> bool:
        """Row's prompt-end state becomes its entry: at the prefill end its own copy
        (``copied``: the KV copied out of ``caches`` row ``idx`` and its head, ``reason``
        prefill-end), stored as it is; later its deferred state (``reason``: join, removed,
        lookup, orphan), its rows read from ``caches`` row ``idx`` (adopted where ``adopt``,
        else copied); its reply, if still tracked, is appended there when it ends. Whether
        something was stored (False: nothing deferred, or the store refused it)."""
        if copied is not None:  # the prefill end, which goes on with the row (no tidy here)
            return self._store(row.pending, *copied)
        return self._commit_prompt(row, caches, int(idx or 0), adopt=adopt, reason=reason)

    def _commit_prompt(self, row: Session, caches: list[Any], idx: int, *, adopt: bool, reason: str) -> bool:
        deferred = row.deferral
        if deferred is not None:
            row.deferral = None
            room = self._reply_capacity(row.pending, row.uid) if row.reply is not None else 0
            elapsed = deferral.resolve(self.runtime.layout, self.settings, deferred, caches, idx,
                                       adopt=adopt, reason=reason, store=self._store, room=room)
            self._let_go(row)  # its buffer is an entry now (or dropped), the base it restored absorbed
            if row.reply is not None and deferred.stored is not None:  # its reply appends there
                row.reply.base = deferred.stored
                self._hold_base(row, deferred.stored)
            if elapsed is not None and row.record is not None and not row.timed:
                row.record.commit_ms += elapsed
        self.book.tidy(row)
        return deferred is not None and deferred.stored is not None

    # ------------------------------------------------------------------ reply reuse

    def reply_reuse(self, pending: Pending, uid: Optional[int]) -> bool:
        """Whether this row's entry may move past its reply when it ends. Off, explicitly:
        ``APC_LINEAGE_REPLY_REUSE=0``; the single-sequence path (no uid: its loop has no
        decode hook); a draft model whose committed rounds are not reported
        (``GeneratorView.verified``: its caches hold draft rows it may roll back, and mlx-vlm
        keeps no fed ids); a prompt end moved off n - 1."""
        config = self.runtime.config
        if not config.reply_reuse or uid is None or not self.generator.verified():
            return False
        return pending.final == int(pending.tokens.shape[0]) - config.entry_offset

    def track_reply(self, row: Session, head: MlxSnapshot, uid: Optional[int]) -> None:
        """Record the ids row ``uid`` is fed from now on (``head``: its prompt-end state)."""
        if self.reply_reuse(row.pending, uid):
            row.reply = Reply(row.pending, head, row.record)

    def verified_round(self, batch: Any, verify_input: Any, accepted: Sequence[int], active: Sequence[int]) -> None:
        """A speculative batch committed a round (``speculative.rounds``): each tracked reply
        grows by the ids its row's cache kept."""
        self.rounds.committed(batch, verify_input, accepted, active, self._fed)

    def _fed(self, uid: int, ids: list[int]) -> None:
        if (row := self.book.by_uid(uid)) is not None and row.reply is not None:
            row.reply.fed.extend(ids)

    def _base_has_room(self, pending: Pending, uid: Optional[int]) -> bool:
        """A row that restored at an entry's head whose buffer has room for its whole reply
        (an entry loaded from disk, or copied exactly, has none): it may defer to its end."""
        base = appending.restored_base(pending)
        limit = self.generator.max_tokens_of(uid)
        reply = min(self.settings.decode_reserve if limit is None else limit,
                    self.settings.spare_allowed(pending.final))
        return base is not None and lending.has_room(base.kv, int(pending.tokens.shape[0]) + reply)

    def _reply_capacity(self, pending: Pending, uid: Optional[int]) -> int:
        """Rows a prompt-end copy of a tracked row allocates so its reply appends in place."""
        return appending.reply_capacity(self.settings, pending.final, int(pending.tokens.shape[0]),
                                        self.generator.max_tokens_of(uid))

    def _keep_reply(self, reply: Reply, batch: Any, idx: int, *, alone: bool,
                    deferred: Optional[Deferred]) -> bool:
        """Move the row's entry past its reply (``copyfree.deferred.commit_reply``)."""
        return deferral.commit_reply(self.runtime.layout, self.settings, reply, batch, idx, alone=alone,
                                     deferred=deferred, settle=self._settle_loans,
                                     store=self.commits.store_reply, cache=self.runtime.cache)

    # ------------------------------------------------------------------ loans

    def _end_loan(self, row: Session, caches: Optional[Sequence[Any]] = None, *, reason: str) -> bool:
        """Give the row's lent rows back to their entry (or drop the entry if they are gone)."""
        lease, row.loan = row.loan, None
        assert lease is not None  # called for a row holding a loan
        kept = lending.end(self.runtime.layout, self.runtime.cache, lease, caches, reason=reason)
        self.book.tidy(row)
        return kept

    def _settle_loans(self) -> None:
        """Loans whose entry was absorbed or evicted are over."""
        for row in self.book.lent():
            if row.loan is not None and lending.absorbed(self.runtime.cache, row.loan):
                row.loan = None
                self.book.tidy(row)

    # ------------------------------------------------------------------ rows going away

    def leaving(self, batch: RowBatch, keep: Sequence[int]) -> None:
        """``GenerationBatch.filter``: rows not in ``keep`` stop writing their caches now.
        A tracked row's entry moves past its reply; otherwise a deferred one is committed at
        its prompt end. The row has ended."""
        kept = set(keep)
        alone = len(batch.uids) == 1
        for i, uid in enumerate(list(batch.uids)):
            if i in kept or (row := self.book.by_uid(uid)) is None:
                continue
            self.commit_finished(row, batch, i, alone=alone)
            if row.loan is not None:
                self._end_loan(row, batch.prompt_cache if alone else None, reason="end")
            self._end(row, "leaving")

    def verified_leaving(self, batch: Any, uids: Sequence[int]) -> None:
        """Rows ``uids`` of a speculative batch finished: ``leaving`` over its rows as the last
        committed round left them (``RoundBook.view``). A row that view does not hold (no round
        yet, or bookkeeping that does not match the cache) keeps its prompt-end entry: its
        reply is not stored."""
        view = self.rounds.view(batch)
        held = view.uids if view is not None else []
        for uid in uids:
            if uid not in held and (row := self.book.by_uid(uid)) is not None:
                if row.reply is not None:
                    log.info("apc_lineage reply of uid=%s not kept: its speculative rounds do not "
                             "account for its cache (entry stays at the prompt end)", uid)
                row.reply = None
                if row.deferral is not None and not row.deferral.shared:  # a lone row: nothing writes it now
                    self.commit_prompt(row, row.deferral.caches, 0, adopt=True, reason="end")
                if row.loan is not None:
                    self._end_loan(row, None, reason="end")
                self._end(row, "leaving")
        if view is not None:
            going = set(uids)
            self.leaving(view, [i for i, uid in enumerate(view.uids) if uid not in going])

    def joining(self, existing: Any, incoming: Any) -> None:
        """Before ``existing.extend(incoming)``: a lone row's buffer is about to be replaced by
        the concatenation, so it can be adopted as it is."""
        if len(existing) == 0:
            return
        for batch in (existing, incoming):
            alone = len(batch.uids) == 1
            for i, uid in enumerate(list(batch.uids)):
                if (row := self.book.by_uid(uid)) is None:
                    continue
                if row.deferral is not None and not row.deferral.shared:  # shared rows move along, by uid
                    self.commit_prompt(row, list(batch.prompt_cache), i, adopt=alone, reason="join")
                if row.loan is not None:
                    self._end_loan(row, batch.prompt_cache if alone else None, reason="join")

    def removed(self, uid: int) -> None:
        """A request is taken out of the prompt batch mid-prefill: its loan ends now, it will
        feed no reply, and a deferred row sharing the batch is committed now, while it is there.
        The row has ended (a lone row's deferral waits for a lookup to adopt it)."""
        if (row := self.book.by_uid(uid)) is None:
            return
        row.reply = None
        deferred = row.deferral
        if deferred is not None and deferred.shared and (found := self.generator.row_of(uid)) is not None:
            self.commit_prompt(row, found[0], found[1], adopt=False, reason="removed")
        if row.loan is not None:
            self._end_loan(row, None, reason="removed")
        self._end(row, "removed")

    # ------------------------------------------------------------------ commit holds

    def _hold_base(self, row: Session, base: Optional[appending.Base]) -> None:
        """The entry ``row``'s reply will be appended to (``base``, if still stored as it was)
        is its hold until it commits or ends (``LineageCache.base``: not evicted nor rewound
        meanwhile, decision 0013)."""
        entry = appending.base_entry(self.runtime.cache, base)
        if entry is not None:
            self.runtime.cache.base(row, entry)

    def _let_go(self, row: Session) -> None:
        """``row``'s commit holds (``BASE``, ``DEFERRED``) are let go: it committed, or has ended."""
        self.runtime.cache.release(row, (BASE, DEFERRED))

    def _end(self, row: Session, event: str) -> None:
        """``event`` ended the row: its commit holds let go (the rest, at the book's
        ``release``, once it is forgotten), and ENDED (a deferral left waits for its commit)."""
        if row.deferral is None:
            self._let_go(row)
        if row.state == SessionState.ENDED:
            self.book.tidy(row)
        else:
            self.book.end(row, event)


__all__ = ["BatchRows", "Commits"]
