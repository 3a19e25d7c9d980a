"""The gateway's view of each worker (``GET /workers``) beside each server's own ``/admin/status``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from apcctl.config import ConfigError, load_config, resolve
from apcctl.core.client import AdminError
from apcctl.core.fleet_state import SPEC_FILE, FleetState, fleets_root
from apcctl.core.gateway import worker_state

WORKER_KEYS = ("id", "status", "is_healthy", "load")


def _key(url: str) -> str:
    return url.rstrip("/")


def gateway_views(urls: Iterable[str], root: Path | None = None) -> dict[str, dict[str, Any]]:
    """For each of ``urls`` that a fleet fronts: the fleet, its gateway and the worker's state there.

    One ``GET /workers`` per fleet, so ``apcctl status --all`` and the dashboard ask each gateway
    once per refresh. A url no fleet names is not in the answer."""
    wanted = {_key(u) for u in urls}
    root = root or fleets_root()
    views: dict[str, dict[str, Any]] = {}
    for path in sorted(root.glob(f"*/{SPEC_FILE}")) if root.is_dir() else []:
        state = FleetState(path.parent.name, root)
        spec = state.spec()
        members = [m for m in spec.members if _key(m.url) in wanted] if spec else []
        if not members:
            continue
        workers, error = _workers(state, spec.gateway.url)
        for member in members:
            worker = workers.get(_key(member.url))
            views[_key(member.url)] = {
                "fleet": state.name, "gateway": spec.gateway.url, "state": worker_state(worker),
                "worker_id": worker.get("id") if worker else None, "load": worker.get("load") if worker else None,
                **({"error": error} if error else {})}
    return views


def _workers(state: FleetState, url: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    if state.gateway.process() is None:
        return {}, "the gateway is not running"
    try:
        return {_key(str(w.get("url", ""))): w for w in state.gateway.client(url).workers()}, None
    except AdminError as exc:
        return {}, exc.message


def server_view(name: str, url: str, config_path: Path | None = None) -> dict[str, Any]:
    """Hit ratio, in flight and draining from one server's /admin/status (or why not)."""

    try:
        target = resolve(name, None, load_config(config_path))
    except ConfigError:
        target = resolve(url, None, load_config(config_path))
    try:
        body = target.client(timeout=5.0).status()
    except AdminError as exc:
        return {"reachable": False, "error": exc.message}
    idle, hits = body.idle, body.hits
    return {"reachable": True, "pid": body.server.pid, "in_flight": idle.in_flight,
            "draining": idle.draining, "requests": hits.requests, "hit_rate": hits.hit_rate,
            "token_hit_rate": hits.token_hit_rate}


def fleet_status(state: FleetState, config_path: Path | None = None) -> dict[str, Any]:
    """One object per member (and per gateway worker no member names): both views side by side.

    A worker the fleet did not name (``in_fleet`` false, listed in ``foreign_workers``) was added to
    the gateway by something else: smg routes prompts to it like to the fleet's own servers."""
    spec = state.spec()
    if spec is None:
        raise FileNotFoundError(f"no fleet {state.name!r} (apcctl fleet up)")
    process = state.gateway.process()
    gateway: dict[str, Any] = {"url": spec.gateway.url, "policy": spec.gateway.policy,
                               "pid": process.pid if process else None, "log": str(state.gateway.log_path)}
    workers: list[dict[str, Any]] = []
    try:
        workers = state.gateway.client(spec.gateway.url).workers()
        gateway["reachable"] = True
    except AdminError as exc:
        gateway.update(reachable=False, error=exc.message)
    by_url = {str(w.get("url", "")).rstrip("/"): w for w in workers}
    rows = []
    for member in spec.members:
        worker = by_url.pop(member.url.rstrip("/"), None)
        rows.append({"server": member.name, "url": member.url, "managed": member.managed, "in_fleet": True,
                     "state": worker_state(worker),
                     "gateway": {k: worker.get(k) for k in WORKER_KEYS} if worker else None,
                     "status": server_view(member.name, member.url, config_path)})
    for url, worker in by_url.items():  # added to the gateway by someone else
        rows.append({"server": None, "url": url, "managed": False, "in_fleet": False, "state": worker_state(worker),
                     "gateway": {k: worker.get(k) for k in WORKER_KEYS},
                     "status": server_view(url, url, config_path)})
    ready = sum(1 for r in rows if r["state"] == "healthy")
    return {"fleet": state.name, "gateway": gateway, "ready_workers": ready, "workers": rows,
            "foreign_workers": sorted(by_url)}
