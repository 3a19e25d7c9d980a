"""``bench stall``'s ``short-visits``: short requests come and go beside a long stream that stays.

The other scenarios measure a short victim while a long row joins its batch and leaves first.
Here the measured stream is the long one: the other session's conversation (``plan.context``
tokens), its next turn restored from RAM as in ``ram-restore``, decoding ``plan.long_tokens``
tokens (past mlx-vlm's 256-step regrow of its batch buffer, after the last visit too). The event
is ``plan.visits`` short requests, one after another (each starts once the previous one ended):
a fresh ~``plan.victim_context``-token prompt each, replying ``plan.visit_reply`` tokens. Each
joins the decoding long row's batch (the long row's KV written into a joint buffer, or one
allocated at the join when none was made ahead) and leaves it while the long row stays (kept in
place, ``copyfree.batch.filter_kv``); the long row's periodic regrow comes in its stream alone
and with the visits.

The server keeps no count of joins and leaves: the row reports, from the client's token times,
how many visits joined (first token while the long row decoded) and left (last token before the
long row's last), and how many tokens the long row decoded after the last visit left. The
server's own split of the long stream's gaps (``bench.stall_gaps``), alone and with the visits,
says what each waited for.
"""

from __future__ import annotations

from typing import Any

from apcctl.lab.bench.stall_session import Loaded, Session, event_conversation, tagged
from apcctl.lab.bench.ttft import conversation, next_turn


def prepare(session: Session) -> dict[str, Any]:
    """The long stream (its first turn asked now, the next one streamed alone and with the
    visits) and the visits as the event."""
    first = event_conversation(session, "long")
    stream = next_turn(first, session.ask(first)[0], 0)
    plan = session.plan
    visits: list[list[float]] = []

    def event() -> None:
        for i in range(plan.visits):
            times: list[float] = []
            visits.append(times)
            messages = tagged(conversation(plan.victim_context, session.model_dir), f"visit-{i}")
            session.server.stream(messages, plan.visit_reply, on_token=times.append, extra={"ignore_eos": True})

    def report(loaded: Loaded) -> dict[str, Any]:
        return visits_report(loaded.with_event, visits, plan.visit_reply)

    return {"event": event, "report": report, "victim_tokens": plan.long_tokens, "stream": stream,
            "split_alone": True}  # its regrow alone, without the visits


def visits_report(long: list[float], visits: list[list[float]], reply: int) -> dict[str, Any]:
    """What the visits did beside the long stream's token times ``long``: how many replied in
    full (``reply`` tokens), joined while it decoded and left before it ended, and how many
    tokens it decoded after the last one left."""
    ran = [times for times in visits if times]
    last = max((times[-1] for times in ran), default=None)
    return {"visits": {
        "done": sum(1 for times in ran if len(times) == reply),
        "joined": sum(1 for times in ran if long and long[0] < times[0] < long[-1]),
        "left": sum(1 for times in ran if long and long[0] < times[-1] < long[-1]),
        "long_tokens_after": sum(1 for at in long if last is not None and at > last),
    }}


def notes(row: dict[str, Any]) -> str:
    """"3/3 visits joined and left while it decoded, 260 tokens after the last"."""
    visits = row.get("visits")
    if not visits:
        return ""
    return (f"visits done {visits['done']}, joined {visits['joined']}, left {visits['left']} while it decoded, "
            f"{visits['long_tokens_after']} tokens after the last")


__all__ = ["notes", "prepare", "visits_report"]
