"""``apcctl bench fleet-roll``: what a roll and a removed server cost a fleet (issue 38).

A real fleet (``apcctl fleet up``: N servers, smg ``cache_aware`` behind the guard, retries off) in
a private state directory per disk tier: ``shared`` (the fleet's shared disk tier, the default)
and ``private`` (``--shared-disk-path ''``: each server's cache its own, what sharing is measured
against). On each, the agent trace goes through the gateway three times, each run its own tenant:
undisturbed; with ``apcctl fleet restart`` started once a quarter of its requests were sent; with
``apcctl fleet down --server`` (the last server) half-way. ``Schedule`` holds the clients before
the last quarter of the requests until the disruption ended, so the roll always sits inside the
traffic and traffic follows it, however long it takes on a loaded machine.

Per run: the prompt tokens the servers prefilled (``prompt - cached`` from each answer's ``usage``)
against the undisturbed run, the same for the requests answered after the disruption ended (where
the gateway sends a session after the roll: the routing measurement), client errors, and the
answers that differ from a cold server's (the same messages sent straight to a server under a
fresh tenant, which must report 0 cached tokens).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from apcctl.core.client import AdminClient
from apcctl.core.hosts import free_port
from apcctl.fleet.traffic import RecordingClient, Sent, TraceResult, replay

FLEET = "rollbench"
SCENARIOS = ("undisturbed", "fleet restart", "one server removed")
TIERS = ("shared", "private")
HOLD_S = 900.0  # the longest the clients wait for a disruption to end


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

    def __init__(self, root: Path, model: str, servers: int, tier: str, policy: str) -> None:
        self.root, self.model, self.tier, self.policy = root, model, tier, policy
        self.env = {**os.environ, "APC_STATE_DIR": str(root / "state"), "XDG_CONFIG_HOME": str(root / "xdg"),
                    "HF_HUB_OFFLINE": "1"}
        port = _ports(servers + 1)
        args = ["fleet", "up", "--name", FLEET, "--servers", str(servers), "--model", model, "--port", str(port),
                "--policy", policy, "-e", "APC_TENANT_FROM_USER=1", "-e", "APC_SHARED_DISK_SCAN_MS=250",
                "--gateway-arg=--disable-retries", *(["--shared-disk-path", ""] if tier == "private" else [])]
        self.info = _apcctl(self.env, *args)
        self.url = self.info["url"]
        self.servers = [(s["server"], s["url"]) for s in self.info["servers"]]
        self.removed: set[str] = set()

    def admin(self, name: str, url: str) -> AdminClient:
        from apcctl.core.manage import ManagedServer

        return AdminClient(url, ManagedServer(name, self.root / "state" / "servers").token(), timeout=30.0)

    def restart(self) -> None:
        _apcctl(self.env, "fleet", "restart", "--name", FLEET, "--grace", "30")

    def remove_last(self) -> None:
        """``fleet down --server``: flushed, out of the gateway, stopped, off the fleet's list."""
        name, _ = self.servers[-1]
        _apcctl(self.env, "fleet", "down", "--name", FLEET, "--server", name, "--grace", "30")
        self.removed.add(name)

    def cold_mismatches(self, result: TraceResult, max_tokens: int) -> int:
        """Answers that differ from a cold server's: the same messages, a fresh tenant, straight to
        the servers still running (side by side, one request at a time on each)."""
        live = [(n, u) for n, u in self.servers if n not in self.removed]

        def check(share: int) -> int:
            client = RecordingClient(live[share][1], timeout=300.0)
            differ = 0
            for sent in result.sent[share::len(live)]:
                client.tenant = f"cold-{uuid.uuid4().hex[:8]}"
                cold = client.chat(sent.messages, model=self.model, max_tokens=max_tokens, temperature=0.0)
                if (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"):
                    raise RuntimeError(f"a fresh tenant reused cached tokens: {cold['usage']}")
                differ += _text(cold) != _text(sent.answer)
            return differ

        with ThreadPoolExecutor(max_workers=len(live)) as pool:
            return sum(pool.map(check, range(len(live))))

    def down(self) -> None:
        try:
            _apcctl(self.env, "fleet", "down", "--name", FLEET, "--grace", "30")
        finally:
            for name, _ in self.servers:
                subprocess.run([sys.executable, "-c", "from apcctl.cli import main; main()", "stop", "--server", name],
                               env=self.env, capture_output=True, timeout=120)


def _text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


class Schedule:
    """When the disruption runs inside a run of ``requests``: it starts as request ``start_at`` is
    sent, and every client waits before request ``hold_at`` (the last quarter) until it ended, so
    traffic surrounds it on both sides. ``gate`` is ``replay``'s hook, called before each request."""

    def __init__(self, requests: int, start_at: int, disrupt: Callable[[], None]) -> None:
        self.start_at, self.hold_at = start_at, requests - requests // 4
        self.disrupt = disrupt
        self.errors: list[str] = []
        self.window: list[float] = []  # monotonic: when the disruption began and ended
        self.held_s = 0.0  # the longest a client waited for it
        self._sent = 0
        self._lock = threading.Lock()
        self._begin, self._ended = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-disruption", daemon=True)

    def start(self) -> "Schedule":
        self._thread.start()
        return self

    def gate(self) -> None:
        with self._lock:
            n, self._sent = self._sent, self._sent + 1
        if n >= self.start_at:
            self._begin.set()
        if n >= self.hold_at and not self._ended.is_set():
            began = time.monotonic()
            self._ended.wait(HOLD_S)
            with self._lock:
                self.held_s = max(self.held_s, time.monotonic() - began)

    def finish(self) -> None:
        """After the run: a disruption never reached (a run shorter than ``start_at``) runs now."""
        self._begin.set()
        self._thread.join(HOLD_S)

    def _run(self) -> None:
        self._begin.wait()
        self.window.append(time.monotonic())
        try:
            self.disrupt()
        except Exception as exc:  # reported in the row, never hidden
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.window.append(time.monotonic())
            self._ended.set()


def keyed(sent: list[Sent]) -> dict[tuple[str, int], Sent]:
    """Each answer under (agent, its place in that agent's sequence): the same request in two runs
    of the same trace (each agent's requests are the same, in the same order, whatever the timing)."""
    out: dict[tuple[str, int], Sent] = {}
    counts: dict[str, int] = {}
    for s in sent:
        agent = s.conversation.split("/", 1)[0]
        out[(agent, counts.get(agent, 0))] = s
        counts[agent] = counts.get(agent, 0) + 1
    return out


def after_window(result: TraceResult, base: TraceResult, ended: float) -> tuple[int, int, int]:
    """Requests answered after ``ended``, what they prefilled, and what the same requests
    prefilled in the undisturbed run ``base``."""
    mine, theirs = keyed(result.sent), keyed(base.sent)
    after = [k for k, s in mine.items() if s.at > ended and k in theirs]
    return (len(after), sum(_prefilled(mine[k]) for k in after), sum(_prefilled(theirs[k]) for k in after))


def _prefilled(sent: Sent) -> int:
    return sent.prompt_tokens - sent.cached_tokens


def _change(value: int, base: int) -> float | None:
    return round(value / base - 1, 4) if base else None


def run_roll_bench(model: str, *, servers: int = 3, requests: int = 240, agents: int = 3, max_tokens: int = 8,
                   tiers: tuple[str, ...] = TIERS, policy: str = "cache_aware",
                   on_progress: Callable[[str], None] = lambda _: None,
                   root: Path | None = None) -> list[dict[str, Any]]:
    root = root or Path(tempfile.mkdtemp(prefix="apcctl-bench-roll-"))
    rows: list[dict[str, Any]] = []
    for tier in tiers:
        fleet = Fleet(root / tier, model, servers, tier, policy)
        try:
            on_progress(f"{tier} tier: fleet up {fleet.url} ({policy}) in front of "
                        f"{', '.join(u for _, u in fleet.servers)}")
            rows += _scenarios(fleet, requests, agents, max_tokens, on_progress)
        finally:
            fleet.down()
    return rows


def _scenarios(fleet: Fleet, requests: int, agents: int, max_tokens: int,
               on_progress: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base: TraceResult | None = None
    for label in SCENARIOS:
        disrupt = {"fleet restart": fleet.restart, "one server removed": fleet.remove_last}.get(label)
        schedule = None
        if disrupt is not None:  # the roll (one server after the other) from a quarter, a removal half-way
            schedule = Schedule(requests, requests // 4 if label == "fleet restart" else requests // 2, disrupt).start()
        began = time.monotonic()
        result = replay(fleet.url, model=fleet.model, requests=requests, max_tokens=max_tokens,
                        tenant=f"roll-{fleet.tier}-{label.replace(' ', '-')}", agents=agents,
                        gate=schedule.gate if schedule else None)
        ended = time.monotonic()
        if schedule is not None:
            schedule.finish()
        base = base or result
        prefilled = result.prompt_tokens - result.cached_tokens
        window = schedule.window if schedule else []
        after = after_window(result, base, window[1]) if len(window) == 2 else (0, 0, 0)
        rows.append({"scenario": label, "tier": fleet.tier, "policy": fleet.policy, "requests": len(result.sent),
                     "client_errors": result.failed, "prompt_tokens": result.prompt_tokens,
                     "cached_tokens": result.cached_tokens, "prefilled_tokens": prefilled,
                     "vs_undisturbed": _change(prefilled, base.prompt_tokens - base.cached_tokens),
                     # the requests answered after the disruption ended, against the same requests undisturbed
                     "after_requests": after[0], "after_prefilled": after[1], "after_undisturbed": after[2],
                     "after_vs_undisturbed": _change(after[1], after[2]) if after[0] else None,
                     "differ_from_cold": fleet.cold_mismatches(result, max_tokens),
                     "disruption_errors": schedule.errors if schedule else [],
                     # seconds from the run's start: when the disruption began and ended; the run's length
                     "disruption_s": [round(t - began, 1) for t in window], "run_s": round(ended - began, 1),
                     "held_s": round(schedule.held_s, 1) if schedule else 0.0})
        r = rows[-1]
        on_progress(f"{fleet.tier} tier, {label}: prefilled {prefilled} ({r['vs_undisturbed']:+.1%}), "
                    f"{r['client_errors']} client errors, {r['differ_from_cold']} differ from cold, "
                    f"disruption {r['disruption_s']} of {r['run_s']} s")
    return rows
