"""Issue 34 item 4: the layer profiler's flag and log lived in the shared temp dir.

Any local user could switch profiling on for every server, the log was world-readable, and a
FIFO in the log's place hung every inference request (the generation thread blocked in
``open()``) while ``/health`` said healthy. Now the flag sits in the server's state directory
(0700), and a writer thread appends the log ``O_NOFOLLOW | O_NONBLOCK``, regular files only,
0600. Real server on the tiny glm5_next model; the flag switched by the real ``apcctl profile``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.cli import main
from tests.server_harness import PatchedServer, text, wait_for

NOT_WRITTEN = "layer profile not written"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.server
def test_a_fifo_or_link_in_the_logs_place_never_hangs_inference(tiny_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "profile" / "profile.jsonl"
    log.parent.mkdir()
    os.mkfifo(log)  # no reader: a blocking open(O_WRONLY) waits forever
    server = PatchedServer(tiny_model_dir, env={"APC_PROFILE_LOG": str(log), "APC_PROFILE_FLAG": None},
                           log_dir=tmp_path / "server")
    state = server.log_dir / "state"
    monkeypatch.setenv("APC_STATE_DIR", str(state))  # the command sees the server's environment
    monkeypatch.setenv("APC_PROFILE_LOG", str(log))
    monkeypatch.delenv("APC_PROFILE_FLAG", raising=False)
    messages = [{"role": "system", "content": text(120, 641)}, {"role": "user", "content": "hi"}]
    with server:
        done = CliRunner().invoke(main, ["profile", "layers", "status", "--json", "--last", "0"])
        flag = Path(json.loads(done.output)["flag"])
        assert flag.parent == state / "profile", done.output  # not the shared temp dir
        done = CliRunner().invoke(main, ["profile", "layers", "status"])  # the FIFO: refused, not waited on
        assert done.exit_code == 1 and "not a regular file" in done.output, done.output
        assert CliRunner().invoke(main, ["profile", "layers", "on"]).exit_code == 0
        assert _mode(flag.parent) == 0o700 and _mode(flag) == 0o600

        # The deadline only bounds a hang: before the fix this request never answered.
        status, body = server.request("POST", "/v1/chat/completions", {
            "model": str(tiny_model_dir), "messages": messages, "max_tokens": 3, "temperature": 0.0},
            timeout=120)
        assert status == 200, body
        wait_for(lambda: NOT_WRITTEN in server.log_text() and "not a regular file" in server.log_text()
                 or "No such device" in server.log_text(), "the refused FIFO's warning", server)
        assert stat.S_ISFIFO(os.lstat(log).st_mode)

        victim = tmp_path / "victim.txt"
        victim.write_text("keep\n")
        log.unlink()
        log.symlink_to(victim)  # a link in its place is not followed
        warnings = server.log_text().count(NOT_WRITTEN)
        assert server.chat(messages, max_tokens=2)["choices"]
        wait_for(lambda: server.log_text().count(NOT_WRITTEN) > warnings, "the refused link's warning", server)
        assert victim.read_text() == "keep\n"

        log.unlink()
        assert server.chat(messages, max_tokens=2)["choices"]
        wait_for(lambda: log.exists() and log.read_text().strip(), "a profile record", server)
        assert _mode(log) == 0o600
        record = json.loads(log.read_text().splitlines()[0])
        assert record["chunk"] >= 1 and record["ms"]
        assert server.request("GET", "/health")[0] == 200
