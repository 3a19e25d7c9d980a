"""The CLI against servers it should not trust (issue 34, items 7, 11, 12, 13).

A real HTTP listener in a thread (``http.server``) plays the server: it records the
``Authorization`` header of every request and answers what the test scripts (a 401, malformed
or 200k-deep JSON, a body past the client's cap, escape sequences in an error). The real CLI
talks to it through click's ``CliRunner``; a config that would hang runs in a subprocess with a
deadline, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from click.testing import CliRunner, Result

from apcctl.cli import main
from apcctl.commands.common import ExitStatus
from apcctl.core import client as admin_client
from apcctl.core.manage import ManagedServer, build_spec
from tests.conftest import isolate_cli

ESCAPES = "\x1b]0;owned title\x07\x1b[2J\x9b31m\x1bP+q\x1b\\"


@dataclass
class Listener:
    """What the fake server answers (``answers[path] = (status, content type, body)``; else 401)
    and the ``Authorization`` header of each request it got (None when there was none)."""

    url: str = ""
    answers: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    def authorizations(self) -> list[str | None]:
        return [auth for _, auth in self.seen]


@pytest.fixture()
def listener() -> Iterator[Listener]:
    state = Listener()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            path = self.path.split("?", 1)[0]
            state.seen.append((path, self.headers.get("Authorization")))
            status, content_type, body = state.answers.get(
                path, (401, "application/json", b'{"detail": "missing or wrong admin token"}'))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture()
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_cli(monkeypatch, tmp_path)


def apcctl(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"apcctl {' '.join(args)} raised {result.exception!r}\n{result.output}")
    assert "Traceback" not in result.output
    return result


def managed_at(name: str, url: str, token: str) -> ManagedServer:
    """A server record as ``apcctl serve`` leaves it (nothing runs): ``url``'s port, its token."""
    port = int(url.rsplit(":", 1)[1])
    server = ManagedServer(name)
    server.save(build_spec(name, model="/nowhere", port=port, env={"APC_ADMIN_TOKEN": token}))
    return server


# ------------------------------------------------------------------ 34.7: whose token goes where


def test_a_discovered_token_is_not_sent_to_a_url_no_managed_server_owns(
        isolated: Path, listener: Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APC_ADMIN_TOKEN", "env-secret")
    (isolated / "state").mkdir(exist_ok=True)
    (isolated / "state" / "admin-token").write_text("file-secret")
    result = apcctl("status", "--server", listener.url)
    assert result.exit_code == ExitStatus.AUTH
    assert listener.authorizations() and set(listener.authorizations()) == {None}
    assert "no admin token was sent" in result.output and "--token" in result.output

    config = isolated / "apcctl.toml"
    config.write_text(f'[servers.remote]\nurl = "{listener.url}"\n')
    listener.seen.clear()
    assert apcctl("status", "--config", str(config)).exit_code == ExitStatus.AUTH
    assert listener.authorizations() and set(listener.authorizations()) == {None}


def test_a_token_given_or_configured_is_sent(isolated: Path, listener: Listener) -> None:
    apcctl("status", "--server", listener.url, "--token", "given")
    token_file = isolated / "remote.token"
    token_file.write_text("from-file\n")
    config = isolated / "apcctl.toml"
    config.write_text(f'[servers.remote]\nurl = "{listener.url}"\ntoken_file = "{token_file}"\n')
    apcctl("status", "--config", str(config))
    assert listener.authorizations() == ["Bearer given", "Bearer from-file"]


def test_a_managed_servers_token_goes_to_its_own_address_only(isolated: Path, listener: Listener,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APC_ADMIN_TOKEN", "env-secret")
    managed_at("mine", listener.url, "managed-secret")
    apcctl("status", "--server", "mine")
    apcctl("status", "--server", listener.url)  # the URL of a managed server finds it
    assert listener.authorizations() == ["Bearer managed-secret", "Bearer managed-secret"]

    # A config entry of another name at the managed server's address: that server's token.
    config = isolated / "other.toml"
    config.write_text(f'[servers.alias]\nurl = "{listener.url}/"\n')
    listener.seen.clear()
    apcctl("status", "--server", "alias", "--config", str(config))
    assert listener.authorizations() == ["Bearer managed-secret"]

    # The same name, pointed elsewhere by the config: its token stays home.
    ManagedServer("mine").forget()  # (now no managed server listens at the listener's address)
    elsewhere = isolated / "apcctl.toml"
    managed_at("moved", "http://127.0.0.1:9", "moved-secret")
    elsewhere.write_text(f'[servers.moved]\nurl = "{listener.url}"\n')
    listener.seen.clear()
    assert apcctl("status", "--server", "moved", "--config", str(elsewhere)).exit_code == ExitStatus.AUTH
    assert listener.authorizations() and set(listener.authorizations()) == {None}


# ------------------------------------------------------------------ 34.12: hostile answers


@pytest.mark.parametrize("body", [
    b'{"hits": ',  # malformed
    b"[" * 200_000 + b"]" * 200_000,  # deeper than Python parses
    b'"just a string"',  # the wrong shape
], ids=["malformed", "200k-deep", "wrong-shape"])
def test_a_broken_answer_is_an_error_not_a_traceback(isolated: Path, listener: Listener, body: bytes) -> None:
    for path in ("/admin/status", "/admin/entries", "/admin/drain"):
        listener.answers[path] = (200, "application/json", body)
    for command in (["status"], ["entries"], ["drain"]):
        result = apcctl(*command, "--server", listener.url, "--token", "t")
        assert result.exit_code == ExitStatus.FAILED, result.output
        assert "the server's answer" in result.output


def test_a_huge_answer_is_refused_past_the_cap(isolated: Path, listener: Listener,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_client, "MAX_ANSWER_BYTES", 1 << 20)
    listener.answers["/admin/entries"] = (200, "application/json",
                                          b'{"entries": [' + b'"x",' * (1 << 19) + b'"x"]}')
    result = apcctl("entries", "--server", listener.url, "--token", "t")
    assert result.exit_code == ExitStatus.FAILED and "larger than 1,048,576 bytes" in result.output


def test_drain_does_not_report_success_from_an_answer_that_does_not_say_draining(
        isolated: Path, listener: Listener) -> None:
    listener.answers["/admin/drain"] = (200, "application/json", b"{}")
    result = apcctl("drain", "--server", listener.url, "--token", "t")
    assert result.exit_code == ExitStatus.FAILED and "draining = true" in result.output
    assert "clients retry" not in result.output
    listener.answers["/admin/drain"] = (200, "text/plain", b"OK")
    assert apcctl("drain", "--server", listener.url, "--token", "t").exit_code == ExitStatus.FAILED
    listener.answers["/admin/drain"] = (200, "application/json", json.dumps(
        {"in_flight": 2, "draining": True, "retry_after_s": 5}).encode())
    result = apcctl("drain", "--server", listener.url, "--token", "t")
    assert result.exit_code == 0 and "draining, 2 in flight" in result.output


def test_a_config_that_is_not_utf8_deep_or_endless_is_a_usage_error(isolated: Path) -> None:
    latin = isolated / "latin1.toml"
    latin.write_bytes('[servers.caf\xe9]\nurl = "http://127.0.0.1:1"\n'.encode("latin-1"))
    result = apcctl("status", "--config", str(latin))
    assert result.exit_code == ExitStatus.USAGE and "not UTF-8" in result.output
    deep = isolated / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    result = apcctl("status", "--config", str(deep))
    assert result.exit_code == ExitStatus.USAGE and "nested too deeply" in result.output
    endless = bounded("status", "--config", "/dev/zero")
    assert endless.returncode == ExitStatus.USAGE, endless.stderr
    assert "not a regular file" in endless.stderr and "Traceback" not in endless.stderr


def test_a_token_file_that_is_not_a_file_is_named(isolated: Path, listener: Listener) -> None:
    config = isolated / "apcctl.toml"
    config.write_text(f'[servers.remote]\nurl = "{listener.url}"\ntoken_file = "/dev/zero"\n')
    result = bounded("status", "--config", str(config))
    assert result.returncode == ExitStatus.AUTH and "not a regular file" in result.stderr, result.stderr


def bounded(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, its memory capped: reading /dev/zero, a regression is a
    failure (MemoryError, or the deadline), not a hang or a shared machine out of memory."""
    return subprocess.run([sys.executable, "-m", "apcctl.cli", *args], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy(),
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)))


# ------------------------------------------------------------------ 34.11: escapes from the server


def test_a_servers_error_message_reaches_the_terminal_without_escapes(isolated: Path, listener: Listener) -> None:
    listener.answers["/admin/status"] = (500, "application/json",
                                         json.dumps({"detail": f"boom{ESCAPES}done"}).encode())
    result = apcctl("status", "--server", listener.url, "--token", "t")
    assert result.exit_code == ExitStatus.FAILED and "boom" in result.output and "done" in result.output
    assert not any(c in result.output for c in "\x1b\x07\x9b\x90\x9c")


def test_logs_print_no_escapes_and_grep_keeps_matching_lines(isolated: Path, listener: Listener) -> None:
    server = managed_at("mine", listener.url, "t")
    server.log_path.write_text(f'INFO: "GET /admin/status HTTP/1.1" 200\nINFO: client said {ESCAPES}hello\n'
                               'INFO: "POST /v1/chat/completions HTTP/1.1" 200\n')
    shown = apcctl("logs", "--server", "mine")
    assert shown.exit_code == 0 and "client said" in shown.output and "hello" in shown.output
    assert not any(c in shown.output for c in "\x1b\x07\x9b\x90\x9c")
    as_json = apcctl("logs", "--server", "mine", "--json")
    lines = [json.loads(line)["line"] for line in as_json.output.splitlines()]
    assert ESCAPES in lines[1]  # scripts get the line as written, escaped by JSON
    grepped = apcctl("logs", "--server", "mine", "--grep", "chat/completions")
    assert grepped.output.splitlines() == ['INFO: "POST /v1/chat/completions HTTP/1.1" 200']
    assert apcctl("logs", "--server", "mine", "--grep", "(").exit_code == ExitStatus.USAGE


# ------------------------------------------------------------------ 34.13: nothing injected into a unit


@pytest.mark.parametrize("supervisor", ["systemd", "launchd"])
@pytest.mark.parametrize("where", ["model", "env"])
def test_a_control_character_never_reaches_a_service_file(isolated: Path, tiny_model_dir: Path,
                                                          supervisor: str, where: str) -> None:
    injected = "x\nExecStartPre=/bin/touch /tmp/owned"
    model = isolated / f"model{injected.replace('/', '_')}"  # a real model directory, with a newline in its name
    shutil.copytree(tiny_model_dir, model)  # (a symlink would be resolved to its target's name)
    args = (["--model", str(model)] if where == "model"
            else ["--model", str(tiny_model_dir), "-e", f"APC_LOG_BACKUPS={injected}"])
    result = apcctl("service", "install", "--server", "svc", "--supervisor", supervisor, "--dry-run", *args)
    assert result.exit_code == ExitStatus.USAGE, result.output
    assert "ExecStartPre" not in result.stdout and "control character" in result.output, result.output


def test_the_unit_spec_refuses_every_control_character() -> None:
    from apcctl.service.units import ServiceConfigError, ServiceSpec

    for bad in ("\n", "\r", "\t", "\x00", "\x1b", "\x85"):
        with pytest.raises(ServiceConfigError, match="control character"):
            ServiceSpec(name="svc", argv=("python", f"--model=a{bad}b"))
        with pytest.raises(ServiceConfigError, match="control character"):
            ServiceSpec(name="svc", argv=("python",), env={"APC_X": f"a{bad}b"})
    ServiceSpec(name="svc", argv=("python", "--model", "a b %s $HOME \"q\""))  # odd, yet printable: written quoted


# ------------------------------------------------------------------ 36.19: completion, suggestions, -o json


def completions(*words: str, incomplete: str = "") -> list[str]:
    """What click's shell completion offers after ``apcctl WORDS`` (bash, zsh and fish ask the same)."""
    from click.shell_completion import ShellComplete

    return [item.value for item in ShellComplete(main, {}, "apcctl", "_APCCTL_COMPLETE")
            .get_completions(list(words), incomplete)]


BUDGETS = {"ram_used": 0, "ram_limit": 1, "conversation_bytes": 0, "anchor_bytes": 0, "anchor_bytes_limit": 1,
           "anchor_count": 0, "anchor_count_limit": 1, "disk_used": 0, "disk_limit": 1, "entries": 2,
           "disk_files": 0}


def test_server_names_and_entry_ids_complete(isolated: Path, listener: Listener) -> None:
    managed_at("main", listener.url, "managed-secret")
    managed_at("mirror", "http://127.0.0.1:9", "other")
    config = isolated / "apcctl.toml"
    config.write_text('[servers.remote]\nurl = "http://10.0.0.7:8080"\n')
    assert sorted(completions("status", "-s")) == ["main", "mirror"]
    assert completions("status", "--config", str(config), "--server", incomplete="r") == ["remote"]
    for command in (["serve"], ["service", "install"], ["config", "show"], ["logs"], ["restart"]):
        assert completions(*command, "-s", incomplete="ma") == ["main"], command
    entry = {"kind": "conversation", "pinned": False, "length": 10, "bytes": 1}
    listener.answers["/admin/entries"] = (200, "application/json", json.dumps(
        {"entries": [{"id": "d3a1", **entry}, {"id": "d3b2", **entry}, {"id": "e9", **entry}],
         "budgets": BUDGETS, "started": True}).encode())
    assert completions("entries", "-s", "main", incomplete="d3") == ["d3a1", "d3b2"]
    assert completions("anchors", "pin", "-s", "main", incomplete="e") == ["e9"]
    assert listener.authorizations()[-1] == "Bearer managed-secret"
    # A server that does not answer, or answers nonsense: nothing, and nothing printed.
    assert completions("entries", "-s", "mirror", incomplete="d3") == []
    listener.answers["/admin/entries"] = (200, "application/json", b"[[[")
    assert completions("entries", "-s", "main", incomplete="d3") == []


def test_a_mistyped_command_gets_a_suggestion(isolated: Path) -> None:
    result = apcctl("statsu")
    assert result.exit_code == ExitStatus.USAGE and "Did you mean 'status'" in result.output
    result = apcctl("bench", "stal")
    assert result.exit_code == ExitStatus.USAGE and "Did you mean 'stall'" in result.output
    result = apcctl("qqqqqq")
    assert result.exit_code == ExitStatus.USAGE and "No such command 'qqqqqq'" in result.output


def test_dash_o_json_is_json(isolated: Path, listener: Listener) -> None:
    listener.answers["/admin/drain"] = (200, "application/json", json.dumps(
        {"in_flight": 1, "draining": True, "retry_after_s": 5}).encode())
    for flag in (["-o", "json"], ["--output=json"], ["--json"]):
        result = apcctl("drain", "--server", listener.url, "--token", "t", *flag)
        assert result.exit_code == 0 and json.loads(result.stdout)["draining"] is True, result.output
    plain = apcctl("drain", "--server", listener.url, "--token", "t")
    assert plain.stdout.startswith("127.0.0.1") and "draining, 1 in flight" in plain.stdout
    assert apcctl("drain", "--server", listener.url, "-o", "yaml").exit_code == ExitStatus.USAGE


def test_the_model_not_found_error_names_served_model_name() -> None:
    from server_patch.serving.served import ModelNotServed

    assert "--served-model-name" in ModelNotServed("gpt-4o", ["/models/glm"]).detail
    assert "--served-model-name" not in ModelNotServed("lora", ["no adapter"], "adapter_path").detail
