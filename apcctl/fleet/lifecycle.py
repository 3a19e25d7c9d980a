"""``fleet up`` and ``fleet down``: the servers first, then the gateway in front of them; the
gateway first, then the servers, on the way down (no request is sent to a stopping server).

Fail closed: when a server or the gateway does not come up, everything this call started is
stopped again, and the error says which part failed, with its log tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from apcctl.core.fleet_state import FleetSpec, FleetState
from apcctl.core.gateway import GatewayError
from apcctl.core.manage import ManagedServer, ManageError, ServerSpec, StopResult

Progress = Callable[[str], None]
STOP_GRACE_S = 30.0  # a fleet's servers flush on SIGTERM; `fleet down --grace` overrides


class FleetError(RuntimeError):
    """The fleet could not be started or stopped; the message says which part and why."""


@dataclass(frozen=True)
class Stopped:
    part: str  # "gateway" or a server's name
    result: StopResult


def up(state: FleetState, spec: FleetSpec, server_specs: dict[str, ServerSpec], *, timeout: float = 300.0,
       on_progress: Progress = lambda _: None, servers_root: Path | None = None) -> list[dict]:
    """Start the managed members that are not running (all at once), wait for each, then the
    gateway, and wait until it lists every member as ready. Returns the gateway's workers."""
    running = state.gateway.process()
    if running is not None:
        raise FleetError(f"fleet {state.name!r} is already up (gateway pid {running.pid}); "
                         f"apcctl fleet down --name {state.name}")
    started: list[ManagedServer] = []
    try:
        for member in spec.members:
            server = ManagedServer(member.name, servers_root)
            if member.managed and server.pid() is None:
                on_progress(f"{member.name}: starting at {member.url}")
                server.start(server_specs[member.name])
                started.append(server)
        for server in started:
            server.wait_ready(timeout)
            on_progress(f"{server.name}: ready")
        state.save(spec)
        on_progress(f"gateway: smg launch at {spec.gateway.url}, policy {spec.gateway.policy}")
        state.gateway.start(spec.gateway)
        client = state.gateway.client(spec.gateway.url)
        workers = client.wait_ready([m.url for m in spec.members], timeout, state.gateway)
        on_progress(f"gateway: {len(workers)} workers ready")
        return workers
    except (ManageError, GatewayError, OSError) as exc:
        state.gateway.stop(grace=5.0)
        for server in started:
            server.stop(grace=STOP_GRACE_S)
        raise FleetError(f"fleet {state.name!r} did not come up: {exc}") from None


def down(state: FleetState, grace: float = STOP_GRACE_S, servers_root: Path | None = None) -> list[Stopped]:
    """Stop the gateway, then every managed member (SIGTERM: each flushes its cache to disk)."""
    spec = state.spec()
    stopped = [Stopped("gateway", state.gateway.stop())]
    for member in spec.members if spec else []:
        if member.managed:
            stopped.append(Stopped(member.name, ManagedServer(member.name, servers_root).stop(grace)))
    return stopped
