"""``apcctl bench fleet-roll``: what a roll and a removed server cost a fleet (issue 38).

A real fleet (``apcctl fleet up``: N servers, smg ``cache_aware`` behind the guard) in a private
state directory; the agent trace goes through the gateway three times, each run its own tenant:
undisturbed; with ``apcctl fleet restart`` started once a quarter of its requests are answered (the
roll, one server after the other, then sits in the middle of the run); with one server taken out
of the gateway and stopped half-way (a server removed from the fleet). Per
run: the prompt tokens the servers prefilled (``prompt - cached`` from each answer's ``usage``)
against the undisturbed run, client errors, and whether every answer equals a cold server's (the
same messages sent straight to a server under a fresh tenant). ``shared=False`` starts the fleet
with ``APC_SHARED_DISK_PATH=`` (each server's cache private): the comparison the shared disk tier
is measured against.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import free_port
from apcctl.fleet.traffic import TraceResult, replay

FLEET = "rollbench"
SCENARIOS = ("undisturbed", "fleet restart", "one server removed")


def _apcctl(env: dict[str, str], *args: str, timeout: float = 900.0) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", "from apcctl.cli import main; main()", *args, "--json"],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"apcctl {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout) if done.stdout.strip() else {}


def _ports(count: int) -> int:
    """The first of ``count`` consecutive ports nothing listens on (a small race remains)."""
    from apcctl.core.hosts import port_busy

    for _ in range(50):
        first = free_port()
        if first + count < 65535 and not any(port_busy("127.0.0.1", first + i) for i in range(count)):
            return first
    raise RuntimeError("no run of free ports")


class Fleet:
    """The bench's fleet, through the real CLI, in ``root``."""

    def __init__(self, root: Path, model: str, servers: int, shared: bool) -> None:
        self.root, self.model, self.count = root, model, servers
        self.env = {**os.environ, "APC_STATE_DIR": str(root / "state"), "XDG_CONFIG_HOME": str(root / "xdg"),
                    "HF_HUB_OFFLINE": "1"}
        port = _ports(servers + 1)
        args = ["fleet", "up", "--name", FLEET, "--servers", str(servers), "--model", model, "--port", str(port),
                "-e", "APC_TENANT_FROM_USER=1", "-e", "APC_SHARED_DISK_SCAN_MS=250", "--gateway-arg=--disable-retries"]
        self.info = _apcctl(self.env, *args, *([] if shared else ["-e", "APC_SHARED_DISK_PATH="]))
        self.url = self.info["url"]
        self.servers = [(s["server"], s["url"]) for s in self.info["servers"]]
        self.removed: set[str] = set()

    def admin(self, name: str, url: str) -> AdminClient:
        from apcctl.core.manage import ManagedServer

        return AdminClient(url, ManagedServer(name, self.root / "state" / "servers").token(), timeout=30.0)

    def answered(self) -> int:
        total = 0
        for name, url in self.servers:
            try:
                total += self.admin(name, url).status().hits.requests
            except (AdminError, OSError):
                pass
        return total

    def restart(self) -> None:
        _apcctl(self.env, "fleet", "restart", "--name", FLEET, "--grace", "30")

    def remove_last(self) -> None:
        """Out of the gateway, then stopped (SIGTERM: it flushes): a server removed from the fleet."""
        from apcctl.core.fleet_state import FleetState

        name, url = self.servers[-1]
        saved = os.environ.get("APC_STATE_DIR")
        os.environ["APC_STATE_DIR"] = self.env["APC_STATE_DIR"]  # the fleet's key file
        try:
            gateway = FleetState(FLEET).gateway.client(self.url, timeout=10.0)
            worker = gateway.worker_for(url)
            if worker is not None:
                gateway.remove_worker(str(worker["id"]))
        finally:
            if saved is None:
                os.environ.pop("APC_STATE_DIR", None)
            else:
                os.environ["APC_STATE_DIR"] = saved
        _apcctl(self.env, "stop", "--server", name, "--grace", "30")
        self.removed.add(name)

    def cold_mismatches(self, result: TraceResult, max_tokens: int) -> int:
        """Answers that differ from a cold server's (the same messages, a fresh tenant, straight to a server)."""
        name, url = next((n, u) for n, u in self.servers if n not in self.removed)
        client = self.admin(name, url)
        differ = 0
        for sent in result.sent:
            cold = client.chat(sent.messages, model=self.model, max_tokens=max_tokens, temperature=0.0,
                               user=f"cold-{uuid.uuid4().hex[:8]}", timeout=300)
            if cold["choices"][0]["message"]["content"] != sent.answer["choices"][0]["message"]["content"]:
                differ += 1
        return differ

    def down(self) -> None:
        try:
            _apcctl(self.env, "fleet", "down", "--name", FLEET, "--grace", "30")
        finally:
            for name, _ in self.servers:
                subprocess.run([sys.executable, "-c", "from apcctl.cli import main; main()", "stop", "--server", name],
                               env=self.env, capture_output=True, timeout=120)


def run_roll_bench(model: str, *, servers: int = 3, requests: int = 24, agents: int = 3, max_tokens: int = 8,
                   shared: bool = True, on_progress: Callable[[str], None] = lambda _: None,
                   root: Path | None = None) -> list[dict[str, Any]]:
    root = root or Path(tempfile.mkdtemp(prefix="apcctl-bench-roll-"))
    fleet = Fleet(root, model, servers, shared)
    rows: list[dict[str, Any]] = []
    try:
        on_progress(f"fleet up: {fleet.url} in front of {', '.join(u for _, u in fleet.servers)}")
        for label in SCENARIOS:
            disrupt = {"fleet restart": fleet.restart, "one server removed": fleet.remove_last}.get(label)
            errors: list[str] = []
            began, window = time.monotonic(), []
            # the roll (one server after the other) starts at a quarter so that it sits in the middle
            share = 4 if label == "fleet restart" else 2
            watcher = threading.Thread(target=_part_way, args=(fleet, requests // share, disrupt, errors, window),
                                       daemon=True)
            if disrupt is not None:
                watcher.start()
            result = replay(fleet.url, model=model, requests=requests, max_tokens=max_tokens,
                            tenant=f"roll-{label.replace(' ', '-')}", agents=agents)
            ended = time.monotonic() - began
            if disrupt is not None:
                watcher.join(900)
            prefilled = result.prompt_tokens - result.cached_tokens
            base = rows[0]["prefilled_tokens"] if rows else prefilled
            rows.append({"scenario": label, "shared_disk": shared, "requests": len(result.sent),
                         "client_errors": result.failed, "prompt_tokens": result.prompt_tokens,
                         "cached_tokens": result.cached_tokens, "prefilled_tokens": prefilled,
                         "vs_undisturbed": round(prefilled / base - 1, 4) if base else None,
                         "differ_from_cold": fleet.cold_mismatches(result, max_tokens), "disruption_errors": errors,
                         # seconds from the run's start: when the disruption began and ended, when the trace ended
                         "disruption_s": [round(t - began, 1) for t in window], "run_s": round(ended, 1)})
            on_progress(f"{label}: prefilled {prefilled} ({rows[-1]['vs_undisturbed']:+.1%}), "
                        f"{result.failed} client errors, {rows[-1]['differ_from_cold']} differ from cold")
    finally:
        fleet.down()
    return rows


def _part_way(fleet: Fleet, answered: int, disrupt: Callable[[], None], errors: list[str],
              window: list[float]) -> None:
    """Run ``disrupt`` once ``answered`` of the run's requests are answered; ``window``: when it began and ended."""
    start = fleet.answered()
    deadline = time.monotonic() + 900
    while fleet.answered() - start < answered and time.monotonic() < deadline:
        time.sleep(0.2)
    window.append(time.monotonic())
    try:
        disrupt()
    except Exception as exc:  # reported in the row, never hidden
        errors.append(f"{type(exc).__name__}: {exc}")
    window.append(time.monotonic())
