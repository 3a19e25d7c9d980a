"""A closed generator's sessions leave the book, on the real patched server (issue 35).

mlx-vlm's server closes an idle batch generator when the next request comes and builds a new
one, whose uids start again at 0; each generator's coordinator works in its own scope of the
runtime's one book. The generator's ``close`` goes through the door (``coordinator_closed``):
its scope is closed, its sessions end and leave the book, their holds let go. Here: the door
runs at that close (its log line), every request of the closed generators has one record,
ended and not cancelled, in ``/admin/requests``, no entry is held for a queued request, and
the new generator's request still restores from the entry the closed one's request left.
The row-machine tests (test_row_machine.py) cover a scope closed with a loan and a deferral.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from server_patch.admin.schema import RequestRecord
from tests.server_harness import PatchedServer, reply_text, text, wait_for

CLOSED = "apc_lineage scope closed"


def records(server: PatchedServer) -> list[RequestRecord]:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return [RequestRecord.from_json(r) for r in body["requests"]]


def all_ended(server: PatchedServer, count: int) -> bool:
    found = records(server)
    return len(found) == count and all(r.ended for r in found)


@pytest.mark.server
def test_an_idle_generator_closed_for_the_next_request_leaves_nothing_of_its_sessions(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, log_dir=tmp_path) as server:
        first = [{"role": "system", "content": text(60, 3501)}, {"role": "user", "content": text(40, 3502)}]
        answer = server.chat(first, max_tokens=4)
        wait_for(lambda: all_ended(server, 1), "the first request's row ended", server)
        assert CLOSED not in server.log_text()  # its generator is idle, not closed: no request came since

        follow_up = first + [{"role": "assistant", "content": reply_text(answer)},
                             {"role": "user", "content": text(20, 3503)}]
        _, restore = server.chat_restore(follow_up, max_tokens=4)  # the idle generator closes, a new one serves
        wait_for(lambda: CLOSED in server.log_text(), "the closed generator's scope closed", server)
        assert int(restore["restored"]) > 0  # from the entry the closed generator's request left
        wait_for(lambda: all_ended(server, 2), "the follow-up's row ended", server)

        server.chat([{"role": "user", "content": text(30, 3504)}], max_tokens=4)  # closes the second one
        wait_for(lambda: server.log_text().count(CLOSED) == 2, "the second generator's scope closed", server)
        wait_for(lambda: all_ended(server, 3), "the third request's row ended", server)
        found = records(server)
        assert len({r.seq for r in found}) == 3 and all(r.outcome != "cancelled" for r in found)
        status, body = server.admin("GET", "/status")
        assert status == 200 and body["lineage"]["budgets"]["held_bytes"] == 0
        assert "left the book" in server.log_text()
