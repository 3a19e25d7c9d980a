"""End to end, real HTTP on the tiny model: the server names what the client changed (issue 37).

Each case is one tenant (drift is found only within a namespace) sending a turn, then a prompt
changed the way a real client changes it; the second request's record in ``/admin/requests``
must name the cause and the segment, carry a decoded diff without control characters, and the
Prometheus counter must count it. ``APC_DRIFT_TEXT=0`` keeps the cause without the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from apcctl.cli import main
from apcctl.commands.codes import ExitStatus
from tests.server_harness import ADMIN_TOKEN, PatchedServer, reply_text, text

pytestmark = pytest.mark.server
PARAMS = {"max_tokens": 8}
SYSTEM = "You are the drift test's assistant. " + text(60, seed=3)
TASK = text(50, seed=4)


def msgs(*turns: tuple[str, str], system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, *({"role": r, "content": c} for r, c in turns)]


def apcctl(server: PatchedServer, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--server", server.base_url, "--token", ADMIN_TOKEN])


def record_of(server: PatchedServer, answer: dict[str, Any]) -> dict[str, Any]:
    status, body = server.admin("GET", "/requests?limit=5000")
    assert status == 200, body
    return max(body["requests"], key=lambda r: r["seq"])


def send(server: PatchedServer, tenant: str, messages: list[dict[str, Any]]) -> tuple[dict, dict]:
    answer = server.chat(messages, tenant=tenant, **PARAMS)
    return answer, record_of(server, answer)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("drift")) as running:
        yield running


def test_each_cause_named_from_admin_requests(server: PatchedServer) -> None:
    cases: dict[str, tuple[str, str]] = {}

    # A date in the system prompt, changed in place (the next day's turn).
    _, first = send(server, "date", msgs(("user", TASK), system=SYSTEM + " Today is 2026-12-05 17:15."))
    assert first["drift"] == {}
    _, later = send(server, "date", msgs(("user", TASK), ("assistant", "ok"), ("user", "more"),
                                         system=SYSTEM + " Today is 2026-12-06 09:02."))
    cases["date"] = (later["drift"].get("cause"), "date/time changed")
    date_seq = later["seq"]
    assert later["drift"].get("segment") == "system"
    assert "5" in later["drift"]["removed"] and "6" in later["drift"]["added"]

    # mini-swe-agent after a format error: the reply dropped, a user message appended.
    send(server, "retry", msgs(("user", TASK)))
    _, later = send(server, "retry", msgs(("user", TASK), ("user", "Format error: " + text(20, seed=5))))
    cases["retry"] = (later["drift"].get("cause"), "reply dropped on retry")
    assert later["drift"].get("segment") == "generation prompt"

    # qwen-code -c: the first user message rebuilt without its date reminder.
    reminder = "<system-reminder>The current date is 2026-12-05.</system-reminder>\n"
    history = [("user", reminder + TASK), ("assistant", text(30, seed=6)), ("user", text(20, seed=7))]
    send(server, "resume", msgs(*history))
    _, later = send(server, "resume", msgs(("user", TASK), *history[1:], ("assistant", "ok"), ("user", "go on")))
    cases["resume"] = (later["drift"].get("cause"), "history rebuilt on resume")
    assert later["drift"].get("segment", "").startswith("message 2")

    # A system prompt edit.
    send(server, "system", msgs(("user", TASK)))
    _, later = send(server, "system", msgs(("user", TASK), ("assistant", "ok"), ("user", "more"),
                                           system=SYSTEM.replace("assistant.", "reviewer, strict and brief.")))
    cases["system"] = (later["drift"].get("cause"), "system prompt edited")

    # A reply sent back otherwise than generated (its middle re-written; the tiny model's word-level
    # tokenizer does not see whitespace): the ring holds the fed reply.
    answer, _ = send(server, "reply", msgs(("user", TASK)))
    generated = reply_text(answer).split()
    assert len(generated) >= 3, generated
    changed = " ".join([generated[0], "rewritten", *generated[2:]])
    _, later = send(server, "reply", msgs(("user", TASK), ("assistant", changed), ("user", "more")))
    cases["reply"] = (later["drift"].get("cause", ""), "reply re-rendered")
    assert later["drift"].get("segment") == "reply"

    for name, (found, expected) in cases.items():
        assert found is not None and found.startswith(expected), f"{name}: {found!r}, expected {expected!r}"
    for name in cases:
        status, body = server.admin("GET", "/requests?limit=5000")
        for record in body["requests"]:
            for value in (record.get("drift") or {}).values():
                assert not any(ord(c) < 32 for c in str(value)), f"{name}: control character in {value!r}"

    status, exposition = server.admin("GET", "/metrics")
    assert status == 200, exposition
    shown = apcctl(server, "requests", str(date_seq))
    assert shown.exit_code == 0, shown.output
    assert "drift: date/time changed in system at token" in shown.output
    table = apcctl(server, "requests", "-n", "50")
    assert table.exit_code == 0 and "DRIFT" in table.output and "retry @" in table.output, table.output
    assert apcctl(server, "requests", "99999").exit_code == ExitStatus.NOT_FOUND
    counts = {s.labels["cause"]: s.value for family in text_string_to_metric_families(exposition)
              for s in family.samples if s.name == "apc_client_drift_total"}
    assert counts["date/time changed"] >= 1 and counts["reply dropped on retry"] >= 1
    assert counts["history rebuilt on resume"] >= 1 and counts["system prompt edited"] >= 1


def test_text_off_keeps_cause_and_position(tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, log_dir=tmp_path, env={"APC_DRIFT_TEXT": "0"}) as quiet:
        send(quiet, "t", msgs(("user", TASK), system=SYSTEM + " Today is 2026-12-05."))
        _, later = send(quiet, "t", msgs(("user", TASK), ("assistant", "ok"), ("user", "x"),
                                        system=SYSTEM + " Today is 2026-12-06."))
    assert later["drift"]["cause"] == "date/time changed" and later["drift"]["position"] > 0
    assert not {"removed", "added", "context"} & set(later["drift"])
