"""The gateway's view of each worker (``GET /workers``) beside each server's own ``/admin/status``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from apcctl.client import AdminError
from apcctl.config import ConfigError, load_config, resolve
from apcctl.fleet.gateway import GatewayClient
from apcctl.fleet.state import FleetState

WORKER_KEYS = ("id", "status", "is_healthy", "load")


def server_view(name: str, url: str, config_path: Path | None = None) -> dict[str, Any]:
    """Hit ratio, in flight and draining from one server's /admin/status (or why not)."""
    from apcctl.commands.status import hit_summary

    try:
        target = resolve(name, None, load_config(config_path))
    except ConfigError:
        target = resolve(url, None, load_config(config_path))
    try:
        body = target.client(timeout=5.0).status()
    except AdminError as exc:
        return {"reachable": False, "error": exc.message}
    idle = body.get("idle") or {}
    hits = hit_summary((body.get("lineage") or {}).get("stats", {}))
    return {"reachable": True, "pid": body["server"].get("pid"), "in_flight": idle.get("in_flight"),
            "draining": idle.get("draining"), "requests": hits["requests"], "hit_rate": hits["hit_rate"],
            "token_hit_rate": hits["token_hit_rate"]}


def fleet_status(state: FleetState, config_path: Path | None = None) -> dict[str, Any]:
    """One object per member (and per gateway worker no member names): both views side by side."""
    spec = state.spec()
    if spec is None:
        raise FileNotFoundError(f"no fleet {state.name!r} (apcctl fleet up)")
    process = state.gateway.process()
    gateway: dict[str, Any] = {"url": spec.gateway.url, "policy": spec.gateway.policy,
                               "pid": process.pid if process else None, "log": str(state.gateway.log_path)}
    workers: list[dict[str, Any]] = []
    try:
        workers = GatewayClient(spec.gateway.url, None, timeout=5.0).workers()
        gateway["reachable"] = True
    except AdminError as exc:
        gateway.update(reachable=False, error=exc.message)
    by_url = {str(w.get("url", "")).rstrip("/"): w for w in workers}
    rows = []
    for member in spec.members:
        worker = by_url.pop(member.url.rstrip("/"), None)
        rows.append({"server": member.name, "url": member.url, "managed": member.managed,
                     "gateway": {k: worker.get(k) for k in WORKER_KEYS} if worker else None,
                     "status": server_view(member.name, member.url, config_path)})
    for url, worker in by_url.items():  # added to the gateway by hand
        rows.append({"server": None, "url": url, "managed": False, "gateway": {k: worker.get(k) for k in WORKER_KEYS},
                     "status": server_view(url, url, config_path)})
    ready = sum(1 for r in rows if r["gateway"] and r["gateway"]["status"] == "ready" and r["gateway"]["is_healthy"])
    return {"fleet": state.name, "gateway": gateway, "ready_workers": ready, "workers": rows}
