"""End to end: a real coding-agent CLI from the npm registry, two turns against the real server.

Every other client in the suite was written here (or is the openai library), and a 500 on every
request of a popular agent went unseen (issue 34: qwen-code's JSON-Schema union types in its tool
parameters). This test runs qwen-code itself, at the version pinned in ``tests/e2e/agents/package.json``
(installed by ``tests/e2e/agents/install``, which ``.ci/run`` calls; the test runs it too when the
CLI is missing), headless (``qwen -o json PROMPT``) against the patched server on the tiny model,
once over Chat Completions and once over the Responses API (``--auth-type openai-responses``), both
against one server (the routes differ in the agent's configuration, not the server's):

* turn 1 starts a session with a fixed id, turn 2 resumes it (``--resume``), so turn 2 re-sends
  turn 1's system prompt, tools and history, as an agent does every turn;
* the tiny random model answers gibberish, so the agent does no real work; what is asserted is what
  a real agent needs from the server: both turns end without an API error, every request the agent
  sent got a 200 and a request record, nothing in the server log is a 5xx or a traceback, and
  turn 2's request restored turn 1's prefix from the lineage cache (not cold) and the agent saw the
  restored tokens as its cached tokens.

The agent is hermetic: HOME, the XDG dirs and TMPDIR are under ``tmp_path`` (its settings file
there turns off usage statistics, telemetry, auto-update and the memory side agent), and its
environment holds nothing from the developer's shell but ``PATH``. It skips only where Node.js
(>= 20) or npm is absent (``agents/install --check``), the one thing the suite cannot install.

What the agent sends is trimmed with qwen-code's own options, not edited on the wire. Untrimmed,
its first request is ~56k characters (an 18k-character system prompt, a 10k-character first user
message that lists its bundled skills and deferred tools, and 27k characters of 10 tool schemas:
~36k tokens), and each route's first turn prefilled all of it cold on the CPU (untrimmed, the
routes' renderings share no restorable prefix): most of this file's ~200 s. ``--system-prompt`` replaces the built-in main prompt with one line (the agent still appends its context files), ``tools.core``
keeps two core tools, ``read_file`` (the tool whose ``"type": [...]`` union parameters broke intake
in issue 34) and ``glob``, and ``tools.disabled``, the tool-search bridge off and the skill levels
off remove the other tools and the skills and deferred-tools reminders: ~6k characters a request
(see ``SETTINGS``). This keeps the test honest: the compatibility surface it proves is the
protocol (both routes, the agent's own request shapes, streaming and usage), the tool schemas
as the agent renders them (union types asserted below) and resume (turn 2 re-sends turn 1 and
restores its prefix), none of which depends on the prompt's length; the prompt's content was the
tiny model's to ignore. In the server's ``prompt_tokens``, turn 1 is now 3,873 tokens over Chat
Completions and 3,879 over Responses (it was 36,241 and 36,604, both cold); turn 2 restores
3,271 of 3,907 and 3,693 of 3,913 (it restored 34,816 of 36,275 and 36,418 of 36,638).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.server_harness import PatchedServer

AGENTS = Path(__file__).resolve().parent / "agents"
QWEN = AGENTS / "node_modules" / ".bin" / "qwen"
INSTALL = AGENTS / "install"
AGENT_TIMEOUT_S = 600  # bounds a hung agent only: a cold prefill is slow on a busy CPU
# What qwen-code would otherwise do at start or after a turn: phone home, update itself, and run a
# second "memory" agent over the conversation. Short greedy replies: the tiny model's are gibberish.
# (A 5xx is retried a few times, about 80 s, then fails the turn: "[API Error: 500 ...]".)
SETTINGS = {
    "memory": {"enableManagedAutoMemory": False},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"disableAutoUpdate": True, "enableAutoUpdate": False},
    "telemetry": {"enabled": False},
    "model": {"generationConfig": {"samplingParams": {"temperature": 0, "max_tokens": 8}}},
    # The trim (module docstring): two real core tools, read_file with its union types kept; the
    # other built-ins, the tool-search bridge (whose deferred tools would otherwise turn eager) and
    # every skill level off, so neither the skills nor the deferred-tools reminder is sent.
    "tools": {"core": ["read_file", "glob"], "toolSearch": {"enabled": False},
              "disabled": ["agent", "list_agents", "skill", "get_goal", "update_goal", "enter_worktree",
                           "exit_worktree", "record_artifact", "report_findings", "send_message", "task_stop"]},
    "skills": {"disabledLevels": ["bundled", "user", "project", "extension"]},
    "goals": {"modelProposed": "disabled"},
}
# Replaces the built-in ~18k-character main system prompt (qwen-code's ``--system-prompt``).
SYSTEM_PROMPT = "You are a coding agent working in this project. Answer briefly."
PROMPTS = ("List the files in this project and say what the project is.",
           "Now explain the first file in one sentence.")
ACCESS_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')
# pytest-timeout counts the module fixture: a server start and two agent turns on a busy machine.
pytestmark = [pytest.mark.server, pytest.mark.timeout(2 * AGENT_TIMEOUT_S + 300)]


def run_install(*args: str) -> None:
    """``agents/install ARGS``: skips the test where it finds no runtime (its exit 3: no Node.js
    >= 20 or no npm), fails it where anything else goes wrong."""
    done = subprocess.run([str(INSTALL), *args], capture_output=True, text=True, timeout=600)
    if done.returncode == 3:
        pytest.skip(f"{done.stderr.strip()}: install them, then run {INSTALL}")
    assert done.returncode == 0, f"{INSTALL} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def qwen_cli() -> Path:
    """The pinned qwen-code CLI, installed by ``agents/install`` if it is not there yet."""
    run_install("--check")
    if not QWEN.exists():
        run_install()
    return QWEN


@dataclass
class Turn:
    """One ``qwen`` run: its exit code, its JSON event list and its stderr."""

    returncode: int
    events: list[dict[str, Any]]
    stderr: str

    @property
    def result(self) -> dict[str, Any]:
        results = [e for e in self.events if e.get("type") == "result"]
        assert len(results) == 1, self.describe()
        return results[0]

    @property
    def last_usage(self) -> dict[str, Any]:
        """The usage of the turn's last assistant message (its last model call)."""
        replies = [e for e in self.events if e.get("type") == "assistant"]
        assert replies, self.describe()
        return replies[-1]["message"]["usage"]

    def describe(self) -> str:
        return f"exit {self.returncode}; events {json.dumps(self.events)[-3000:]}\nstderr {self.stderr[-3000:]}"


class QwenCode:
    """qwen-code in a private home, pointed at ``server``; ``turn`` runs one headless prompt."""

    def __init__(self, cli: Path, server: PatchedServer, root: Path, auth_type: str) -> None:
        self.cli, self.auth_type = cli, auth_type
        self.project, self.logs = root / "project", root / "openai-logs"
        home = root / "home"
        for path in (self.project, self.logs, home / ".qwen"):
            path.mkdir(parents=True)
        (self.project / "README.md").write_text("A tiny project the agent is asked about.\n")
        (home / ".qwen" / "settings.json").write_text(json.dumps(SETTINGS))
        self.env = {
            "PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(root),
            **{f"XDG_{kind}_HOME": str(root / f"xdg-{kind.lower()}") for kind in
               ("CONFIG", "CACHE", "DATA", "STATE")},
            "LANG": "C.UTF-8", "NO_COLOR": "1",
            "OPENAI_BASE_URL": server.base_url + "/v1", "OPENAI_API_KEY": "sk-unused",
            "OPENAI_MODEL": str(server.model_dir),
        }
        self.session = str(uuid.uuid4())

    def turn(self, prompt: str, *, first: bool) -> Turn:
        session = ["--session-id", self.session] if first else ["--resume", self.session]
        command = [str(self.cli), "--auth-type", self.auth_type, "-o", "json", *session,
                   "--system-prompt", SYSTEM_PROMPT,
                   "--openai-logging", "--openai-logging-dir", str(self.logs), prompt]
        process = subprocess.Popen(command, cwd=self.project, env=self.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=AGENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the agent and its children
            stdout, stderr = process.communicate()
            raise AssertionError(f"qwen did not finish within {AGENT_TIMEOUT_S} s:\n{stderr[-3000:]}")
        try:
            events = json.loads(stdout)
        except ValueError:
            events = [{"type": "unparsed stdout", "text": stdout[-3000:]}]
        return Turn(process.returncode, events if isinstance(events, list) else [events], stderr)

    def sent(self) -> list[dict[str, Any]]:
        """The request bodies the agent logged (``--openai-logging``), oldest first."""
        return [json.loads(path.read_text())["request"] for path in sorted(self.logs.glob("*.json"))]


@dataclass
class Session:
    """What a two-turn agent session left: its turns, the server's records, its log."""

    turns: list[Turn]
    records_per_turn: list[list[dict[str, Any]]]
    log: str
    sent: list[dict[str, Any]]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedServer]:
    """One server for both routes: they differ in the agent's configuration, not the server's."""
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("qwen-server")) as running:
        yield running


@pytest.fixture(scope="module", params=["openai", "openai-responses"])
def session(request: pytest.FixtureRequest, qwen_cli: Path, server: PatchedServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """Two turns of the agent over one route, and what the server logged and recorded for them
    only (the other route's session may have run on the same server before)."""
    root = tmp_path_factory.mktemp(f"qwen-{request.param}")
    log_start = len(server.log_text())
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    seen = max([0] + [r["seq"] for r in body["requests"]])
    agent = QwenCode(qwen_cli, server, root, request.param)
    turns, records = [], []
    for k, prompt in enumerate(PROMPTS):
        turns.append(agent.turn(prompt, first=k == 0))
        status, body = server.admin("GET", f"/requests?since={seen}")
        assert status == 200, body
        records.append(body["requests"])
        seen = max([seen] + [r["seq"] for r in body["requests"]])
    yield Session(turns, records, server.log_text()[log_start:], agent.sent())


def model_calls(log: str) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request to the model routes in the server's access log."""
    return [(m["method"], m["path"], int(m["status"])) for m in ACCESS_LINE.finditer(log)
            if m["path"].startswith("/v1/")]


def test_both_turns_end_without_an_api_error(session: Session) -> None:
    for turn in session.turns:
        assert turn.returncode == 0, turn.describe()
        assert turn.result.get("is_error") is False, turn.describe()
        assert "API Error" not in json.dumps(turn.events), turn.describe()


def test_every_request_the_agent_sent_got_a_200_and_a_record(session: Session) -> None:
    calls = model_calls(session.log)
    records = [r for turn in session.records_per_turn for r in turn]
    assert len(calls) >= 2 and len(session.sent) == len(calls) == len(records), (calls, len(session.sent))
    assert all(status == 200 for _, _, status in calls), calls
    assert all(turn for turn in session.records_per_turn), session.records_per_turn  # each turn called the model


def test_the_server_log_has_no_5xx_and_no_traceback(session: Session) -> None:
    statuses = [int(m["status"]) for m in ACCESS_LINE.finditer(session.log)]
    assert statuses and max(statuses) < 500, statuses
    assert "Traceback" not in session.log


def test_the_agent_sent_tool_schemas_with_union_types(session: Session) -> None:
    """The bodies that broke intake (issue 34 item 1) are what this session sent: the test would
    have caught it."""
    assert any(re.search(r'"type": \[', json.dumps(body.get("tools"))) for body in session.sent)


def test_the_second_turn_restores_the_first_turns_prefix(session: Session) -> None:
    """Turn 2 re-sends turn 1's system prompt, tools and history (less a date reminder qwen-code
    drops from the replayed first message, near its end): its model call restores from the
    lineage cache, and the agent sees those tokens as cached."""
    first, second = session.records_per_turn
    assert first and second, session.records_per_turn
    last = second[-1]
    assert last["restore_kind"] != "cold" and last["restored_tokens"] > 0, last
    # Past whatever turn 1 itself restored (a prefix the other route's session may have left on
    # the shared server): what turn 2 restored is turn 1's own prompt.
    assert last["restored_tokens"] > max(r["restored_tokens"] for r in first), (first, last)
    usage = session.turns[1].last_usage
    assert usage.get("cache_read_input_tokens") == last["restored_tokens"], (usage, last)
