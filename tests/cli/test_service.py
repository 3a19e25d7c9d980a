"""``apcctl service``: the generated plist and unit, and install/status/uninstall/restart through
launchd and systemd stand-ins.

The stand-ins are real executables put first on ``PATH`` (``apcctl.service.runner`` finds them
like the real ones): a fake ``systemctl`` that records its arguments, and a fake ``launchctl``
that does what launchd does with the plist (starts ``ProgramArguments`` with its environment,
``kickstart -k`` stops and starts it, ``bootout`` stops it within ``ExitTimeOut``), so a real
server runs under it and ``apcctl restart`` goes through the supervisor without a flag.

Not run here: a real systemd user unit (``systemctl --user`` needs a user session and a bus,
which this test machine lacks; ``test_systemd_user_unit_runs_when_a_user_session_exists``
reports that as a skip) and a real launchd (macOS only).
"""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.commands.common import ExitStatus
from apcctl.core.manage import default_grace
from apcctl.service import units
from apcctl.service.record import read_record

REPO = Path(__file__).resolve().parents[2]

FAKE_SYSTEMCTL = """\
#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_SUPERVISOR_LOG"
case "$*" in
  *show*) printf 'LoadState=loaded\\nActiveState=active\\nSubState=running\\nMainPID=4242\\nExecMainStatus=0\\n' ;;
esac
exit 0
"""

# A launchd that runs one agent per label, as launchd does with a loaded plist.
FAKE_LAUNCHCTL = """\
#!{python}
import json, os, plistlib, signal, subprocess, sys, time
state = os.environ["FAKE_LAUNCHD_DIR"]
with open(os.path.join(state, "calls.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
verb, args = sys.argv[1], sys.argv[2:]

def files(label):
    return os.path.join(state, label + ".pid"), os.path.join(state, label + ".plist-path")

def start(label):
    pid_file, plist_file = files(label)
    job = plistlib.loads(open(open(plist_file).read(), "rb").read())
    log = open(job["StandardOutPath"], "ab")
    env = {{**os.environ, **job.get("EnvironmentVariables", {{}})}}
    proc = subprocess.Popen(job["ProgramArguments"], env=env, cwd=job["WorkingDirectory"], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True)
    open(pid_file, "w").write(str(proc.pid))

def stop(label):
    pid_file, plist_file = files(label)
    if not os.path.exists(pid_file):
        return False
    pid = int(open(pid_file).read())
    grace = plistlib.loads(open(open(plist_file).read(), "rb").read())["ExitTimeOut"]
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.unlink(pid_file)
    return True

def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours (the fake launchd is not its parent, so normally none)
        return open(f"/proc/{{pid}}/stat").read().split()[2] != "Z"
    except OSError:
        return True

if verb == "bootstrap":
    plist = args[1]
    label = plistlib.loads(open(plist, "rb").read())["Label"]
    open(files(label)[1], "w").write(plist)
    start(label)
elif verb == "bootout":
    label = args[0].rsplit("/", 1)[1]
    if not os.path.exists(files(label)[1]):
        print("Boot-out failed: 3: No such process", file=sys.stderr)
        sys.exit(3)
    stop(label)
    os.unlink(files(label)[1])
elif verb == "kickstart":
    label = args[-1].rsplit("/", 1)[1]
    if "-k" in args:
        stop(label)
    start(label)
elif verb == "print":
    label = args[0].rsplit("/", 1)[1]
    pid_file = files(label)[0]
    if not os.path.exists(pid_file):
        print(f"Could not find service \\"{{label}}\\"", file=sys.stderr)
        sys.exit(113)
    print(f"{{args[0]}} = {{{{\\n\\tstate = running\\n\\tpid = {{open(pid_file).read()}}\\n}}}}")
else:
    sys.exit(64)
"""


def spec(tmp_path: Path, **overrides: object) -> units.ServiceSpec:
    values: dict[str, object] = dict(
        name="main", argv=(sys.executable, "-m", "apcctl.cli", "serve", "--foreground", "--server", "main",
                           "--model", str(tmp_path / "my models" / "glm 100%"), "--", "--max-kv-size", "$HOME"),
        env={"APC_STATE_DIR": str(tmp_path / "state"), "APC_LOG_FILE": str(tmp_path / "state" / "server.log"),
             "HF_HOME": str(tmp_path / "hf 50%")},
        working_dir=tmp_path, log_path=tmp_path / "service.log",
        stop_timeout_s=default_grace({"APC_LINEAGE_SHUTDOWN_FLUSH_S": "90"}))
    values.update(overrides)
    return units.ServiceSpec(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------ generated files


def test_plist_round_trips_and_covers_the_shutdown_flush(tmp_path: Path) -> None:
    job = plistlib.loads(units.launchd_plist(spec(tmp_path)))
    assert job["Label"] == "com.apcctl.main"
    assert job["ProgramArguments"][:5] == [sys.executable, "-m", "apcctl.cli", "serve", "--foreground"]
    assert job["ProgramArguments"][-1] == "$HOME"  # no shell: arguments are passed as they are
    assert job["KeepAlive"] == {"SuccessfulExit": False} and job["RunAtLoad"] is True
    assert job["ExitTimeOut"] >= 90 + 15  # the shutdown flush this server was configured with, and a margin
    assert job["StandardOutPath"] == job["StandardErrorPath"] == str(tmp_path / "service.log")
    assert job["EnvironmentVariables"]["APC_LOG_FILE"] == str(tmp_path / "state" / "server.log")


def test_systemd_unit_has_restart_readiness_and_stop_timeout(tmp_path: Path) -> None:
    text = units.systemd_unit(spec(tmp_path))
    lines = text.splitlines()
    assert "Type=notify" in lines and "NotifyAccess=all" in lines  # READY=1 from apcctl.service.ready
    assert "Restart=on-failure" in lines and "KillMode=mixed" in lines
    assert f"TimeoutStopSec={105}" in lines and not any(line.startswith("ExecStartPost=") for line in lines)
    start = next(line for line in lines if line.startswith("ExecStart="))
    assert 'glm 100%%"' in start and '"$$HOME"' in start  # systemd's specifier and variable escapes
    assert 'Environment="HF_HOME=' in text and '50%%"' in text
    assert f"StandardOutput=append:{tmp_path / 'service.log'}" in lines


def _verify(unit_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", str(unit_file)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed here (it is on Debian/Ubuntu with systemd): "
                           "the unit is not checked by systemd's own parser")
def test_systemd_analyze_accepts_the_unit_and_rejects_a_broken_one(tmp_path: Path) -> None:
    unit_file = tmp_path / units.systemd_unit_name("main")
    unit_file.write_text(units.systemd_unit(spec(tmp_path)))
    done = _verify(unit_file)
    assert done.returncode == 0 and unit_file.name not in done.stdout + done.stderr, done.stdout + done.stderr
    broken = tmp_path / units.systemd_unit_name("broken")
    broken.write_text(units.systemd_unit(spec(tmp_path, name="broken")).replace("Type=notify", "Type=sometimes"))
    assert "service type" in _verify(broken).stderr  # the check above can fail: a bad line is reported


def test_a_name_that_cannot_be_a_label_is_refused(tmp_path: Path) -> None:
    with pytest.raises(units.ServiceConfigError):
        spec(tmp_path, name="two words")


def test_supervisor_output_is_parsed() -> None:
    printed = "gui/501/com.apcctl.main = {\n\tactive count = 1\n\tstate = running\n\tpid = 812\n\t\tpid = 3\n}"
    assert units.parse_launchd_print(printed) == {"state": "running", "pid": 812}
    shown = units.parse_systemctl_show("LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\n")
    assert shown["state"] == "failed" and shown["pid"] is None and shown["load_state"] == "loaded"


def test_ready_check_fails_when_nothing_answers() -> None:
    from apcctl.service.ready import main as ready_main
    from tests.server_harness import free_port

    assert ready_main([f"http://127.0.0.1:{free_port()}", "0.5"]) == 1
    assert ready_main([]) == 2


# ------------------------------------------------------------------ install through the stand-ins


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME, state dir and config dir, and a PATH whose first entry holds the stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("systemctl", FAKE_SYSTEMCTL), ("launchctl", FAKE_LAUNCHCTL.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "launchd").mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    monkeypatch.setenv("APC_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FAKE_SUPERVISOR_LOG", str(tmp_path / "systemctl.log"))
    monkeypatch.setenv("FAKE_LAUNCHD_DIR", str(tmp_path / "launchd"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in ("APCCTL_SERVER", "APCCTL_TOKEN", "APCCTL_CONFIG", "APC_ADMIN_TOKEN", "APC_LINEAGE_DISK_PATH",
                "APC_LOG_FILE"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def apcctl(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == code, f"apcctl {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return result.stdout


def test_systemd_install_status_uninstall_run_systemctl(home: Path, tiny_model_dir: Path) -> None:
    out = json.loads(apcctl("service", "install", "--supervisor", "systemd", "--server", "main", "--model",
                            str(tiny_model_dir), "--port", "18080", "--no-wait", "--json"))
    unit_file = home / "home" / ".config" / "systemd" / "user" / "apcctl-main.service"
    assert out["file"] == str(unit_file) and unit_file.stat().st_mode & 0o077 == 0
    assert "TimeoutStopSec=75" in unit_file.read_text()  # the default flush (60 s) + 15 s
    assert read_record("main").supervisor == "systemd"  # type: ignore[union-attr]
    status = json.loads(apcctl("service", "status", "--server", "main", "--json"))
    assert status["loaded"] and status["state"] == "active" and status["pid"] == 4242
    apcctl("service", "uninstall", "--server", "main")
    assert not unit_file.exists() and read_record("main") is None
    calls = (home / "systemctl.log").read_text().splitlines()
    assert calls[:2] == ["--user daemon-reload", "--user enable --now apcctl-main.service"]
    assert "--user disable --now apcctl-main.service" in calls
    apcctl("service", "status", "--server", "main", code=ExitStatus.NOT_FOUND)


def test_a_failing_supervisor_leaves_nothing_installed(home: Path, tiny_model_dir: Path) -> None:
    (home / "bin" / "systemctl").write_text("#!/bin/sh\necho 'Failed to connect to bus' >&2\nexit 1\n")
    result = CliRunner().invoke(main, ["service", "install", "--supervisor", "systemd", "--server", "main",
                                       "--model", str(tiny_model_dir), "--no-wait"])
    assert result.exit_code == ExitStatus.FAILED
    assert "loginctl enable-linger" in result.stderr and "--dry-run" in result.stderr  # what to do about it
    assert read_record("main") is None
    assert not (home / "home" / ".config" / "systemd" / "user" / "apcctl-main.service").exists()


def test_serve_refuses_a_name_installed_as_a_service(home: Path, tiny_model_dir: Path) -> None:
    apcctl("service", "install", "--supervisor", "systemd", "--server", "main", "--model", str(tiny_model_dir),
           "--no-wait")
    result = CliRunner().invoke(main, ["serve", "-s", "main", "--model", str(tiny_model_dir), "--no-wait"])
    assert result.exit_code == ExitStatus.FAILED and "installed as a systemd service" in result.output
    assert not (home / "state" / "servers" / "main" / "server.pid").exists()  # nothing was started


@pytest.mark.server
def test_launchd_agent_serves_restarts_through_kickstart_and_uninstalls(home: Path, tiny_model_dir: Path) -> None:
    from tests.server_harness import free_port

    port = free_port()
    out = json.loads(apcctl("service", "install", "--supervisor", "launchd", "--server", "main", "--model",
                            str(tiny_model_dir), "--port", str(port), "--timeout", "120", "--json"))
    plist = home / "home" / "Library" / "LaunchAgents" / "com.apcctl.main.plist"
    assert out["file"] == str(plist) and plistlib.loads(plist.read_bytes())["ExitTimeOut"] == 75
    try:
        before = json.loads(apcctl("status", "--server", "main", "--json"))
        old_pid = before["status"]["server"]["pid"]
        assert before["managed"]  # serve --foreground wrote the state files under the supervisor
        service = json.loads(apcctl("service", "status", "--server", "main", "--json"))
        assert service["state"] == "running" and service["pid"] == old_pid  # the supervisor runs the server itself
        # No --supervisor flag: restart finds what install recorded and goes through launchctl.
        result = json.loads(apcctl("restart", "--server", "main", "--timeout", "120", "--json"))
        server = result["servers"][0]
        assert result["ok"], result
        assert server["how"] == f"launchctl kickstart -k gui/{os.getuid()}/com.apcctl.main"
        assert server["new_pid"] != old_pid and not server["rolled_back"]
        calls = (home / "launchd" / "calls.log").read_text()
        assert f"kickstart -k gui/{os.getuid()}/com.apcctl.main" in calls
        log = (home / "state" / "servers" / "main" / "server.log").read_text()
        assert "overlay installed" in log and "budgets: RAM" in log  # the server's own log, not the supervisor's
    finally:
        apcctl("service", "uninstall", "--server", "main")
    assert not plist.exists() and read_record("main") is None
    assert "bootout" in (home / "launchd" / "calls.log").read_text().splitlines()[-1]


def _user_session() -> str:
    """Empty when ``systemctl --user`` reaches a running user manager, else why not."""
    real = shutil.which("systemctl")
    if real is None:
        return "systemctl is not installed"
    probe = subprocess.run([real, "--user", "is-system-running"], capture_output=True, text=True, timeout=30)
    state = probe.stdout.strip()
    if state in ("running", "degraded"):
        return ""
    return f"systemctl --user is-system-running says {state or probe.stderr.strip() or probe.returncode!r}"


@pytest.mark.server
def test_systemd_user_unit_runs_when_a_user_session_exists(tmp_path: Path, tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The real thing: a user unit in the developer's own user manager (removed at the end)."""
    why = _user_session()
    if why:
        pytest.skip(f"no systemd user session here ({why}): a real user unit was not run")
    from tests.server_harness import free_port

    name = f"test-{os.getpid()}"
    monkeypatch.setenv("APC_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in ("APCCTL_SERVER", "APCCTL_TOKEN", "APCCTL_CONFIG", "APC_ADMIN_TOKEN", "APC_LOG_FILE"):
        monkeypatch.delenv(key, raising=False)
    apcctl("service", "install", "--supervisor", "systemd", "--server", name, "--model", str(tiny_model_dir),
           "--port", str(free_port()), "--timeout", "180")
    try:
        assert json.loads(apcctl("service", "status", "--server", name, "--json"))["state"] == "active"
        result = json.loads(apcctl("restart", "--server", name, "--timeout", "180", "--json"))
        assert result["ok"] and result["servers"][0]["how"].startswith("systemctl --user restart"), result
    finally:
        apcctl("service", "uninstall", "--server", name)


def test_the_unit_carries_the_installing_shells_xdg_dirs(home: Path, tiny_model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without them the service would keep its records in another state dir than this shell's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "xdg state"))
    text = apcctl("service", "install", "--supervisor", "systemd", "--server", "main", "--model",
                  str(tiny_model_dir), "--dry-run")
    assert f'Environment="XDG_STATE_HOME={home / "xdg state"}"' in text
    assert f'Environment="XDG_CONFIG_HOME={home / "home" / ".config"}"' in text


@pytest.mark.server
def test_serve_foreground_sends_systemd_ready_once_health_answers(home: Path, tiny_model_dir: Path) -> None:
    """What a Type=notify unit sees: one READY=1 datagram on NOTIFY_SOCKET, sent once /health
    answers, from the check beside the server (the server's own environment has no NOTIFY_SOCKET)."""
    import socket
    import tempfile
    import urllib.request

    import psutil

    from tests.server_harness import free_port

    where = Path(tempfile.mkdtemp(prefix="apc-notify-")) / "notify"  # short: AF_UNIX paths are limited
    port = free_port()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(where))
        sock.settimeout(300)
        server = subprocess.Popen([sys.executable, "-m", "apcctl.cli", "serve", "--foreground", "--server", "fg",
                                   "--model", str(tiny_model_dir), "--port", str(port)],
                                  env={**os.environ, "NOTIFY_SOCKET": str(where), "PYTHONPATH": str(REPO)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert sock.recv(64) == b"READY=1"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
                assert answer.status == 200
            assert "NOTIFY_SOCKET" not in psutil.Process(server.pid).environ()
        finally:
            server.terminate()
            server.wait(120)
        where.unlink()
