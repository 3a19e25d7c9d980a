"""The fleet view's data: each server of a fleet beside the gateway's state of it, and where the
recent requests went.

HTTP only, like the rest of the dashboard: the gateway's ``GET /workers`` (smg's worker API) and
each server's ``/admin/status`` and ``/admin/requests``. smg does not say which worker served a
request, but each server records the requests it served, so the newest ones of every server,
merged by time, say where each went. ``FleetSource`` is what the app polls (in its own
poll-render-reschedule loop beside the server's); ``LiveFleetSource`` asks the real fleet, and
``StaticFleetSource`` answers a fixed snapshot (tests, screenshots).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from apcctl.core.client import AdminClient, AdminError, hits_of
from apcctl.core.gateway import GatewayClient, worker_state
from tui.source import DashboardSource, LiveSource, SourceError
from tui.state import Keyed

if TYPE_CHECKING:
    from server_patch.admin.schema import Hits, RequestRecord, Status

RECENT = 40  # requests asked of each server; the pane lists the newest of all of them


@dataclass(frozen=True)
class FleetServer:
    """One server of the fleet: the gateway's view (``state``, ``load``) beside its own status."""

    name: str
    url: str
    state: str  # apcctl.core.gateway.STATES: healthy, draining, unhealthy, absent
    load: int | None = None
    # Its /admin/status (``schema.Status``; read by key, so a recorded or hand-made JSON status reads
    # the same); None when it does not answer.
    status: Status | dict[str, Any] | None = None
    error: str = ""

    @property
    def hits(self) -> Hits:
        return hits_of(self.status)

    @property
    def idle(self) -> dict[str, Any]:
        return (self.status or {}).get("idle") or {}

    @property
    def budgets(self) -> dict[str, Any]:
        status = self.status or {}
        return (status.get("lineage") or {}).get("budgets") or (status.get("sizing") or {}).get("budgets") or {}


@dataclass(frozen=True)
class FleetSnapshot:
    """One poll of the fleet; ``recent`` are request records, newest last, keyed by server and seq."""

    gateway: str
    policy: str
    servers: list[FleetServer]
    recent: list[Keyed] = field(default_factory=list)
    gateway_error: str = ""  # why GET /workers failed (every server then reads "absent")
    taken: float = 0.0

    @property
    def healthy(self) -> int:
        return sum(1 for s in self.servers if s.state == "healthy")


class FleetSource(Protocol):
    def snapshot(self) -> FleetSnapshot:
        """The fleet now; raises ``SourceError`` only when nothing at all can be asked."""
        ...

    # A source that can also give each server's own dashboard source has
    # ``source_for(name) -> DashboardSource | None``: the Fleet tab's server picker (Enter on a row).


@dataclass(frozen=True)
class StaticFleetSource:
    """Always the same snapshot."""

    fixed: FleetSnapshot

    def snapshot(self) -> FleetSnapshot:
        return self.fixed


class LiveFleetSource:
    """A running fleet: its gateway and its servers (name and admin client each), asked in parallel.
    ``key``: the gateway's control-plane key (``GatewayProcess.key``), without which smg lists nothing."""

    def __init__(self, gateway: str, policy: str, members: Sequence[tuple[str, AdminClient]],
                 key: str | None = None) -> None:
        self.gateway = GatewayClient(gateway, key, timeout=5.0)
        self.policy = policy
        self.members = list(members)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.members) + 1), thread_name_prefix="apcctl-fleet")

    def source_for(self, name: str) -> DashboardSource | None:
        client = next((c for n, c in self.members if n == name), None)
        return None if client is None else LiveSource(client)

    def snapshot(self) -> FleetSnapshot:
        workers_future = self._pool.submit(self.gateway.workers)
        asked = [self._pool.submit(_ask, client) for _, client in self.members]
        try:
            workers, gateway_error = {_key(w.get("url", "")): w for w in workers_future.result()}, ""
        except AdminError as exc:
            workers, gateway_error = {}, exc.message
        servers, recent = [], []
        for (name, client), future in zip(self.members, asked):
            status, records, error = future.result()
            worker = workers.get(_key(client.base_url))
            servers.append(FleetServer(name, client.base_url.rstrip("/"), worker_state(worker),
                                       worker.get("load") if worker else None, status, error))
            pid = status.server.pid if status is not None else None
            recent += [Keyed(f"{name}:{pid}:{r.seq}", {**r.to_json(), "server": name}) for r in records]
        if gateway_error and all(s.status is None for s in servers):
            raise SourceError(f"neither the gateway nor any server answers: {gateway_error}")
        recent.sort(key=lambda k: k.data.get("started") or 0.0)
        return FleetSnapshot(self.gateway.base_url.rstrip("/"), self.policy, servers, recent, gateway_error,
                             time.time())


def busiest(fleet: FleetSnapshot) -> str | None:
    """The server that answered the most requests (where the gateway sent the traffic; the first
    of a tie), None when none answers: what ``fleet top`` opens on without ``--server``."""
    answered = [s for s in fleet.servers if s.status is not None]
    return max(answered, key=lambda s: s.hits.requests).name if answered else None


def _ask(client: AdminClient) -> tuple[Status | None, list[RequestRecord], str]:
    try:
        status = client.status()
        records = client.requests(limit=RECENT) if status.started else []
        return status, records, ""
    except AdminError as exc:
        return None, [], exc.message


def _key(url: Any) -> str:
    return str(url).rstrip("/")
