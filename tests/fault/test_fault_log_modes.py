"""Issue 34 item 10: ``server.log`` was world-readable (0644 in 0755 directories).

It carries request ids, sizes and client text from tracebacks, while everything else the
server keeps is 0600/0700. Now the log is 0600 and its directory 0700 wherever it is created:
by ``apcctl serve``, by the server itself (``APC_LOG_FILE``), and by ``apcctl service install``
(the supervisor's capture file too); a log or directory an older version left open is
tightened. Real ``apcctl serve`` and a real server; the supervisor is the fake ``systemctl``
of ``test_service.py``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from apcctl.core.hosts import free_port
from tests.cli.test_cli_server import run, run_json
from tests.cli.test_service import apcctl, home  # noqa: F401 (the fixture)
from tests.server_harness import PatchedServer


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _older_version_left(directory: Path) -> Path:
    """What an earlier version made: the directory 0755, server.log 0644."""
    directory.mkdir(parents=True)
    os.chmod(directory, 0o755)
    log = directory / "server.log"
    log.write_text("an older start's output\n")
    os.chmod(log, 0o644)
    return log


@pytest.mark.server
def test_apcctl_serve_keeps_server_log_private(cli_env: Path, tiny_model_dir: Path) -> None:
    log = _older_version_left(Path(os.environ["APC_STATE_DIR"]) / "servers" / "logmodes")
    try:
        info = run_json("serve", "--name", "logmodes", "--model", str(tiny_model_dir), "--port", str(free_port()))
        state = Path(info["state_dir"])
        assert state == log.parent
        assert _mode(state) == 0o700 and _mode(log) == 0o600, (oct(_mode(state)), oct(_mode(log)))
        assert "an older start's output" in log.read_text()  # tightened, not replaced
    finally:
        run("stop", "--server", "logmodes")


@pytest.mark.server
def test_the_server_creates_its_log_file_private(tiny_model_dir: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "logs" / "new" / "server.log"
    with PatchedServer(tiny_model_dir, env={"APC_LOG_FILE": str(fresh)}, log_dir=tmp_path / "harness"):
        pass
    assert _mode(fresh) == 0o600 and _mode(fresh.parent) == 0o700 and _mode(fresh.parent.parent) == 0o700
    older = _older_version_left(tmp_path / "older")
    with PatchedServer(tiny_model_dir, env={"APC_LOG_FILE": str(older)}, log_dir=tmp_path / "harness2"):
        pass
    assert _mode(older) == 0o600


def test_service_install_makes_the_log_directory_and_capture_private(home: Path,  # noqa: F811
                                                                     tiny_model_dir: Path) -> None:
    directory = home / "state" / "servers" / "main"
    _older_version_left(directory)
    out = json.loads(apcctl("service", "install", "--supervisor", "systemd", "--server", "main", "--model",
                            str(tiny_model_dir), "--port", str(free_port()), "--no-wait", "--json"))
    unit = Path(out["file"]).read_text()
    capture = next(Path(line.split("append:", 1)[1]) for line in unit.splitlines() if "append:" in line)
    assert capture.parent == directory and _mode(capture) == 0o600, unit
    assert _mode(directory) == 0o700
    apcctl("service", "uninstall", "--server", "main")
