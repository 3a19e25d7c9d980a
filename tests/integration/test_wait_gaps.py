"""A decoding row's inter-token gaps, split into named parts that add up to the gap (issue 40).

The real ``SessionBook``, ``TimingBook`` and ``Waits``; the clock is stepped by the test (the
fixtures of ``test_waits``), so every amount asserted is exact and none is a wall time.
"""

from __future__ import annotations

import pytest

from server_patch.integration import waits
from server_patch.integration.session import SessionBook, SessionState
from server_patch.integration.waits import OWN_STEP, UNATTRIBUTED, Owners, Work
from tests.integration.test_waits import Clock, admitted, book, clock, work  # noqa: F401 (fixtures)


def step(book: SessionBook, clock: Clock, seconds: float, uids: list[str], after: float = 0.0) -> None:
    """One joint decode step: ``seconds`` to its tokens (the gaps end there), ``after`` more."""
    book.waits.begin(OWN_STEP, Owners())
    clock.now += seconds
    book.waits.close_gaps(uids)
    clock.now += after
    book.waits.end()


def test_a_gap_is_its_own_step_and_others_work_and_the_rest_unattributed(book: SessionBook, clock: Clock) -> None:
    victim, other = admitted(book, 1, uid="v"), admitted(book, 2, uid="o")
    victim.move(SessionState.DECODING, "prefill end")
    step(book, clock, 0.05, ["v"])  # its first token of a step: the first gap opens here
    assert victim.record.gap_count == 0
    work(book, clock, Work.PREFILL, 0.2, Owners(uids=("o",)))
    clock.now += 0.01  # the loop, the server's queues: no unit
    work(book, clock, Work.JOIN, 0.3, Owners(uids=("o",)))
    step(book, clock, 0.08, ["v", "o"])
    gap = victim.record.worst_gap
    assert gap["ms"] == pytest.approx(590.0)
    assert gap["parts"] == pytest.approx({"join": 300.0, "prefill": 200.0, OWN_STEP: 80.0, UNATTRIBUTED: 10.0})
    assert sum(gap["parts"].values()) == pytest.approx(gap["ms"])
    assert gap["to"] - gap["from"] == pytest.approx(0.59)
    assert victim.record.gaps == [gap] and victim.record.gap_count == 1
    # Its own step is never a wait for another's work; the others' work is.
    assert victim.record.waited == pytest.approx({"prefill": 200.0, "join": 300.0})
    assert other.record.gap_count == 0 and other.record.waited == {}  # not decoding: no gap, its own work


def test_a_step_past_its_tokens_falls_in_the_next_gap_and_a_leave_inside_it_is_its_own(book: SessionBook,
                                                                                       clock: Clock) -> None:
    victim, leaver = admitted(book, 1, uid="v"), admitted(book, 2, uid="l")
    victim.move(SessionState.DECODING, "prefill end")
    leaver.move(SessionState.DECODING, "prefill end")
    step(book, clock, 0.05, ["v", "l"])
    book.waits.begin(OWN_STEP, Owners())
    clock.now += 0.04
    book.waits.close_gaps(["v", "l"])  # tokens of the step; then the leaver's rows leave inside it
    work(book, clock, Work.LEAVE, 0.1, Owners(uids=("l",)))
    clock.now += 0.02
    book.waits.end()
    book.end(leaver, "leaving")
    step(book, clock, 0.06, ["v"])
    # The second gap: the rest of the step (20 ms) and the next one to its tokens (60 ms) are its
    # own step; the leave inside it is the leaver's.
    gap = victim.record.worst_gap
    assert gap["parts"] == pytest.approx({"leave": 100.0, OWN_STEP: 80.0, UNATTRIBUTED: 0.0})
    assert gap["ms"] == pytest.approx(180.0) and victim.record.gap_count == 2
    assert victim.record.gaps == [gap]  # the first gap (90 ms of its own step) held no one's work
    assert victim.record.waited == pytest.approx({"leave": 100.0})
    assert leaver.record.waited == {}


def test_only_gaps_that_held_others_work_are_kept_largest_first(book: SessionBook, clock: Clock) -> None:
    victim = admitted(book, 1, uid="v")
    victim.move(SessionState.DECODING, "prefill end")
    step(book, clock, 0.01, ["v"])
    step(book, clock, 0.9, ["v"])  # the largest gap, its own step alone: the worst, not kept
    for n in range(waits.GAPS_KEPT + 2):
        work(book, clock, Work.COMMIT, 0.01 * (n + 1), Owners())
        step(book, clock, 0.01, ["v"])
    assert victim.record.worst_gap["parts"] == pytest.approx({OWN_STEP: 900.0, UNATTRIBUTED: 0.0})
    kept = [g["ms"] for g in victim.record.gaps]
    assert len(kept) == waits.GAPS_KEPT and kept == sorted(kept, reverse=True)
    assert kept[0] == pytest.approx(10.0 * (waits.GAPS_KEPT + 2) + 10.0)
    assert victim.record.gap_count == waits.GAPS_KEPT + 3
    assert "gap_from" not in victim.record.as_dict() and "gap_parts" not in victim.record.as_dict()
