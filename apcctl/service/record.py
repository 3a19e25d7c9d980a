"""Which supervisor runs a managed server: ``<state dir>/servers/NAME/service.json``.

``service install`` writes it and ``service uninstall`` removes it. ``apcctl.config.resolve``
reads it, so ``apcctl restart`` of an installed server goes through its supervisor
(``launchctl kickstart -k``, ``systemctl --user restart``) without a flag or a config entry.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from apcctl.core.manage import servers_root

RECORD_FILE = "service.json"


@dataclass(frozen=True)
class ServiceRecord:
    supervisor: str  # "launchd" or "systemd"
    service: str  # launchd label or systemd unit name
    path: str  # the plist or unit file


def record_path(name: str, root: Path | None = None) -> Path:
    return (root or servers_root()) / name / RECORD_FILE


def read_record(name: str, root: Path | None = None) -> ServiceRecord | None:
    try:
        data = json.loads(record_path(name, root).read_text(encoding="utf-8"))
        return ServiceRecord(supervisor=str(data["supervisor"]), service=str(data["service"]), path=str(data["path"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(name: str, record: ServiceRecord, root: Path | None = None) -> Path:
    path = record_path(name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def remove_record(name: str, root: Path | None = None) -> None:
    record_path(name, root).unlink(missing_ok=True)
