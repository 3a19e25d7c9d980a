"""The ``[fleet]`` table of the TOML config (the same file as ``[servers.*]``, see ``apcctl.config``)::

    [fleet]
    servers = ["a", "b", "c"]    # [servers.NAME] tables, started like `apcctl serve --server NAME`
    port = 30000                 # the gateway (smg) listens here
    host = "127.0.0.1"
    policy = "cache_aware"       # any `smg launch --policy`
    cache_boundaries = [2048, 8192]   # prefix_hash: hash the request head at these token positions
    gateway_args = ["--health-check-interval-secs", "5"]   # to `smg launch` unchanged
    metrics_port = 30001         # smg's Prometheus metrics, on 127.0.0.1 (default: a free port)
    name = "fleet"               # its state: <state dir>/fleets/NAME
    shared_disk_path = "~/apc-shared"   # the servers' shared disk tier (default: <fleet dir>/shared-disk)

A server table with a ``url`` on another machine and no ``model`` is fronted but not started.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apcctl.config import ConfigError, load_config
from apcctl.core.fleet_state import DEFAULT_FLEET
from apcctl.core.gateway import DEFAULT_POLICY, POLICIES
from apcctl.core.manage import plain_name

DEFAULT_GATEWAY_PORT = 30000
_KEYS = {"name", "servers", "port", "host", "policy", "cache_boundaries", "gateway_args", "metrics_port",
         "shared_disk_path"}


@dataclass(frozen=True)
class FleetConfig:
    servers: tuple[str, ...]
    name: str = DEFAULT_FLEET
    port: int = DEFAULT_GATEWAY_PORT
    host: str = "127.0.0.1"
    policy: str = DEFAULT_POLICY
    cache_boundaries: tuple[int, ...] = ()
    gateway_args: tuple[str, ...] = ()
    metrics_port: int = 0
    shared_disk_path: str | None = None  # None: <fleet dir>/shared-disk; "": each server's tier private


def load_fleet(path: Path | None = None) -> FleetConfig | None:
    """The ``[fleet]`` table of ``path`` (or the default config), None when there is none."""
    config = load_config(path)  # validates the [servers.*] tables and says which file is wrong
    if config.path is None:
        return None
    data = tomllib.loads(config.path.read_text(encoding="utf-8")).get("fleet")
    if data is None:
        return None
    return parse_fleet(data, config.path, set(config.servers))


def parse_fleet(table: Any, path: Path | str, known: set[str]) -> FleetConfig:
    where = f"{path}: [fleet]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    servers = table.get("servers")
    if not isinstance(servers, list) or not servers or not all(isinstance(s, str) for s in servers):
        raise ConfigError(f"{where} servers must be a non-empty list of [servers.*] names")
    missing = [s for s in servers if s not in known]
    if missing:
        raise ConfigError(f"{where} servers names no [servers.*] table: {missing}")
    if len(set(servers)) != len(servers):
        raise ConfigError(f"{where} servers lists a server twice")
    port, metrics_port = table.get("port", DEFAULT_GATEWAY_PORT), table.get("metrics_port", 0)
    for key, value, lowest in (("port", port, 1), ("metrics_port", metrics_port, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value < 65536:
            raise ConfigError(f"{where} {key} must be an integer port number")
    policy = table.get("policy", DEFAULT_POLICY)
    if policy not in POLICIES:
        raise ConfigError(f"{where} policy must be one of {POLICIES}")
    boundaries = table.get("cache_boundaries", [])
    if not isinstance(boundaries, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                   for b in boundaries):
        raise ConfigError(f"{where} cache_boundaries must be a list of positive token positions")
    args = table.get("gateway_args", [])
    if not isinstance(args, list):
        raise ConfigError(f"{where} gateway_args must be a list of strings")
    shared = table.get("shared_disk_path")
    if shared is not None and not isinstance(shared, str):
        raise ConfigError(f"{where} shared_disk_path must be a string (a directory)")
    name = table.get("name", DEFAULT_FLEET)
    if not plain_name(name):
        raise ConfigError(f"{where} name must be a plain name")
    return FleetConfig(servers=tuple(servers), name=name, port=port, host=str(table.get("host", "127.0.0.1")),
                       policy=policy, cache_boundaries=tuple(sorted(boundaries)),
                       gateway_args=tuple(str(a) for a in args), metrics_port=metrics_port,
                       shared_disk_path=shared)

