"""Logs that rotate while the server runs, ``apcctl logs -f`` across rotations, and the small
conventions of the command line (``--watch``, ``-n``, ``APCCTL_SERVER``, a missing token file,
shell completion)."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import isolate_cli
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.commands.common import ExitStatus, watching
from apcctl.commands.serve import follow_file
from apcctl.config import ConfigError, load_config, select, server_name

REPO = Path(__file__).resolve().parents[2]


def apcctl(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == code, f"apcctl {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return result.stdout


@pytest.fixture()
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_cli(monkeypatch, tmp_path)


# ------------------------------------------------------------------ following a file


def test_follow_reads_across_a_rename_and_a_truncation(tmp_path: Path) -> None:
    """What is written just before a rotation, after it, and after a truncation, once each."""
    log = tmp_path / "server.log"
    log.write_bytes(b"old line, before following\n")
    got: list[bytes] = []
    done = threading.Event()
    follower = threading.Thread(target=follow_file, args=(log, got.append),
                                kwargs={"poll_s": 0.05, "stop": done.is_set}, daemon=True)
    follower.start()

    def written(*lines: str) -> None:
        deadline = time.monotonic() + 10
        while b"".join(got).decode() != "".join(lines) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b"".join(got).decode() == "".join(lines)

    time.sleep(0.2)  # it opened the file at its end
    with log.open("ab") as f:
        f.write(b"one\n")
    written("one\n")
    with log.open("ab") as f:
        f.write(b"two, just before the rename\n")
    os.replace(log, log.with_name("server.log.1"))  # the rotation, within one poll of the write
    log.write_bytes(b"three, in the new file\n")
    written("one\n", "two, just before the rename\n", "three, in the new file\n")
    log.write_bytes(b"4\n")  # truncated in place and written again
    written("one\n", "two, just before the rename\n", "three, in the new file\n", "4\n")
    done.set()
    follower.join(timeout=5)


# ------------------------------------------------------------------ a real server's log


class Follower:
    """``apcctl logs -f`` as a real process; its lines arrive on a queue."""

    def __init__(self, name: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "apcctl.cli", "logs", "-s", name, "-n", "0", "-f"],
                                        stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 60.0, poke: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if poke:
                urllib.request.urlopen(poke, timeout=10).read()
            try:
                while True:
                    self.seen.append(self.lines.get(timeout=0.2))
                    if re.search(pattern, self.seen[-1]):
                        return
            except queue.Empty:
                pass
        raise AssertionError(f"apcctl logs -f never printed {pattern!r}; it printed:\n{''.join(self.seen[-20:])}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


LOG_MAX_BYTES, LOG_BACKUPS = 2048, 3


@pytest.fixture(scope="module")
def rotating(cli_env: Path, tiny_model_dir: Path) -> dict:
    """``apcctl serve -s logs``, its log rotating at 2 KiB with 3 backups: one server for the
    module (``cli_env`` stops it at the end)."""
    from tests.server_harness import free_port

    patch = pytest.MonkeyPatch()
    patch.setenv("APC_LOG_MAX_BYTES", str(LOG_MAX_BYTES))
    patch.setenv("APC_LOG_BACKUPS", str(LOG_BACKUPS))
    try:
        return json.loads(apcctl("serve", "-s", "logs", "--model", str(tiny_model_dir), "--port", str(free_port()),
                                 "--json"))
    finally:
        patch.undo()


@pytest.mark.server
def test_server_log_rotates_while_it_runs_and_logs_follow_reads_across(rotating: dict, tiny_model_dir: Path) -> None:
    served, max_bytes, backups = rotating, LOG_MAX_BYTES, LOG_BACKUPS
    log = Path(served["log"])
    follower = Follower("logs")
    try:
        follower.wait_for(r"GET /health\?n=start", poke=f"{served['url']}/health?n=start")
        count, batch = 200, 10  # ~60 bytes of access log each: 12 KB, more than the four files hold
        for n in range(count):
            urllib.request.urlopen(f"{served['url']}/health?n={n}", timeout=10).read()
            if n % batch == batch - 1:  # paced by what the follower read (a batch is < one file), not by time:
                follower.wait_for(rf"GET /health\?n={n} ")  # a fast server never rotates a file away unread
        token = (Path(served["state_dir"]) / "admin-token").read_text().strip()
        body = json.dumps({"model": str(tiny_model_dir), "max_tokens": 1,
                           "messages": [{"role": "user", "content": "model cache prompt"}]}).encode()
        request = urllib.request.Request(f"{served['url']}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {token}"})
        urllib.request.urlopen(request, timeout=120).read()
        follower.wait_for(r"apc_lineage restore")  # Python logging goes to the same rotating file
    finally:
        follower.stop()
    numbers = [int(m.group(1)) for line in follower.seen for m in [re.search(r"GET /health\?n=(\d+) ", line)] if m]
    assert numbers == list(range(count)), "every access line once, in order, across the rotations"
    rotated = sorted(log.parent.glob("server.log.*"))
    assert [p.name for p in rotated] == [f"server.log.{i}" for i in range(1, backups + 1)]  # the oldest dropped
    assert all(p.stat().st_size <= max_bytes for p in rotated)
    assert "GET /health?n=0 " not in "".join(p.read_text() for p in [log, *rotated])  # rotated out by now


# ------------------------------------------------------------------ conventions


def test_watch_repeats_and_rides_out_a_failing_server(capsys: pytest.CaptureFixture[str]) -> None:
    import click

    calls: list[int] = []

    def once() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise click.ClickException("server unreachable")
        print(json.dumps({"tick": len(calls)}))

    def sleep(_: float) -> None:
        if len(calls) == 3:
            raise KeyboardInterrupt

    watching(0.5, once, as_json=True, sleep=sleep)
    out, err = capsys.readouterr()
    assert [json.loads(line)["tick"] for line in out.splitlines()] == [1, 3]
    assert "server unreachable" in err
    calls.clear()
    watching(None, lambda: calls.append(1), as_json=False, sleep=sleep)
    assert calls == [1]


def test_n_is_a_count_and_s_a_server_everywhere() -> None:
    from apcctl.commands import load_all

    load_all()  # command modules load lazily
    for path in (["serve"], ["logs"], ["service", "install"]):
        command = main
        for part in path:
            command = command.commands[part]  # type: ignore[attr-defined]
        opts = {o: p.name for p in command.params for o in getattr(p, "opts", [])}
        assert opts.get("-s") in ("name", "server"), path
        assert opts.get("-n") in (None, "lines"), path
    serve = {o: p.name for p in main.commands["serve"].params for o in p.opts}
    assert serve["--name"] == serve["--server"] == "name"  # the old long option still works


def test_apcctl_server_is_a_name_or_a_url_for_serve_too(isolated: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "apcctl.toml"
    config.write_text('[servers.main]\nurl = "http://127.0.0.1:8091"\nport = 8091\n')
    loaded = load_config(config)
    assert server_name("http://127.0.0.1:8091/", loaded) == "main"  # a URL names the configured server
    assert server_name(None, loaded) == "main"  # the only server, as for every other command
    assert select("http://127.0.0.1:8091", None, config)[0].name == "main"
    with pytest.raises(ConfigError, match="names no server"):
        server_name("http://127.0.0.1:9", loaded)
    monkeypatch.setenv("APCCTL_SERVER", "http://127.0.0.1:9")
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--config", str(config)])
    assert result.exit_code == ExitStatus.USAGE and "names no server" in result.output


@pytest.mark.server
def test_a_missing_token_file_is_named_not_a_bare_401(rotating: dict, isolated: Path, tmp_path: Path) -> None:
    """A configured server (the module's, reached by its URL from another state dir) whose token file is missing."""
    missing = tmp_path / "nowhere" / "admin-token"
    config = tmp_path / "apcctl.toml"
    config.write_text(f'[servers.main]\nurl = "{rotating["url"]}"\ntoken_file = "{missing}"\n')
    result = CliRunner().invoke(main, ["status", "--config", str(config)])
    assert result.exit_code == ExitStatus.AUTH
    assert f"token_file {missing} does not exist" in result.output
    missing.parent.mkdir()
    missing.write_text((Path(rotating["state_dir"]) / "admin-token").read_text())
    assert CliRunner().invoke(main, ["status", "--config", str(config)]).exit_code == 0


def test_shell_completion_is_clicks_own() -> None:
    """What docs/cli.md tells the operator to put in their shell's startup file."""
    apcctl_bin = Path(sys.executable).with_name("apcctl")
    if not apcctl_bin.exists():
        pytest.skip(f"no apcctl entry point next to {sys.executable} (not installed with pip install -e .)")
    script = subprocess.run([str(apcctl_bin)], env={**os.environ, "_APCCTL_COMPLETE": "bash_source"},
                            capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "_apcctl_completion" in script.stdout
    words = subprocess.run([str(apcctl_bin)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "_APCCTL_COMPLETE": "bash_complete", "COMP_WORDS": "apcctl ser",
                                "COMP_CWORD": "1"})
    assert "plain,serve" in words.stdout and "plain,service" in words.stdout
