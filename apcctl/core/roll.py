"""Rolling restart of a fleet through its gateway: no client of the gateway sees a 503.

For each server, one after the other: flush its cache to disk while it still serves (its
sessions, moved to the others, restore from the shared disk tier), take it out of the gateway (``DELETE /workers/{id}``: smg
stops routing to it and lets its requests finish), wait until smg no longer lists it, then the
single-server steps of ``apcctl.core.restart.rolling_restart`` (drain, wait idle, flush, stop, start,
probe; a failure rolls that server back), then put it back (``POST /workers``) and wait until
smg lists it as ready. The first failure stops the roll; a server that still answers ``/health``
after a failure (undrained or rolled back) is put back in the gateway first, so the fleet does
not stay a server short.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from apcctl.core.client import AdminError
from apcctl.core.fleet_state import fleet_for
from apcctl.core.gateway import GatewayClient, GatewayError
from apcctl.core.restart import Phase, Progress, RestartResult, RestartStep, ServerRestart, rolling_restart

if TYPE_CHECKING:
    from apcctl.config import Target


def fleet_restart(gateway: GatewayClient, targets: Sequence[Target], *, on_progress: Progress,
                  timeout: float = 300.0, grace: float | None = None, force: bool = False) -> RestartResult:
    """Restart ``targets`` (servers behind ``gateway``) one at a time; see the module docstring."""
    done: list[ServerRestart] = []
    for n, target in enumerate(targets):
        try:
            leave_gateway(gateway, target, on_progress=on_progress, timeout=timeout)
        except (GatewayError, AdminError) as exc:
            failed = ServerRestart(target.name, phase=Phase.FAILED, message=f"gateway: {exc}")
            on_progress(RestartStep(target.name, Phase.FAILED, message=failed.message))
            return RestartResult(False, False, done + [failed] + _untouched(targets[n + 1:]))
        result = rolling_restart([target], on_progress=on_progress, timeout=timeout, grace=grace, force=force)
        server = result.servers[0]
        try:
            _back_in_rotation(gateway, target, on_progress, timeout)
        except (GatewayError, AdminError) as exc:
            server.ok = False
            server.warnings.append(f"could not put {target.url} back in the gateway: {exc}")
            on_progress(RestartStep(target.name, Phase.FAILED, message=server.warnings[-1]))
        done.append(server)
        if not server.ok:
            return RestartResult(False, False, done + _untouched(targets[n + 1:]))
    return RestartResult(True, False, done)


def restart_targets(targets: Sequence[Target], *, on_progress: Progress, timeout: float = 300.0,
                    grace: float | None = None, force: bool = False, **direct: Any) -> RestartResult:
    """``apcctl restart``: one roll over ``targets`` in order. A server behind a running fleet's
    gateway goes through the gateway (``fleet_restart``), so the fleet's clients never get a
    503; any other server is restarted directly (``rolling_restart``, with ``direct``'s
    options). The first failure stops the roll; later servers are untouched."""
    done: list[ServerRestart] = []
    for n, target in enumerate(targets):
        fleet = fleet_for(target.url)
        spec = fleet.spec() if fleet is not None else None
        if spec is not None:
            gateway = fleet.gateway.client(spec.gateway.url, timeout=10.0)
            result = fleet_restart(gateway, [target], on_progress=on_progress, timeout=timeout, grace=grace,
                                   force=force)
        else:
            result = rolling_restart([target], on_progress=on_progress, timeout=timeout, grace=grace,
                                     force=force, **direct)
        done.extend(result.servers)
        if not result.ok:
            return RestartResult(False, False, done + _untouched(targets[n + 1:]))
    return RestartResult(True, False, done)


def leave_gateway(gateway: GatewayClient, target: Target, *, on_progress: Progress, timeout: float = 300.0) -> None:
    """Flush ``target`` while it still serves, then take it out of the gateway and wait until smg
    no longer lists it: a roll's first steps, and ``fleet down --server``'s before the stop."""
    _flush_before_leaving(target, on_progress, timeout)
    _out_of_rotation(gateway, target, on_progress, timeout)


def _untouched(targets: Sequence[Target]) -> list[ServerRestart]:
    return [ServerRestart(t.name, message="not restarted: an earlier server failed") for t in targets]


def _flush_before_leaving(target: Target, on_progress: Progress, timeout: float) -> None:
    """Write what RAM holds while the server still serves (issue 38): the sessions smg moves to
    the others when it leaves restore from its files (the shared disk tier) instead of starting
    cold. The flush after the drain (``rolling_restart``) still writes what changed since, and
    decides whether the stop may go on; a failure here only costs the moved sessions' hits."""
    on_progress(RestartStep(target.name, Phase.FLUSHING, message="writing RAM entries before leaving the gateway"))
    try:
        target.client(timeout=30.0).flush(timeout=min(timeout, 600.0))
    except AdminError as exc:
        on_progress(RestartStep(target.name, Phase.FLUSHING, message=f"flush before leaving failed: {exc}"))


def _out_of_rotation(gateway: GatewayClient, target: Target, on_progress: Progress, timeout: float) -> None:
    worker = gateway.worker_for(target.url)
    if worker is None:
        raise GatewayError(f"{target.url} is not a worker of the gateway at {gateway.base_url}")
    on_progress(RestartStep(target.name, Phase.DRAINING, message=f"out of the gateway (worker {worker['id']}); "
                            "smg finishes its requests there and sends new ones to the other servers"))
    gateway.remove_worker(str(worker["id"]))
    deadline = time.monotonic() + timeout
    while gateway.worker_for(target.url) is not None:
        if time.monotonic() > deadline:
            raise GatewayError(f"the gateway still lists {target.url} after {timeout:.0f} s")
        time.sleep(0.25)


def _back_in_rotation(gateway: GatewayClient, target: Target, on_progress: Progress, timeout: float) -> None:
    try:
        target.client(timeout=5.0).health()
    except AdminError:
        return  # nothing answers there: it stays out of the gateway, and the failure says why
    gateway.add_worker(target.url)
    gateway.wait_ready([target.url], timeout)
    on_progress(RestartStep(target.name, Phase.DONE, message="back in the gateway, ready"))
