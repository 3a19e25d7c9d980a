"""``apcctl bench fleet-roll``'s parts that decide what is measured (issue 38): the disruption starts
once its request is sent and the clients wait before the last quarter until it ended (so traffic
surrounds it however long it takes); the same request of two runs is paired by agent and place;
the command's checks fail on a client error, an answer unlike a cold server's, a failed disruption."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from apcctl.commands.bench_fleet_roll import _failures
from apcctl.fleet.roll_bench import Schedule, after_window, keyed
from apcctl.fleet.traffic import Sent, TraceResult


def test_the_disruption_starts_at_its_request_and_the_last_quarter_waits_for_it() -> None:
    order: list[object] = []
    schedule: Schedule

    def disrupt() -> None:
        order.append("disruption began")
        deadline = time.monotonic() + 60
        while schedule._sent < 7:  # a roll that lasts until request 6, the last quarter's first, is at the gate
            assert time.monotonic() < deadline
            time.sleep(0.01)
        order.append("disruption ended")

    schedule = Schedule(requests=8, start_at=2, disrupt=disrupt)
    schedule.start()
    for n in range(6):  # requests 0..5 pass at once; the disruption starts as request 2 is sent
        schedule.gate()
        order.append(n)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(lambda: (schedule.gate(), order.append(6))).result(timeout=60)
    schedule.finish()
    assert order.index("disruption began") > order.index(1)
    assert order[-2:] == ["disruption ended", 6]  # request 6 went only once the disruption had ended
    assert len(schedule.window) == 2 and schedule.window[0] <= schedule.window[1]
    assert schedule.errors == [] and schedule.held_s > 0


def test_a_failed_disruption_is_reported_and_releases_the_clients() -> None:
    def disrupt() -> None:
        raise RuntimeError("fleet restart exited 1")

    schedule = Schedule(requests=4, start_at=0, disrupt=disrupt).start()
    for _ in range(4):
        schedule.gate()  # the last request waits for the failure, then goes on
    schedule.finish()
    assert schedule.errors == ["RuntimeError: fleet restart exited 1"]


def _sent(conversation: str, prompt: int, cached: int, at: float) -> Sent:
    return Sent(conversation, "turn", [], {"usage": {"prompt_tokens": prompt,
                                                     "prompt_tokens_details": {"cached_tokens": cached}}}, at)


def test_requests_after_the_disruption_are_compared_with_the_same_requests_undisturbed() -> None:
    base = TraceResult([_sent("agent0/a", 100, 90, 1), _sent("agent0/b", 100, 80, 2),
                        _sent("agent1/a", 50, 40, 1), _sent("agent1/c", 60, 50, 3)], 0)
    rolled = TraceResult([_sent("agent1/a", 50, 0, 1), _sent("agent1/c", 60, 30, 9),  # agents' order differs
                          _sent("agent0/a", 100, 90, 1), _sent("agent0/b", 100, 60, 8)], 0)
    assert keyed(rolled.sent)[("agent1", 1)].prompt_tokens == 60
    # after t=5: agent0's 2nd (40 prefilled, 20 undisturbed) and agent1's 2nd (30 and 10)
    assert after_window(rolled, base, ended=5) == (2, 70, 30)


def test_the_checks_name_each_failure() -> None:
    ok = {"tier": "shared", "scenario": "fleet restart", "client_errors": 0, "differ_from_cold": 0,
          "disruption_errors": []}
    assert _failures([ok]) == []
    bad = {**ok, "tier": "private", "client_errors": 2, "differ_from_cold": 1, "disruption_errors": ["X: y"]}
    assert _failures([ok, bad]) == ["private tier, fleet restart: 2 client errors",
                                    "private tier, fleet restart: 1 answers differ from a cold server's",
                                    "private tier, fleet restart: X: y"]
