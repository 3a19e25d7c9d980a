"""The gateway process: ``smg launch`` in front of the servers, and its worker API (``GatewayClient``,
and ``worker_state``: what the gateway does with one server, for status, the roll and the dashboard).

smg is a Rust router shipped in a wheel (``pip install 'apcctl[fleet]'``). The fleet runs it through
``apcctl.fleet.launch``: smg on a private loopback port with a control-plane key, and the Host/Origin
guard (``apcctl.fleet.guard``) on the gateway's public port, in one process known by PID and create
time like a managed server, never by name. The key is made at each start, kept 0600 beside the PID
file, and sent by every ``GatewayClient`` the fleet's commands make (``GatewayProcess.client``).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import free_port
from server_patch.private_files import private_dir
from apcctl.core.manage import (BackgroundFiles, StopResult, pid_file_owner, same_process, stop_recorded,
                                write_pid_file, write_private)

SMG_VERSION = "1.13.0"  # the version pinned in the 'fleet' extra; flags below are checked against it
# smg's policies that make sense for HTTP workers (see `smg launch --help`).
POLICIES = ("cache_aware", "prefix_hash", "consistent_hashing", "round_robin", "random", "power_of_two",
            "least_load")
# Chosen by `apcctl bench fleet` (docs/fleet.md): see DEFAULT_POLICY_WHY there.
DEFAULT_POLICY = "cache_aware"
ROUTING_KEY_HEADER = "x-smg-routing-key"
PID_FILE = "gateway.pid"
LOG_FILE = "gateway.log"
KEY_FILE = "control-plane.key"  # 0600: smg's admin key for /workers (add, remove, even list)
# smg drains in-flight requests on SIGTERM for up to its shutdown grace (default 180 s).
GATEWAY_GRACE_S = 30.0
# Registration polls a worker every this many seconds (smg's default of 30 makes `up` slow).
STARTUP_CHECK_S = 1
# smg logs two lines per request at "info"; its own log is not rotated while it runs, so the
# gateway logs warnings and errors (--gateway-arg=--log-level --gateway-arg=info for more), and
# gateway.log is rotated at each start like server.log.
LOG_LEVEL = "warn"
# What the gateway does with a server, in one word: it routes to it (healthy), finishes what it sent
# there and sends nothing new (draining), lists it but does not route to it (unhealthy), or does not
# list it at all (absent: out of rotation, e.g. mid-restart, or the gateway is down).
STATES = ("healthy", "draining", "unhealthy", "absent")


class GatewayError(RuntimeError):
    """The gateway could not be found, started, stopped or asked; the message says why."""


def require_smg() -> None:
    """smg must be importable by this Python: the gateway process runs its router in-process."""
    if importlib.util.find_spec("smg") is None:
        raise GatewayError("smg (the SGLang Model Gateway) is not installed: pip install 'apcctl[fleet]'")


@dataclass
class GatewaySpec:
    """How the gateway is started: written to the fleet's state so ``status`` shows it."""

    port: int
    worker_urls: list[str]
    host: str = "127.0.0.1"
    policy: str = DEFAULT_POLICY
    cache_boundaries: list[int] = field(default_factory=list)
    args: list[str] = field(default_factory=list)  # passed to `smg launch` unchanged
    # smg serves Prometheus metrics on a second port, by default 0.0.0.0:29000: two gateways on one
    # machine would collide, and the metrics would face the network. Loopback, a port of our own.
    metrics_port: int = 0  # 0: a free one, chosen when the spec is made (free_port)
    metrics_host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, key_file: Path) -> list[str]:
        """The guard on ``host:port``, smg behind it on a free loopback port (``apcctl.fleet.launch``)."""
        if self.policy not in POLICIES:
            raise GatewayError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
        listen = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        argv = [sys.executable, "-m", "apcctl.fleet.launch", "--listen", listen, "--upstream-port", str(free_port()),
                "--key-file", str(key_file), "--",
                "--policy", self.policy, "--worker-startup-check-interval", str(STARTUP_CHECK_S),
                "--prometheus-host", self.metrics_host, "--prometheus-port", str(self.metrics_port or free_port()),
                "--log-level", LOG_LEVEL]
        if self.worker_urls:
            argv += ["--worker-urls", *self.worker_urls]
        if self.cache_boundaries:
            argv += ["--cache-boundaries", ",".join(str(b) for b in self.cache_boundaries)]
        return argv + list(self.args)


class GatewayProcess(BackgroundFiles):
    """The gateway's PID file (PID and create time) and log in ``directory``, and its verbs."""

    pid_file, log_file = PID_FILE, LOG_FILE

    @property
    def key_path(self) -> Path:
        return self.directory / KEY_FILE

    def key(self) -> str | None:
        """The control-plane key of the running (or last) gateway; None when there is none."""
        try:
            return self.key_path.read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def client(self, url: str, timeout: float = 5.0) -> "GatewayClient":
        """smg's worker API at ``url``, with this gateway's control-plane key."""
        return GatewayClient(url, self.key(), timeout=timeout)

    def process(self) -> psutil.Process | None:
        owner = pid_file_owner(self.pid_path)
        if owner is None or owner[1] is None:
            return None
        return owner[0] if same_process(owner[0], owner[1]) else None

    def start(self, spec: GatewaySpec) -> int:
        running = self.process()
        if running is not None:
            raise GatewayError(f"the gateway is already running (pid {running.pid})")
        require_smg()
        private_dir(self.directory)
        write_private(self.key_path, secrets.token_urlsafe(32))  # a new key per start: an old one is void
        argv = spec.argv(self.key_path)
        env = {**os.environ, "NO_COLOR": "1"}
        with self.open_log("fleet gateway", argv) as log:
            process = subprocess.Popen(argv, env=env, cwd=self.directory, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        write_pid_file(self.pid_path, process.pid)
        return process.pid

    def stop(self, grace: float = GATEWAY_GRACE_S) -> StopResult:
        return stop_recorded(self.pid_path, self.process(), grace)


class GatewayClient(AdminClient):
    """smg's worker API; the fleet's gateway answers it only with the control-plane key as token."""

    def workers(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/workers").get("workers", []))

    def add_worker(self, url: str) -> dict[str, Any]:
        return self._request("POST", "/workers", {"url": url})

    def remove_worker(self, worker_id: str) -> dict[str, Any]:
        """smg drains the worker (status ``draining``) and then removes it."""
        return self._request("DELETE", f"/workers/{urllib.parse.quote(worker_id, safe='')}")

    def worker_for(self, url: str) -> dict[str, Any] | None:
        wanted = url.rstrip("/")
        return next((w for w in self.workers() if str(w.get("url", "")).rstrip("/") == wanted), None)

    def wait_ready(self, urls: list[str], timeout: float = 120.0,
                   process: GatewayProcess | None = None) -> list[dict[str, Any]]:
        """Wait until every one of ``urls`` is a ready, healthy worker; fail early if smg exits."""
        wanted = {u.rstrip("/") for u in urls}
        deadline = time.monotonic() + timeout
        while True:
            if process is not None and process.process() is None:
                raise GatewayError(f"the gateway exited during start-up; log tail:\n{process.log_tail(20)}")
            try:
                workers = self.workers()
                ready = {str(w.get("url", "")).rstrip("/") for w in workers if is_ready(w)}
                if wanted <= ready:
                    return workers
            except AdminError:
                pass
            if time.monotonic() > deadline:
                raise GatewayError(f"the gateway at {self.base_url} did not list {sorted(wanted)} as ready "
                                   f"within {timeout:.0f} s")
            time.sleep(0.2)


def is_ready(worker: dict[str, Any]) -> bool:
    return worker.get("status") == "ready" and bool(worker.get("is_healthy", True))


def worker_state(worker: dict[str, Any] | None) -> str:
    """One of ``STATES`` for smg's ``GET /workers`` entry of a server (None: not listed)."""
    if worker is None:
        return "absent"
    if worker.get("status") == "draining":
        return "draining"
    return "healthy" if is_ready(worker) else "unhealthy"
