"""Faults injected into rolling restarts of a real managed server on the tiny model.

One server started with ``apcctl serve`` (anchor cap 2, so the probe fits next to one operator
anchor and not next to two) goes through, in order: a restart under streaming load, a stop that
fails, a restart whose new command exits at once and one whose new command never answers (both
rolled back), and a restart with the anchor cap full (not probed). After each, the server must
answer, undrained, with no probe anchor left and every operator anchor restoring. The refusals
that need no server (a remote URL, a reused PID) are checked against real processes too.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

from apcctl.config import ServerConfig, Target, select
from apcctl.core.client import AdminClient
from apcctl.core.hosts import free_port as unused_port, is_local_url
from apcctl.core.manage import (PID_FILE, SHUTDOWN_FLUSH_S, ManagedServer, ServerSpec, build_spec, default_grace,
                                shutdown_flush_s)
from apcctl.core.restart import (ROLLBACK_READY_S, RestartResult, RestartStep, _OneServer, _reported_matches, _run,
                                 anchor_cap_full, rolling_restart)
from tests.cli.test_cli_server import run_json

NAME = "fault"
STREAMS = 3
# Long enough to be in flight through the probe's prefill and into the drain: the restart's first
# status poll came at about a quarter of 300 tokens' decode on a loaded box (load 9).
STREAM_TOKENS = 200
RETRY_AFTER = 4
# The wait for a new process that never answers; the rollback's start gets at least the default
# wait (``ROLLBACK_READY_S``), however short this is.
NEVER_READY_TIMEOUT_S = 8
PROBE_MARK = "[apcctl restart probe"
_checks = itertools.count()


# ------------------------------------------------------------------ the server


@dataclass
class Server:
    name: str
    url: str
    client: AdminClient
    model: str
    eos: list[int]
    files: Path
    anchors: dict[str, str] = field(default_factory=dict)  # system prompt -> operator anchor id

    @property
    def port(self) -> int:
        return int(urllib.parse.urlsplit(self.url).port or 0)

    def chat(self, system: str, user: str) -> dict[str, Any]:
        """A chat that must succeed; returns its timing record."""
        seen = max((r["seq"] for r in self.client.requests()), default=0)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        self.client.chat(messages, model=self.model, max_tokens=2, temperature=0.0, timeout=120)
        return self.client.requests(since=seen)[-1]

    def anchor(self, system: str) -> str:
        """An operator anchor made with ``apcctl anchors new``."""
        path = self.files / f"anchor-{len(self.anchors)}.txt"
        path.write_text(system)
        self.anchors[system] = run_json("anchors", "new", "--server", self.name, "--system-file",
                                        str(path))["anchor"]["id"]
        return self.anchors[system]


@pytest.fixture(scope="module")
def server(cli_env: Path, tiny_model_dir: Path) -> Server:
    info = run_json("serve", "--name", NAME, "--model", str(tiny_model_dir), "--port", str(unused_port()),
                    "-e", "APC_LINEAGE_ANCHOR_MAX_ENTRIES=2")
    token = (Path(info["state_dir"]) / "admin-token").read_text().strip()
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    found = Server(NAME, info["url"], AdminClient(info["url"], token), str(tiny_model_dir),
                   eos if isinstance(eos, list) else [eos], cli_env)
    found.anchor("You are the fault injection assistant. Always cite the file and the line. " * 3)
    return found


def assert_as_before(server: Server, result: RestartResult) -> None:
    """Serving, undrained, no probe anchor left, every operator anchor still listed."""
    assert server.client.status()["idle"]["draining"] is False
    assert send_chat(server)[0] == 200  # also starts the cache of a server that has not served yet
    listed = server.client.anchors()
    assert not [a for a in listed if PROBE_MARK in (a.get("label") or "")]
    probe_id = result.servers[0].probe.get("anchor_id") or (result.servers[0].rollback.get("probe") or {}).get(
        "anchor_id")
    assert probe_id is None or probe_id not in {a["id"] for a in listed}
    assert set(server.anchors.values()) <= {a["id"] for a in listed if a["pinned"]}
    for system, anchor in server.anchors.items():
        # A new question each time: a resend would restore the conversation that asked it before.
        record = server.chat(system, f"{next(_checks)}? Still there?")
        assert record["entry_id"] == anchor and record["restore_kind"] in ("anchor", "disk")


def restart(server: Server, *, target: Target | None = None, on_progress: Callable[[RestartStep], None] | None = None,
            timeout: float = 300, **kwargs: Any) -> tuple[RestartResult, list[RestartStep]]:
    """``rolling_restart`` of the one server (or ``target``); returns the result and every step."""
    steps: list[RestartStep] = []

    def record(step: RestartStep) -> None:
        steps.append(step)
        if on_progress is not None:
            on_progress(step)

    result = rolling_restart([target or select(server.name)[0]], on_progress=record, timeout=timeout,
                             retry_after=RETRY_AFTER, **kwargs)
    return result, steps


# ------------------------------------------------------------------ raw HTTP, so a reset shows as one


@dataclass
class Stream:
    """One streaming chat read to its end; ``error`` is what broke it, if anything did."""

    server: Server
    index: int
    lines: list[str] = field(default_factory=list)
    error: str = ""
    finished_at: float = 0.0

    def run(self) -> None:
        body = {"model": self.server.model, "stream": True, "max_tokens": STREAM_TOKENS, "temperature": 0.0,
                "messages": [{"role": "user", "content": f"Tell me long story number {self.index}."}],
                "logit_bias": {str(t): -100 for t in self.server.eos}}  # exactly max_tokens tokens
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=600)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                self.error = f"HTTP {response.status}"
                return
            for raw in response:
                line = raw.decode(errors="replace").strip()
                if line.startswith("data:"):
                    self.lines.append(line[5:].strip())
        except (OSError, http.client.HTTPException) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
            self.finished_at = time.monotonic()

    @property
    def finish_reason(self) -> str | None:
        chunks = [json.loads(line) for line in self.lines if line != "[DONE]"]
        return next((c["choices"][0]["finish_reason"] for c in reversed(chunks)
                     if c.get("choices") and c["choices"][0].get("finish_reason")), None)


def send_chat(server: Server) -> tuple[int, dict[str, str], Any]:
    """(status, headers, body) of one chat; a reset connection raises."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        body = {"model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hello?"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())
    finally:
        conn.close()


# ------------------------------------------------------------------ the faults, in order


@pytest.mark.server
def test_a_restart_under_load_finishes_every_stream_and_turns_new_requests_away_with_503(server: Server) -> None:
    old_pid = server.client.status()["server"]["pid"]
    streams = [Stream(server, i) for i in range(STREAMS)]
    threads = [threading.Thread(target=s.run) for s in streams]
    for thread in threads:
        thread.start()
    while server.client.status()["idle"]["in_flight"] < STREAMS:
        assert all(t.is_alive() for t in threads), [s.error for s in streams]
        time.sleep(0.01)
    turned_away: list[tuple[int, dict[str, str], Any]] = []
    resets: list[str] = []
    stopping_at: list[float] = []

    def during_the_drain(step: RestartStep) -> None:
        # Called by the restart itself, so the server is certainly up and draining here.
        if step.phase in ("waiting", "flushing") and len(turned_away) < 6:
            try:
                turned_away.append(send_chat(server))
            except (OSError, http.client.HTTPException) as exc:
                resets.append(f"{type(exc).__name__}: {exc}")
        if step.phase == "stopping":
            stopping_at.append(time.monotonic())

    result, steps = restart(server, on_progress=during_the_drain)
    for thread in threads:
        thread.join()
    assert result.ok, result.servers[0].message
    # Every stream in flight when the restart began ran to its end before the stop.
    waiting = [s for s in steps if s.phase == "waiting"]
    assert waiting[0].in_flight == STREAMS and waiting[-1].in_flight == 0
    for stream in streams:
        assert stream.error == "" and stream.lines[-1] == "[DONE]" and stream.finish_reason == "length"
        assert stream.finished_at < stopping_at[0]
    # Requests sent during the drain were answered, never reset: 503, Retry-After, a JSON reason.
    assert resets == [] and turned_away
    for status, headers, body in turned_away:
        assert status == 503 and headers["retry-after"] == str(RETRY_AFTER)
        assert body["error"]["type"] == "server_draining"
    done = result.servers[0]
    assert done.new_pid == server.client.status()["server"]["pid"] != old_pid
    assert done.probe["restored_tokens"] > 0 and not done.rolled_back
    assert_as_before(server, result)


@pytest.mark.server
def test_a_stop_that_fails_leaves_the_old_server_serving_undrained(server: Server) -> None:
    old_pid = server.client.status()["server"]["pid"]
    managed = select(server.name)[0]
    supervised = replace(managed, settings=ServerConfig(server.name, url=server.url, supervisor="systemd",
                                                        service="apc-fault-test.service"))
    commands: list[list[str]] = []

    def failing_supervisor(argv: list[str]) -> None:
        commands.append(argv)
        _run([sys.executable, "-c", "import sys; sys.exit('Unit apc-fault-test.service not found.')"])

    result, steps = restart(server, target=supervised, run_command=failing_supervisor)
    failed = result.servers[0]
    assert not result.ok and commands and commands[0][0] == "systemctl"
    assert failed.message.startswith("stopping:") and "not found" in failed.message
    assert "drain lifted" in failed.message and not failed.rolled_back
    assert [s.phase for s in steps][-1] == "failed" and "stopping" in [s.phase for s in steps]
    assert server.client.status()["server"]["pid"] == old_pid
    assert_as_before(server, result)


@pytest.mark.server
def test_a_new_command_that_exits_at_once_is_rolled_back_to_the_previous_one(server: Server) -> None:
    managed = ManagedServer(server.name)
    previous = managed.spec()
    assert previous is not None
    old_pid = server.client.status()["server"]["pid"]
    broken = replace(previous, argv=[*previous.argv, "--no-such-option"])
    managed.save(broken)  # what an operator's edit of server.json would do

    result, steps = restart(server)
    failed = result.servers[0]
    phases = [s.phase for s in steps]
    assert not result.ok and phases[-1] == "failed"
    assert phases.index("starting") < phases.index("rollback") < phases.index("failed")
    assert failed.message.startswith("starting:") and "exited while starting" in failed.message
    assert "--no-such-option" in failed.log_tail and "\n" not in failed.message  # one line; the tail says why
    assert "rolled back" in failed.message and "restored" in failed.message
    assert failed.rolled_back and failed.rollback["ready"] is True
    assert failed.rollback["probe"]["restored_tokens"] > 0 and failed.rollback["probe"]["missing_anchors"] == []
    # The previous command serves again, as a new process; server.json names it again.
    pid = server.client.status()["server"]["pid"]
    assert pid == failed.rollback["pid"] == managed.pid() != old_pid
    assert managed.spec().argv == previous.argv and "--no-such-option" not in managed.spec().argv
    kept = json.loads((managed.directory / "server.failed.json").read_text())
    assert kept["argv"] == broken.argv
    assert_as_before(server, result)


@pytest.mark.server
def test_a_new_command_that_never_becomes_ready_is_stopped_and_rolled_back(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    managed = ManagedServer(server.name)
    previous = managed.spec()
    assert previous is not None
    marker = f"apc-never-ready-{time.monotonic_ns()}"
    # A process that runs but never listens, like a model load that hangs.
    managed.save(replace(previous, argv=[sys.executable, "-c", f"import time; time.sleep(600)  # {marker}"]))
    waits: list[float | None] = []  # the bound of each wait for readiness, in order
    real_wait = _OneServer._wait_ready

    def wait_ready(roll: _OneServer, timeout: float | None = None) -> int:
        waits.append(timeout)
        return real_wait(roll, timeout)

    monkeypatch.setattr(_OneServer, "_wait_ready", wait_ready)

    result, steps = restart(server, timeout=NEVER_READY_TIMEOUT_S)
    # The new command got --timeout; the previous one's start at least the default wait, so a
    # short --timeout never leaves the server down behind a slower known-good start.
    assert waits == [None, ROLLBACK_READY_S]
    failed = result.servers[0]
    assert not result.ok and failed.message.startswith("starting:") and "not ready within" in failed.message
    assert failed.rolled_back and failed.rollback["ready"] is True and "rolled back" in failed.message
    assert "rollback" in [s.phase for s in steps]
    hung = [p for p in psutil.process_iter(["cmdline", "status"]) if marker in " ".join(p.info["cmdline"] or [])
            and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert hung == []  # the process that never became ready was stopped before the rollback
    assert server.client.status()["server"]["pid"] == failed.rollback["pid"] == managed.pid()
    assert managed.spec().argv == previous.argv
    assert_as_before(server, result)


@pytest.mark.server
def test_a_full_anchor_cap_skips_the_probe_and_keeps_the_operators_anchors(server: Server) -> None:
    server.anchor("You are the second operator anchor. Answer in one short sentence, then stop. " * 3)
    for system in server.anchors:
        server.chat(system, "load it into RAM")  # both operator anchors in RAM: the cap (2) is full
    budgets = server.client.status()["lineage"]["budgets"]
    assert budgets["anchor_count"] == budgets["anchor_count_limit"] == 2
    pinned = {a["id"] for a in server.client.anchors() if a["pinned"]}

    result, steps = restart(server)
    done = result.servers[0]
    assert result.ok, done.message
    assert done.probe == {} and "probing" not in [s.phase for s in steps]
    assert any("anchor cap is full (2 of 2 anchors)" in w and "not probed" in w for w in done.warnings)
    assert_as_before(server, result)
    assert pinned <= {a["id"] for a in server.client.anchors() if a["pinned"]}


# ------------------------------------------------------------------ refusals, no server needed


class Untouchable(Target):
    """A target whose admin client must never be built: the refusal comes first."""

    def client(self, timeout: float = 10.0) -> AdminClient:
        raise AssertionError("the restart talked to a server it should have refused")


@pytest.mark.parametrize("supervisor,service", [("none", None), ("systemd", "apc.service"), ("launchd", "com.apc")])
@pytest.mark.parametrize("url", ["http://192.0.2.10:8080", "http://gpu-box.example:8080"])
def test_a_server_on_another_machine_is_refused_before_anything_is_touched(
        url: str, supervisor: str, service: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APC_STATE_DIR", str(tmp_path))
    managed = ManagedServer("remote")
    managed.save(replace(_spec(managed), host=urllib.parse.urlsplit(url).hostname or ""))
    target = Untouchable("remote", url, None, ServerConfig("remote", url=url, supervisor=supervisor,
                                                             service=service), managed)
    commands: list[list[str]] = []
    steps: list[RestartStep] = []
    result = rolling_restart([target], on_progress=steps.append, run_command=commands.append)
    assert not result.ok and [s.phase for s in steps] == ["failed"] and commands == []
    assert "is not on this machine" in result.servers[0].message
    assert ("systemctl" if supervisor == "systemd" else "launchctl" if supervisor == "launchd" else "signals") \
        in result.servers[0].message


def test_local_urls() -> None:
    for url in ("http://127.0.0.1:8080", "http://localhost:1", "http://[::1]:8080", "http://0.0.0.0:80",
                "http://127.3.4.5:9"):
        assert is_local_url(url), url
    own = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
    assert own is None or is_local_url(f"http://{own}:8080")  # this machine's own address, if it has one
    for url in ("http://192.0.2.10:8080", "http://example.com:8080", "http://localhost.example.com:1", "x"):
        assert not is_local_url(url), url


@pytest.fixture
def sleeper() -> Any:
    """A real process that is not a server: what a reused PID points at."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield psutil.Process(process.pid)
    finally:
        process.kill()
        process.wait()


def test_a_reused_pid_is_not_taken_for_the_server(sleeper: psutil.Process, tmp_path: Path) -> None:
    managed = ManagedServer("reused", root=tmp_path)
    managed.directory.mkdir()
    created = sleeper.create_time()
    (managed.directory / PID_FILE).write_text(f"{sleeper.pid}\n{created - 3600!r}\n")  # same PID, other process
    assert managed.process() is None and managed.pid() is None
    assert managed.stop(grace=1).how == "not running" and sleeper.is_running()  # never signalled
    (managed.directory / PID_FILE).write_text(f"{sleeper.pid}\n")  # an old PID file: no create time
    assert managed.process() is None  # not the launcher: not the server either
    (managed.directory / PID_FILE).write_text(f"{sleeper.pid}\n{created!r}\n")
    assert managed.process() == sleeper  # PID and create time both match: this is the process
    # The PID an older server reports in /admin/status is checked the same way.
    assert not _reported_matches(sleeper, {"pid": sleeper.pid, "create_time": created - 3600})
    assert _reported_matches(sleeper, {"pid": sleeper.pid, "create_time": created})
    assert not _reported_matches(sleeper, {"pid": sleeper.pid, "started": time.time()})  # no create time: launcher?


def test_the_default_grace_covers_the_servers_shutdown_flush() -> None:
    from server_patch.lineage import LineageConfig

    assert shutdown_flush_s() == SHUTDOWN_FLUSH_S == LineageConfig().shutdown_flush_s
    assert default_grace({}) > shutdown_flush_s()
    configured = {"APC_LINEAGE_SHUTDOWN_FLUSH_S": "240"}  # the server's own setting, read the same way
    assert shutdown_flush_s(configured) == 240 and default_grace(configured) > 240


def test_the_probe_is_skipped_when_one_more_anchor_would_not_fit() -> None:
    def entries() -> list[dict[str, Any]]:
        return [{"tier": "ram", "length": 1000, "bytes": 1_000_000}, {"tier": "disk", "length": 10, "bytes": 0}]

    room = {"anchor_count": 1, "anchor_count_limit": 2, "anchor_bytes": 1_000_000, "anchor_bytes_limit": 10 ** 9}
    assert anchor_cap_full(room, entries, "short") == ""
    assert "2 of 2 anchors" in anchor_cap_full({**room, "anchor_count": 2}, entries, "short")
    # The probe is at most as big as an entry at least as long as it.
    assert "byte cap" in anchor_cap_full({**room, "anchor_bytes_limit": 1_500_000}, entries, "short")
    assert anchor_cap_full({}, entries, "short") == ""  # an older server without budgets


def _spec(managed: ManagedServer) -> ServerSpec:
    return build_spec(managed.name, model="/nonexistent", port=8080, directory=managed.directory)
