"""What ``apcctl fleet up`` leaves in ``<state dir>/fleets/<name>/``, so ``down`` and ``status`` find it.

``fleet.json`` names the servers (each a managed server under ``<state dir>/servers/``, or a URL the
fleet does not start) and the gateway's command; ``gateway.pid`` / ``gateway.log`` and the 0600
``control-plane.key`` belong to the gateway process (``apcctl.core.gateway``). The directory is 0700.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from apcctl.core.gateway import GatewayProcess, GatewaySpec
from apcctl.core.manage import plain_name, write_private
from server_patch.paths import state_dir
from server_patch.private_files import private_dir

SPEC_FILE = "fleet.json"
DEFAULT_FLEET = "fleet"


def fleets_root() -> Path:
    return state_dir() / "fleets"


@dataclass
class FleetMember:
    """One server of the fleet: a managed server's name (``managed``) or a remote URL."""

    name: str
    url: str
    managed: bool = True


@dataclass
class FleetSpec:
    name: str
    members: list[FleetMember]
    gateway: GatewaySpec
    created: float = field(default_factory=time.time)

    @classmethod
    def from_dict(cls, data: dict) -> "FleetSpec":
        return cls(name=data["name"], members=[FleetMember(**m) for m in data["members"]],
                   gateway=GatewaySpec(**data["gateway"]), created=data.get("created", 0.0))


class FleetState:
    """The files of one fleet."""

    def __init__(self, name: str = DEFAULT_FLEET, root: Path | None = None) -> None:
        if not plain_name(name):
            raise ValueError(f"bad fleet name {name!r}")
        self.name = name
        self.directory = (root or fleets_root()) / name

    @property
    def gateway(self) -> GatewayProcess:
        return GatewayProcess(self.directory)

    def spec(self) -> FleetSpec | None:
        try:
            return FleetSpec.from_dict(json.loads((self.directory / SPEC_FILE).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, spec: FleetSpec) -> None:
        private_dir(self.directory)  # 0700: it holds the gateway's control-plane key
        write_private(self.directory / SPEC_FILE, json.dumps(asdict(spec), indent=2))


def fleet_for(url: str) -> FleetState | None:
    """The fleet whose running gateway fronts the server at ``url`` (for ``apcctl restart``,
    which must take such a server out of the gateway first: ``apcctl.core.roll``)."""
    root = fleets_root()
    wanted = url.rstrip("/")
    for path in sorted(root.glob(f"*/{SPEC_FILE}")) if root.is_dir() else []:
        state = FleetState(path.parent.name)
        spec = state.spec()
        if spec and state.gateway.process() and any(m.url.rstrip("/") == wanted for m in spec.members):
            return state
    return None
