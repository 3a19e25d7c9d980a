"""The row machine, fast: the real coordinator driven through mlx-vlm's event order with fake batches.

mlx-vlm 0.7.10 calls, per prompt batch: ``lookup`` for each row, ``checkpoint_lengths``,
``merge_rows`` (warm rows only), ``bind_rows``, ``store_checkpoint`` at each length as the
prefill passes it; then per decode step ``rows_decoded``; and ``rows_leaving`` /
``batches_joining`` / ``request_removed`` as rows go; the server reports ``prefill_completed``,
``first_token`` and ``cancelled``. Here the coordinator is the real one over a real
``LineageCache`` and the kilobyte model's real caches; only the batches are namespaces holding
those caches (``uids``, ``prompt_cache``, ``_num_tokens``), and the runtime is a light one (no
disk store, journal or ticker). Every test runs in milliseconds beside the real-server ones
(test_copyfree_batched.py, test_e2e_reply_reuse.py) that cover the same lives end to end.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.apc_coordinator import PrefillMemoryPlan

from tests.fake_model import prefill, random_tokens
from server_patch.boundaries import SegmentFinder
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree import pool
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.copyfree.spares import JointSpares
from server_patch.disk.loader import BackgroundLoads
from server_patch.integration.coordinator import LineageCoordinator
from server_patch.integration.staging import STAGER_THREAD
from server_patch.integration.pending import Pending
from server_patch.integration.session import ScopeClosedError, SessionBook, SessionState, SessionStateError
from server_patch.integration.timings import CANCELLED, PREFILL, TimingBook
from server_patch.lineage import COLD, LineageCache, LineageConfig, RestorePlan
from server_patch.lineage.flow import Admission
from server_patch.lineage.holds import LOAD, RESERVED
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)
from tests.lineage.test_lineage_policy import QueuedDisk

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

ADMITTED, PREFILLING, DECODING, ENDED = (SessionState.ADMITTED, SessionState.PREFILLING, SessionState.DECODING,
                                         SessionState.ENDED)


class Manager:
    """What the coordinator reads of mlx-vlm's APC manager."""

    exact_cache_guard_tokens = 1

    def __init__(self) -> None:
        self.memory_plan = PrefillMemoryPlan()
        self.lock = threading.Lock()
        self.stats = SimpleNamespace(restored_tokens=0)

    def prepare_prefill(self, reserve: int) -> None:
        pass

    def release(self, blocks: Any) -> None:
        pass


class Batch(SimpleNamespace):
    """A generator batch as the hooks read it: row uids, per-layer caches, tokens emitted."""

    def __len__(self) -> int:
        return len(self.uids)


class Generator:
    """The batch generator the coordinator holds weakly: its prompt and decoding batches."""

    draft_model = None

    def __init__(self) -> None:
        self._prompt_batch: Batch | None = None
        self._generation_batch: Batch | None = None


@pytest.fixture
def server(model, layout, monkeypatch):
    """A coordinator over a light runtime, and its generator. No decode reserve, so a lone
    row's adopted 256-row buffer has room for the next short turn (which is then lent it)."""
    return light_server(model, layout, monkeypatch)


# The light runtimes' loader and stager (a real runtime's are its workers, ``LineageRuntime``):
# one thread each for the test process, started once and idle between tests.
LIGHT_LOADS, LIGHT_STAGES = BackgroundLoads(), BackgroundLoads(STAGER_THREAD)


def light_server(model, layout, monkeypatch, **env: str) -> SimpleNamespace:
    """``server``'s coordinator, with ``env`` set before the copy-free settings are read."""
    monkeypatch.setenv("APC_COPYFREE_DECODE_RESERVE", "0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The copy-free settings are the process's, applied once (``pool.configure``): whatever test
    # ran first in this process chose them, so these are this test's own, given back after it.
    monkeypatch.setattr(pool, "_settings", CopyFreeSettings.from_env())
    config = LineageConfig(disk_write_delay_s=0)
    disk = QueuedDisk()
    finder = SegmentFinder()  # a finder of its own: it has noted no rendered request
    cache = LineageCache(config, disk=disk)
    runtime = SimpleNamespace(config=config, layout=layout, cache=cache,
                              book=SessionBook(release=cache.release), disk=None, refuses=lambda kind: False,
                              finder=finder, boundaries=finder.boundaries,
                              drift_of=lambda prompt, namespace: {}, drift_points=lambda prompt, namespace: [],
                              loads=LIGHT_LOADS, stages=LIGHT_STAGES, spares=JointSpares())
    coordinator = LineageCoordinator(Manager(), model, runtime=runtime)
    generator = Generator()
    coordinator.attach_generator(generator)
    assert coordinator.lineage is not None
    return SimpleNamespace(coordinator=coordinator, generator=generator, cache=runtime.cache, disk=disk,
                           book=coordinator.lineage.book, model=model)


def meta(tokens: np.ndarray) -> dict:
    return {"full_input_ids": [int(t) for t in tokens], "extra_hash": 0}


def admit(s, uid: Any, tokens: np.ndarray) -> tuple[Any, list]:
    """lookup, checkpoint_lengths, merge (a warm row), bind: the row's caches and its lengths."""
    coordinator = s.coordinator
    hit = coordinator.lookup(tokens, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                             prefix_has_media=lambda n: False, uid=uid)
    lengths = coordinator.checkpoint_lengths(tokens, set())
    if hit is None:
        caches = s.model.make_cache()
    else:
        caches, _ = coordinator.merge_rows([hit], [hit["prefix_len"]])
    coordinator.bind_rows([uid], [meta(tokens)])
    s.generator._prompt_batch = Batch(uids=[uid], prompt_cache=caches, _num_tokens=[0])
    return caches, lengths


def prefill_and_store(s, uid: Any, tokens: np.ndarray, caches: list, lengths: list[int], start: int = 0) -> None:
    """The chunked prefill stops at each length and stores there, then runs to the prompt end."""
    done = start
    for n in lengths:
        prefill(s.model, caches, tokens[done:n])
        done = n
        s.coordinator.store_checkpoint(tokens[:n], caches, extra_hash=0, batch_idx=0, uid=uid)
    prefill(s.model, caches, tokens[done:])


def decode(s, batch: Batch, reply: np.ndarray) -> None:
    """Each step feeds one id to the row's cache and reports it (``GenerationBatch.next``)."""
    for token in reply:
        prefill(s.model, batch.prompt_cache, np.array([token], dtype=np.int32))
        batch._num_tokens[0] += 1
        s.coordinator.rows_decoded(batch, [int(token)])


def to_decoding(s, uid: Any) -> Batch:
    """The finished prompt batch joins the (empty) decoding batch."""
    batch = s.generator._prompt_batch
    s.coordinator.batches_joining(Batch(uids=[], prompt_cache=[], _num_tokens=[]), batch)
    s.generator._prompt_batch, s.generator._generation_batch = None, batch
    return batch


def serve_turn(s, uid: Any, tokens: np.ndarray, reply: np.ndarray) -> Any:
    """One lone request's whole life, in mlx-vlm's order; returns its row."""
    caches, lengths = admit(s, uid, tokens)
    row = s.book.by_uid(uid)
    hit = row.record.restored_tokens
    prefill_and_store(s, uid, tokens, caches, [n for n in lengths if n > hit], start=hit)
    s.coordinator.prefill_completed(uid, f"req-{uid}", 0.01)
    batch = to_decoding(s, uid)
    decode(s, batch, reply[:1])
    s.coordinator.first_token(uid, f"req-{uid}", 0.02)
    decode(s, batch, reply[1:])
    s.coordinator.rows_leaving(batch, [])
    s.generator._generation_batch = None
    return row


def test_a_lone_cold_request_lives_admitted_prefilling_decoding_ended_and_keeps_its_reply(server):
    prompt, reply = random_tokens(40, seed=1), random_tokens(6, seed=2)
    caches, lengths = admit(server, 1, prompt)
    row = server.book.by_uid(1)
    assert row.state == PREFILLING and row.history == [ADMITTED] and row.record.uid == 1
    assert lengths[-1] == len(prompt) - 1  # the prefill end, n - 1
    prefill_and_store(server, 1, prompt, caches, lengths)
    assert row.state == DECODING and row.deferral is not None and row.reply is not None
    assert server.cache.entries() == []  # deferred: its buffer is adopted once nothing writes it
    batch = to_decoding(server, 1)
    decode(server, batch, reply)
    assert row.reply.fed == [int(t) for t in reply]
    server.coordinator.first_token(1, "req-1", 0.02)
    assert row.timed and server.book.by_uid(1) is row  # still decoding: its row lives on
    server.coordinator.rows_leaving(batch, [])
    (entry,) = server.cache.entries()
    assert entry.length == len(prompt) + len(reply) and entry.prompt_end == len(prompt) - 1
    assert row.state == ENDED and row.history == [ADMITTED, PREFILLING, DECODING]
    assert row.record.reply_tokens == len(reply) and row.record.commit_ms > 0
    assert len(server.book) == 0  # ended and timed: forgotten
    assert [r.seq for r in server.book.timings.all()] == [row.record.seq]


def test_a_request_has_one_admission_from_its_lookup_to_its_reply_commit(server, monkeypatch):
    """Issue 35: the request flow is built once, by the lookup, and kept in the row: its
    captures, its prompt-end commit and its reply commit use it (it was rebuilt for each)."""
    built: list[Admission] = []
    init = Admission.__init__

    def counted(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Admission, "__init__", counted)
    prompt, reply = random_tokens(40, seed=41), random_tokens(5, seed=42)
    row = serve_turn(server, 1, prompt, reply)
    (entry,) = server.cache.entries()
    assert entry.length == len(prompt) + len(reply)  # captured, committed and moved past its reply
    assert built == [row.pending.admission] and row.pending.admission.plan is row.pending.plan


def lent_next_turn(s, seed: int) -> tuple[Any, Any, np.ndarray]:
    """A lone turn served as uid 1 (random tokens from ``seed`` on), nothing being written,
    then its next turn admitted as uid 2, lent the entry: (the entry, uid 2's row, the prompt)."""
    prompt, reply = random_tokens(40, seed=seed), random_tokens(5, seed=seed + 1)
    serve_turn(s, 1, prompt, reply)
    (entry,) = s.cache.entries()
    s.disk.land()  # nothing is being written
    admit(s, 2, np.concatenate([prompt, reply, random_tokens(12, seed=seed + 2)]))
    return entry, s.book.by_uid(2), prompt


def test_the_next_turn_is_lent_the_entry_and_a_removal_mid_prefill_gives_the_rows_back(server):
    entry, row, _ = lent_next_turn(server, 3)
    assert row.record.kv_admission == "lent" and row.loan is not None and row.loan.merged
    assert entry.lent and entry.loans == 1
    server.coordinator.request_removed(2)
    assert row.state == ENDED and row.loan is None and not entry.lent
    assert server.cache.holds(entry)  # its rows came back whole
    server.coordinator.cancelled(2, "req-2", None)
    assert (row.record.outcome, row.record.phase) == (CANCELLED, PREFILL) and len(server.book) == 0


def test_a_loan_is_a_hold_of_its_row_which_its_admission_keeps(server):
    """Issue 35: the loan is a hold of kind ``LENT`` (``lineage.holds``) owned by the request's
    row from its lookup on (lent before the row was named, then handed to it); the admission
    lets go of the row's load and reservation, not of its loan."""
    entry, row, _ = lent_next_turn(server, 43)
    assert row.loan is not None and row.loan.loan.owner is row and entry.lent
    assert server.cache.release(row, (LOAD, RESERVED)) == 0 and entry.lent  # nothing but its loan
    server.coordinator.request_removed(2)  # its loan ends by its own event: the rows given back
    assert not entry.lent and server.cache.release(row) == 0


def test_a_forgotten_row_lets_go_of_what_its_request_still_holds():
    """The one sweep at a request's end: the book releases a row it forgets."""
    cache = LineageCache(LineageConfig())
    book = SessionBook(TimingBook(), release=cache.release)
    row = book.admit(cold(random_tokens(20, seed=46)))
    cache.reserve(row, "staged:x", 1000)
    assert cache.budgets()["loading_bytes"] == 1000
    book.end(row, "removed")  # ended, no record: forgotten
    assert len(book) == 0 and cache.budgets()["loading_bytes"] == 0


def test_an_entry_queued_for_writing_is_copied_not_lent(server):
    """The race the receipt closes: the idle tick queues the entry's write, then a lookup would
    lend its rows while the writer reads them. The cache refuses the loan; the turn copies."""
    prompt, reply = random_tokens(40, seed=6), random_tokens(5, seed=7)
    serve_turn(server, 1, prompt, reply)
    (entry,) = server.cache.entries()
    assert server.cache.tick(now=1e12) == 1 and server.disk.queue  # queued, the writer holds it
    turn = np.concatenate([prompt, reply, random_tokens(12, seed=8)])
    admit(server, 2, turn)
    row = server.book.by_uid(2)
    assert row.record.kv_admission == "copied" and row.loan is None and not entry.lent
    server.disk.land()
    assert entry.on_disk


def test_a_resend_is_at_its_prefill_end_when_bound_and_no_store_commits_it(server):
    prompt, reply = random_tokens(40, seed=9), random_tokens(4, seed=10)
    serve_turn(server, 1, prompt, reply)
    server.cache.rewind(server.cache.entries()[0])  # the head back at the prompt end
    admit(server, 2, prompt)  # the same prompt again (a regenerate)
    row = server.book.by_uid(2)
    assert row.record.restored_tokens == len(prompt) - 1
    assert row.state == DECODING and row.history == [ADMITTED, PREFILLING] and row.reply is not None
    assert server.book.with_tokens(prompt) == []  # not prefilling: no store finds it


def test_a_lone_deferred_row_is_adopted_when_it_joins_a_shared_batch(server):
    prompt = random_tokens(40, seed=11)
    caches, lengths = admit(server, 1, prompt)
    prefill_and_store(server, 1, prompt, caches, lengths)
    row = server.book.by_uid(1)
    lone = server.generator._prompt_batch
    existing = Batch(uids=[7], prompt_cache=server.model.make_cache(), _num_tokens=[3])
    server.coordinator.batches_joining(existing, lone)
    (entry,) = server.cache.entries()  # committed at its prompt end now (its buffer adopted)
    assert entry.length == len(prompt) - 1 and row.deferral is None
    assert row.state == DECODING and row.reply is not None  # it decodes on, its reply still tracked


def test_cold_rows_sharing_a_batch_are_copied_out_with_room_for_their_replies_at_their_prefill_end(
        server, monkeypatch):
    """With reply reuse a cold row of a shared batch has no entry its reply could be appended
    to, so its prompt end is copied out at once into buffers with room for the reply (issue 29:
    when it ends only the reply rows are written); each entry holds its own row's state. That
    copy is committed by the row's own prompt-end verb (issue 35: ``commit_prompt``, no other
    store)."""
    prompts = [random_tokens(40, seed=15), random_tokens(40, seed=16)]
    coordinator = server.coordinator
    verb, committed = coordinator.lineage.rows.commit_prompt, []

    def commit_prompt(row, *args, **kwargs):
        committed.append((row.uid, kwargs["reason"], kwargs.get("copied") is not None))
        return verb(row, *args, **kwargs)

    monkeypatch.setattr(coordinator.lineage.rows, "commit_prompt", commit_prompt)
    for prompt in prompts:
        assert coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                  prefix_has_media=lambda n: False) is None
        assert coordinator.checkpoint_lengths(prompt, set())[-1] == len(prompt) - 1
    coordinator.bind_rows([1, 2], [meta(p) for p in prompts])
    rows = [server.book.by_uid(1), server.book.by_uid(2)]
    singles = []
    for prompt in prompts:  # each row's state at its prefill end, then one two-row batch of them
        caches = server.model.make_cache()
        prefill(server.model, caches, prompt[:-1])
        singles.append(caches)
    shared = copyfree_merge.merge_rows(singles, [39, 39], [1, 1], reserve=0)
    batch = Batch(uids=[1, 2], prompt_cache=shared, _num_tokens=[0, 0])
    server.generator._generation_batch = batch
    for i, prompt in enumerate(prompts):
        coordinator.store_checkpoint(prompt[:-1], shared, extra_hash=0, batch_idx=i, uid=i + 1)
    assert [r.state for r in rows] == [DECODING, DECODING] and len(server.cache.entries()) == 2
    assert committed == [(1, "prefill-end", True), (2, "prefill-end", True)]
    assert all(r.deferral is None and r.reply is not None and r.reply.base is not None for r in rows)
    assert all(e.kv.capacity() > 40 for e in server.cache.entries())  # room for the reply
    coordinator.rows_leaving(batch, [1])  # the first row ends; its cache lacks the last prompt token
    assert len(server.cache.entries()) == 2  # so no reply is kept: its entry stays at the prompt end
    assert rows[0].state == ENDED and rows[1].state == DECODING
    coordinator.rows_leaving(batch, [])  # then the second (the first one's row is over already)
    assert rows[1].state == ENDED and len(server.cache.entries()) == 2
    for prompt, single in zip(prompts, singles):  # each entry holds its own row's state
        (stored,) = [e for e in server.cache.entries() if np.array_equal(e.tokens, prompt[:-1])]
        own = rows_of(server, single)
        assert own and all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(stored.kv.prefix(39).arrays(), own))


def rows_of(s, caches: list) -> list:
    """The 39 KV rows of a single-row cache, copied."""
    from server_patch.state import rows

    return rows.kv_rows(s.coordinator.lineage.runtime.layout, caches, None, 39, copy=True).prefix(39).arrays()


def test_another_requests_lookup_commits_a_deferred_entry_it_would_restore_from(server):
    prompt = random_tokens(40, seed=13)
    caches, lengths = admit(server, 1, prompt)
    prefill_and_store(server, 1, prompt, caches, lengths)
    first = server.book.by_uid(1)
    to_decoding(server, 1)
    assert first.deferral is not None and server.cache.entries() == []
    follow_up = np.concatenate([prompt, random_tokens(10, seed=14)])
    server.coordinator.lookup(follow_up, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                              prefix_has_media=lambda n: False)
    (entry,) = server.cache.entries()  # surfaced: committed by a copy, then restored from
    assert first.deferral is None and first.state == DECODING and entry.length == len(prompt) - 1
    assert server.book.by_key(server.book.rows()[-1].key).record.restored_tokens == len(prompt) - 1


def test_a_deferred_row_nobody_decodes_commits_its_own_state_when_a_lookup_tells_it(server):
    """Issue 35: another request's lookup does not commit a deferred row's state; it tells
    that row (``BatchRows.surface``), whose own commit verb (``commit_prompt``) stores it. A
    row no batch holds any more (its leaving unseen) is told as an orphan: its buffer adopted,
    its reply forgotten, though the lookup would not restore from it."""
    prompt = random_tokens(40, seed=47)
    caches, lengths = admit(server, 1, prompt)
    prefill_and_store(server, 1, prompt, caches, lengths)
    row = server.book.by_uid(1)
    assert row.deferral is not None and row.reply is not None and server.cache.entries() == []
    server.generator._prompt_batch = None  # its row left unseen: no batch holds uid 1
    server.coordinator.lookup(random_tokens(30, seed=48), extra_hash=0, safe_lookup_min=0,
                              suffix_is_text_only=lambda n: True, prefix_has_media=lambda n: False, uid=2)
    (entry,) = server.cache.entries()
    assert entry.length == len(prompt) - 1 and row.deferral is None and row.reply is None
    assert server.book.by_uid(2).record.restored_tokens == 0  # an unrelated prompt: cold


def test_two_lookups_of_one_uid_are_one_row_and_the_same_prompt_of_another_uid_another(server):
    prompt = random_tokens(40, seed=12)
    for uid in (1, 1, 2):
        server.coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                  prefix_has_media=lambda n: False, uid=uid)
    assert len(server.book) == 2
    assert server.book.by_uid(1).record.seq == 2  # the second lookup's record: one uid, one request
    assert server.book.by_uid(2).record.seq == 3 and server.book.by_uid(2) is not server.book.by_uid(1)


def test_every_coordinator_of_a_runtime_keeps_its_sessions_in_the_runtimes_one_book(server):
    """mlx-vlm builds a coordinator per batch generator (the server makes a new generator when
    an idle one closes, numbering its uids from 0 again) and per single-sequence call: each one
    works in the runtime's one book and ring, a uid naming a session within its own scope, and
    identical prompts are sessions of their own."""
    runtime = server.coordinator.lineage.runtime
    other = LineageCoordinator(Manager(), server.model, runtime=runtime)
    assert other.lineage is not None and other.lineage.book is not server.book
    assert server.book.same_book(runtime.book) and other.lineage.book.same_book(runtime.book)
    assert server.book.timings is other.lineage.book.timings is runtime.book.timings
    prompt = random_tokens(40, seed=21)
    for coordinator, uid in ((server.coordinator, 1), (server.coordinator, 2), (other, 1)):
        coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                           prefix_has_media=lambda n: False, uid=uid)
    first, twin, theirs = server.book.by_uid(1), server.book.by_uid(2), other.lineage.book.by_uid(1)
    assert runtime.book.sessions() == [first, twin, theirs] and len({id(first), id(twin), id(theirs)}) == 3
    assert server.book.rows() == [first, twin] and other.lineage.book.rows() == [theirs]
    other.first_token(1, "req-other", 0.02)  # the other generator's uid 1: its session, not ours
    assert theirs.timed and not first.timed and theirs.request_id == "req-other"
    assert [r.seq for r in runtime.book.timings.all()] == [theirs.record.seq]


def test_closing_a_coordinator_ends_its_sessions_and_lets_go_of_their_loans_and_deferrals(server, monkeypatch):
    """mlx-vlm closes a batch generator (the server, an idle one before it builds the next)
    and ends a single-sequence call: no event of its rows will come. The door closes the
    coordinator's scope: a lent row gives its rows back, a lone deferred row's state is
    committed (its buffer adopted), their open records are cancelled in prefill, every
    session of the scope leaves the book with no hold left; another coordinator's sessions
    stay, and the closed scope refuses new sessions (fail closed: a cold prefill)."""
    from server_patch.integration import hooks

    entry, lent, prompt = lent_next_turn(server, 51)
    assert lent.loan is not None and entry.lent
    alone = random_tokens(40, seed=54)
    caches, lengths = admit(server, 3, alone)
    prefill_and_store(server, 3, alone, caches, lengths)
    deferred = server.book.by_uid(3)
    assert deferred.deferral is not None and deferred.reply is not None
    runtime = server.coordinator.lineage.runtime
    other = LineageCoordinator(Manager(), server.model, runtime=runtime)  # the next generator's
    other.lookup(random_tokens(30, seed=55), extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                 prefix_has_media=lambda n: False, uid=2)
    theirs = other.lineage.book.by_uid(2)

    server.generator._prompt_batch = server.generator._generation_batch = None  # the generator closes
    hooks.coordinator_closed(server.coordinator)
    assert (lent.state, lent.loan, entry.lent) == (ENDED, None, False) and server.cache.holds(entry)
    assert (deferred.state, deferred.deferral, deferred.reply) == (ENDED, None, None)
    (adopted,) = [e for e in server.cache.entries() if e is not entry]  # the lone row's state, committed
    assert np.array_equal(adopted.tokens, alone[:-1])
    assert all((r.record.outcome, r.record.phase) == (CANCELLED, PREFILL) for r in (lent, deferred))
    assert server.cache.release(lent) == 0 and server.cache.release(deferred) == 0  # no hold left
    assert server.book.rows() == [] and runtime.book.sessions() == [theirs]
    assert theirs.state == ADMITTED and not theirs.timed  # another scope's session stays
    hooks.coordinator_closed(server.coordinator)  # again (mlx-vlm's __del__ closes once more): nothing
    assert runtime.book.sessions() == [theirs]

    monkeypatch.setenv("APC_TEST_FAULTS", "0")
    assert server.coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                     prefix_has_media=lambda n: False, uid=4) is None  # cold
    assert server.book.rows() == [] and not entry.lent
    monkeypatch.setenv("APC_TEST_FAULTS", "1")
    with pytest.raises(ScopeClosedError):
        server.book.admit(cold(prompt), uid=5)
    assert runtime.book.sessions() == [theirs]


def test_a_single_sequence_call_closes_its_scope_however_it_ends_and_a_queued_row_leaves_the_queue(server):
    """The single-sequence path's coordinator lives for one ``stream_generate`` call: the door's
    ``closing`` around its prefill and decode closes its scope when the call ends, raising or
    not. A row still waiting in the queue (its load) ends as one that left it, its holds let go."""
    from server_patch.integration import hooks

    prompt = random_tokens(40, seed=56)
    server.coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                              prefix_has_media=lambda n: False)  # no uid: the single-sequence path
    (single,) = server.book.rows()
    queued = server.book.loading(cold(random_tokens(30, seed=57)), load=object(), uid=9)
    server.cache.reserve(queued, "loading:x", 1000)
    with pytest.raises(RuntimeError, match="the consumer failed"):
        with hooks.closing(server.coordinator):
            raise RuntimeError("the consumer failed")
    assert (single.state, queued.state, queued.load) == (ENDED, ENDED, None)
    assert server.book.closed and server.book.rows() == [] and server.cache.budgets()["loading_bytes"] == 0


def test_a_lookup_without_a_uid_is_named_by_its_bind(server):
    """The single-sequence path's lookup has no uid: its row is found by its request key until
    a bind names it (a second lookup of the same key before then is the same row)."""
    prompt = random_tokens(40, seed=17)
    for _ in range(2):
        server.coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                  prefix_has_media=lambda n: False)
    assert len(server.book) == 1
    server.coordinator.bind_rows([5], [meta(prompt)])
    assert server.book.by_uid(5) is server.book.rows()[0] and server.book.by_uid(5).state == PREFILLING


def cold(tokens: np.ndarray) -> Pending:
    """A prompt planned cold, as a lookup that found nothing admits it."""
    return Pending(tokens, "0", RestorePlan(0, COLD, prompt_len=len(tokens)))


def test_an_illegal_transition_fails_closed_and_raises_under_test_faults(monkeypatch):
    book = SessionBook(TimingBook())
    row = book.admit(cold(random_tokens(20)))
    book.end(row, "removed")
    monkeypatch.setenv("APC_TEST_FAULTS", "0")
    assert not row.move(DECODING, "store") and row.state == ENDED
    monkeypatch.setenv("APC_TEST_FAULTS", "1")
    with pytest.raises(SessionStateError, match="ended -> decoding on store"):
        row.move(DECODING, "store")


def test_the_book_is_bounded_but_keeps_rows_with_a_loan_or_a_deferral():
    book = SessionBook(TimingBook(), limit=3)
    rows = [book.admit(cold(random_tokens(20, seed=i))) for i in range(3)]
    rows[0].loan, rows[1].deferral = object(), object()
    book.admit(cold(random_tokens(20, seed=9)))
    assert book.rows()[:2] == rows[:2] and rows[2] not in book.rows() and len(book) == 3


def test_identical_prompts_in_one_prompt_batch_are_rows_of_their_own_each_keeping_its_own_reply(server):
    """Issue 35's twins: three identical prompts admitted in one prompt batch, their replies cut
    at different lengths. Each is a row of its own from its lookup (by uid, not by its tokens),
    each prefill-end store tracks its own row's reply, and each follow-up turn (its own reply
    appended) restores past its own reply."""
    prompt, reply = random_tokens(40, seed=31), random_tokens(6, seed=32)
    coordinator, uids, cuts = server.coordinator, [11, 12, 13], [2, 4, 6]
    for uid in uids:
        assert coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                  prefix_has_media=lambda n: False, uid=uid) is None
        assert coordinator.checkpoint_lengths(prompt, set())[-1] == len(prompt) - 1
    coordinator.bind_rows(uids, [meta(prompt)] * 3)
    rows = [server.book.by_uid(uid) for uid in uids]
    assert len({id(r) for r in rows}) == 3 and [r.state for r in rows] == [PREFILLING] * 3
    assert len({r.record.seq for r in rows}) == 3 and [r.record.uid for r in rows] == uids
    singles = []
    for _ in uids:
        caches = server.model.make_cache()
        prefill(server.model, caches, prompt[:-1])
        singles.append(caches)
    shared = copyfree_merge.merge_rows(singles, [39] * 3, [1] * 3, reserve=0)
    batch = Batch(uids=list(uids), prompt_cache=shared, _num_tokens=[0, 0, 0])
    server.generator._generation_batch = batch
    for i, uid in enumerate(uids):
        coordinator.store_checkpoint(prompt[:-1], shared, extra_hash=0, batch_idx=i, uid=uid)
        assert rows[i].state == DECODING and rows[i].reply is not None  # its own row, no twin's
    assert all(r.state == DECODING for r in rows)
    server.model(mx.array([[int(prompt[-1])]] * 3), cache=shared)  # the prompt batch's last token
    keep = [0, 1, 2]
    for step, token in enumerate(reply):  # each step feeds the same id to every row still there
        server.model(mx.array([[int(token)]] * 3), cache=shared)
        batch._num_tokens = [n + 1 for n in batch._num_tokens]
        coordinator.rows_decoded(batch, [int(token)] * 3)
        for i, cut in enumerate(cuts):
            if step + 1 == cut:  # twin i's reply ends here: it leaves the batch
                keep.remove(i)
                coordinator.rows_leaving(batch, keep)
    assert [r.state for r in rows] == [ENDED] * 3
    assert [r.record.reply_tokens for r in rows] == cuts
    for i, cut in enumerate(cuts):  # each twin's next turn: its own reply, then a new message
        turn = np.concatenate([prompt, reply[:cut], random_tokens(8, seed=40 + i)])
        coordinator.lookup(turn, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                           prefix_has_media=lambda n: False, uid=20 + i)
        assert server.book.by_uid(20 + i).record.restored_tokens >= len(prompt) + cut
