"""The files and commands of a supervised server, as pure functions of a ``ServiceSpec``.

launchd (macOS): a user agent in ``~/Library/LaunchAgents/<label>.plist``, loaded into the
``gui/<uid>`` domain. ``KeepAlive`` with ``SuccessfulExit = false`` starts it again after a
crash or a SIGKILL but not after a clean stop (``apcctl stop`` ends with a SIGTERM and exit 0);
``ExitTimeOut`` covers the shutdown flush, so ``launchctl kickstart -k`` and ``bootout`` never
SIGKILL a flush.

systemd (Linux): a user unit in ``$XDG_CONFIG_HOME/systemd/user/<unit>``. ``Type=notify`` with
``NotifyAccess=all``: ``serve --foreground`` starts ``apcctl.service.ready`` beside the server,
which sends the one datagram ``READY=1`` once ``/health`` answers (no ``sd_notify`` dependency);
``Restart=on-failure``; ``TimeoutStopSec`` covers the shutdown flush; ``KillMode=mixed`` sends
the SIGTERM to the server alone.

Both run ``python -m apcctl.cli serve --foreground --server NAME ...`` with the interpreter that
installed it, so no ``PATH`` is needed. The server writes and rotates ``server.log`` itself
(``APC_LOG_FILE``); ``service.log`` keeps what is printed before it opens it.
"""

from __future__ import annotations

import math
import os
import plistlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from apcctl.core.manage import READY_TIMEOUT_S

LABEL_PREFIX = "com.apcctl."
UNIT_PREFIX = "apcctl-"
SERVICE_LOG = "service.log"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# C0 and C1 controls and DEL: a newline in a value would start a new directive of the unit
# (``ExecStartPre=...``) and end a plist string early for a reader that splits lines.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class ServiceConfigError(ValueError):
    """A name or setting that cannot become a launchd label or a systemd unit."""


@dataclass(frozen=True)
class ServiceSpec:
    """Everything the plist or unit says: the command, its environment, where output goes."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    working_dir: Path = Path("/")
    log_path: Path = Path("/dev/null")  # the supervisor's capture (early output)
    stop_timeout_s: float = 75.0  # the shutdown flush plus a margin (apcctl.core.manage.default_grace)
    health_url: str = "http://127.0.0.1:8080"
    ready_timeout_s: int = READY_TIMEOUT_S

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ServiceConfigError(f"server name {self.name!r} cannot name a service: use letters, digits, "
                                     "'.', '_' and '-'")
        for what, value in self._written():
            if _CONTROL.search(value):
                raise ServiceConfigError(f"{what} {value!r} has a control character (a newline, a tab...), which "
                                         "cannot be written into a service file: remove it")

    def _written(self) -> list[tuple[str, str]]:
        """Every text the plist or unit holds, with what to call it in an error."""
        return [*(("argument", a) for a in self.argv),
                *(item for k, v in self.env.items() for item in (("environment name", k), (f"{k}=", v))),
                ("working directory", str(self.working_dir)), ("log path", str(self.log_path)),
                ("health URL", self.health_url)]

    @property
    def stop_timeout(self) -> int:
        return max(1, math.ceil(self.stop_timeout_s))


def launchd_label(name: str) -> str:
    return LABEL_PREFIX + name


def systemd_unit_name(name: str) -> str:
    return f"{UNIT_PREFIX}{name}.service"


def service_id(supervisor: str, name: str) -> str:
    return launchd_label(name) if supervisor == "launchd" else systemd_unit_name(name)


def unit_path(supervisor: str, name: str, home: Path | None = None,
              environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where the plist or unit file goes (a per-user location, no root needed)."""
    home = home or Path(environ.get("HOME") or Path.home())
    if supervisor == "launchd":
        return home / "Library" / "LaunchAgents" / f"{launchd_label(name)}.plist"
    config = Path(environ["XDG_CONFIG_HOME"]) if environ.get("XDG_CONFIG_HOME") else home / ".config"
    return config / "systemd" / "user" / systemd_unit_name(name)


# ---------------------------------------------------------------------- launchd


def launchd_plist(spec: ServiceSpec) -> bytes:
    """The user agent's plist (XML)."""
    return plistlib.dumps({
        "Label": launchd_label(spec.name),
        "ProgramArguments": list(spec.argv),
        "EnvironmentVariables": dict(sorted(spec.env.items())),
        "WorkingDirectory": str(spec.working_dir),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # again after a crash or SIGKILL, not after a clean stop
        "ThrottleInterval": 10,  # seconds between two starts when it keeps failing
        "ExitTimeOut": spec.stop_timeout,  # SIGTERM to SIGKILL: the shutdown flush fits in it
        "ProcessType": "Interactive",  # no background throttling of an inference server
        "StandardOutPath": str(spec.log_path),
        "StandardErrorPath": str(spec.log_path),
    })


def launchd_domain(uid: int | None = None) -> str:
    return f"gui/{os.getuid() if uid is None else uid}"


def launchd_install_commands(spec: ServiceSpec, plist: Path, uid: int | None = None) -> list[list[str]]:
    """Unload any older copy (allowed to fail), then load and start the new one."""
    domain = launchd_domain(uid)
    return [["launchctl", "bootout", f"{domain}/{launchd_label(spec.name)}"],
            ["launchctl", "bootstrap", domain, str(plist)]]


def launchd_uninstall_commands(name: str, uid: int | None = None) -> list[list[str]]:
    return [["launchctl", "bootout", f"{launchd_domain(uid)}/{launchd_label(name)}"]]


def launchd_status_command(name: str, uid: int | None = None) -> list[str]:
    return ["launchctl", "print", f"{launchd_domain(uid)}/{launchd_label(name)}"]


def parse_launchd_print(text: str) -> dict[str, object]:
    """``state`` and ``pid`` from ``launchctl print`` (its top-level ``key = value`` lines)."""
    out: dict[str, object] = {}
    for line in text.splitlines():
        match = re.match(r"^\t(state|pid|last exit code) = (.+)$", line)
        if match:
            key, value = match.group(1).replace(" ", "_"), match.group(2).strip()
            out[key] = int(value) if key == "pid" and value.isdigit() else value
    return out


# ---------------------------------------------------------------------- systemd


def _specifiers(value: str) -> str:
    """systemd expands ``%x`` specifiers in most settings: a literal ``%`` is ``%%``."""
    return value.replace("%", "%%")


def _systemd_quote(value: str, *, command: bool = True) -> str:
    """One double-quoted word with systemd's escapes; in a command line ``$`` is ``$$`` too
    (``Environment=`` does not substitute variables)."""
    escaped = _specifiers(value.replace("\\", "\\\\").replace('"', '\\"'))
    return f'"{escaped.replace("$", "$$") if command else escaped}"'


def systemd_unit(spec: ServiceSpec) -> str:
    """The user unit's text."""
    command = " ".join(_systemd_quote(a) for a in spec.argv)
    env = "".join(f"Environment={_systemd_quote(f'{k}={v}', command=False)}\n" for k, v in sorted(spec.env.items()))
    log = _specifiers(str(spec.log_path))
    return (
        "[Unit]\n"
        f"Description=apcctl lineage-cache server {spec.name} (mlx-vlm)\n"
        "After=network.target\n"
        "StartLimitIntervalSec=300\n"
        "StartLimitBurst=5\n"
        "\n"
        "[Service]\n"
        "Type=notify\n"
        "NotifyAccess=all\n"  # READY=1 comes from apcctl.service.ready, beside the server
        f"ExecStart={command}\n"
        f"WorkingDirectory={_specifiers(str(spec.working_dir))}\n"
        f"{env}"
        "Restart=on-failure\n"
        "RestartSec=10\n"
        f"TimeoutStartSec={spec.ready_timeout_s + 60}\n"
        f"TimeoutStopSec={spec.stop_timeout}\n"
        "KillMode=mixed\n"
        "KillSignal=SIGTERM\n"
        f"StandardOutput=append:{log}\n"
        f"StandardError=append:{log}\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def systemd_install_commands(name: str) -> list[list[str]]:
    return [["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", "--now", systemd_unit_name(name)]]


def systemd_uninstall_commands(name: str) -> list[list[str]]:
    return [["systemctl", "--user", "disable", "--now", systemd_unit_name(name)]]


def systemd_status_command(name: str) -> list[str]:
    return ["systemctl", "--user", "show", systemd_unit_name(name),
            "--property=LoadState,ActiveState,SubState,MainPID,ExecMainStatus"]


def parse_systemctl_show(text: str) -> dict[str, object]:
    """``systemctl show --property=...`` lines as ``state``, ``pid`` and the rest."""
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    pid = values.get("MainPID", "")
    return {"state": values.get("ActiveState"), "sub_state": values.get("SubState"),
            "load_state": values.get("LoadState"),
            "pid": int(pid) if pid.isdigit() and int(pid) > 0 else None,
            "last_exit_code": values.get("ExecMainStatus")}


def command_line(argv: list[str] | tuple[str, ...]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
