"""``fleet up`` and ``fleet down``: the servers first, then the gateway in front of them; the
gateway first, then the servers, on the way down (no request is sent to a stopping server).
``fleet down --server``: one server flushed, out of the gateway, stopped, and off the fleet's list.

Fail closed: when a server or the gateway does not come up, everything this call started is
stopped again, and the error says which part failed, with its log tail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from apcctl.core.fleet_state import FleetSpec, FleetState
from apcctl.core.gateway import GatewayError
from apcctl.core.manage import ManagedServer, ManageError, ServerSpec, StopResult

if TYPE_CHECKING:
    from apcctl.config import Target

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


@dataclass(frozen=True)
class Removed:
    server: str
    left_gateway: bool  # False: no gateway was running, so none routed to it
    result: StopResult | None  # None: a server the fleet fronts but did not start (left running)


def remove(state: FleetState, target: Target, *, grace: float = STOP_GRACE_S, timeout: float = 300.0,
           on_progress: Progress = lambda _: None) -> Removed:
    """Take one server out of the fleet: flushed while it still serves and out of the gateway (as
    ``fleet restart`` does, so the sessions smg moves restore from its files in the shared tier),
    stopped (SIGTERM: it flushes again), then off ``fleet.json`` (a later ``fleet up`` or ``fleet
    restart`` leaves it alone). Its files stay for its peers until the shared tier's retention.
    A gateway that runs but cannot take it out is an error, and the server is left serving."""
    from apcctl.core.roll import leave_gateway

    spec = state.spec()
    member = next((m for m in spec.members if m.name == target.name), None) if spec else None
    if spec is None or member is None:
        raise FleetError(f"{target.name!r} is not a server of fleet {state.name!r}")
    running = state.gateway.process() is not None
    if running:
        gateway = state.gateway.client(spec.gateway.url, timeout=10.0)
        leave_gateway(gateway, target, timeout=timeout,
                      on_progress=lambda step: on_progress(f"{step.phase} {step.message}".strip()))
    result = None
    if member.managed:
        on_progress(f"stopping (SIGTERM: it flushes; SIGKILL after {grace:.0f} s)")
        result = ManagedServer(member.name).stop(grace)
    state.save(replace(spec, members=[m for m in spec.members if m is not member],
                       gateway=replace(spec.gateway, worker_urls=[u for u in spec.gateway.worker_urls
                                                                  if u != member.url])))
    return Removed(member.name, running, result)
