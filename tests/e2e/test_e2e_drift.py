"""End to end, real HTTP on the tiny model: the server names what the client changed (issue 37).

Each case of the drift actor (``apcctl.lab.sim.drift_actor``) is one tenant (drift is found only
within a namespace) sending a turn, then a prompt changed the way a real client changes it; the
second request's record in ``/admin/requests``
must name the cause and the segment (a message's number and role exactly), carry a decoded diff without control characters, and the
Prometheus counter must count it. ``APC_DRIFT_TEXT=0`` keeps the cause without the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from apcctl.cli import main
from apcctl.lab.sim import drift_actor
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


def send(server: PatchedServer, tenant: str, messages: list[dict[str, Any]],
         tools: list[dict[str, Any]] | None = None) -> tuple[dict, dict]:
    answer = server.chat(messages, tenant=tenant, **PARAMS, **({"tools": tools} if tools else {}))
    return answer, record_of(server, answer)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("drift")) as running:
        yield running


def test_each_cause_named_from_admin_requests(server: PatchedServer) -> None:
    """The drift actor's cases (``apcctl.lab.sim.drift_actor``), each in its own namespace."""
    cases: dict[str, tuple[str, str]] = {}
    drifts: dict[str, dict[str, Any]] = {}
    for case in drift_actor.cases():
        answer, first = send(server, case.name, case.first, tools=case.tools)
        assert first["drift"] == {}, (case.name, first["drift"])
        changed, later = send(server, case.name, case.then(reply_text(answer)), tools=case.then_tools or case.tools)
        assert "drift" not in json.dumps(changed)  # /admin only, never in the client's response
        drifts[case.name] = later["drift"]
        cases[case.name] = (later["drift"].get("cause", ""), case.cause)
        assert later["drift"].get("segment") == case.segment, (case.name, later["drift"])  # its number and role
    date = drifts["date"]
    assert "5" in date["removed"] and "6" in date["added"]
    assert "current date" in drifts["resume"]["removed"].replace(" ", " ")
    date_seq = max(r["seq"] for r in server.admin("GET", "/requests?limit=5000")[1]["requests"]
                   if r["drift"].get("cause") == "date/time changed")

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
    journal = Path(server.env["APC_STATE_DIR"]) / "journal"
    lines = [json.loads(line) for line in (journal / "journal.jsonl").read_text().splitlines()]
    journaled = {line["seq"]: line for line in lines if line["type"] == "request"}
    assert journaled[date_seq]["drift"]["cause"] == "date/time changed"
    made = CliRunner().invoke(main, ["report", "--journal", str(journal), "--json"])
    assert made.exit_code == 0, made.output
    top = {c["cause"]: c for c in json.loads(made.stdout)["drift"]["top_causes"]}
    assert top and all(c["requests"] >= 1 for c in top.values())
    worded = CliRunner().invoke(main, ["report", "--journal", str(journal)])
    assert "client drift:" in worded.output and "requests (" in worded.output
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
