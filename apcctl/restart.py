"""Rolling restart, one server at a time, never cutting a request (unless forced).

For each server: drain (new requests get 503 + Retry-After), wait until nothing is in flight,
flush the cache to disk, stop the process (SIGTERM, SIGKILL after a grace period), start it
again (from the state files ``apcctl serve`` wrote) or let launchd/systemd bring it back,
wait for readiness, and probe that an anchor comes back from the disk tier. Only then the
next server. The first failure stops the roll: later servers are not touched.

No printing here: every step goes to ``on_progress``, so the CLI draws a progress bar and the
dashboard can drive the same code.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import psutil

from apcctl.client import AdminClient, AdminError
from apcctl.config import Target
from apcctl.manage import ManageError, terminate

PHASES = ("plan", "draining", "waiting", "flushing", "stopping", "starting", "ready", "probing", "done", "failed")
SUPERVISORS = ("none", "launchd", "systemd")
# A system prompt no client sends: its anchor is created before the stop and must restore after.
# The nonce comes first, so no entry left by an earlier probe shares more than the template's
# opening with it, and the server captures a fresh anchor every time.
PROBE_SYSTEM = ("[apcctl restart probe {nonce}] You are the apcctl restart probe. This system prompt exists so "
                "that a rolling restart can check that a pinned anchor comes back from the disk tier.")
PROBE_USER = "Ready?"
RESTORED_KINDS = ("anchor", "disk")


@dataclass(frozen=True)
class RestartStep:
    """One progress report: which server, which phase, how many requests are still in flight."""

    server: str
    phase: str
    in_flight: int = 0
    message: str = ""
    elapsed_s: float = 0.0  # since this server's turn began


@dataclass
class ServerRestart:
    """What happened to one server."""

    server: str
    ok: bool = False
    phase: str = "plan"  # the last phase reached
    message: str = ""
    how: str = ""  # how it is stopped and started
    old_pid: int | None = None
    new_pid: int | None = None
    waited_s: float = 0.0  # time spent waiting for in-flight requests
    warnings: list[str] = field(default_factory=list)
    probe: dict[str, Any] = field(default_factory=dict)


@dataclass
class RestartResult:
    ok: bool
    dry_run: bool
    servers: list[ServerRestart]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RestartFailed(RuntimeError):
    """A step failed; the roll stops here."""


Progress = Callable[[RestartStep], None]
CommandRunner = Callable[[list[str]], None]


def _run(argv: list[str]) -> None:
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if completed.returncode != 0:
        raise RestartFailed(f"{' '.join(argv)} exited {completed.returncode}: {completed.stderr.strip()}")


def supervisor_command(supervisor: str, service: str) -> list[str]:
    """The command that restarts ``service`` under its supervisor (stop and start in one)."""
    if supervisor == "launchd":
        return ["launchctl", "kickstart", "-k", f"gui/{os.getuid()}/{service}"]
    if supervisor == "systemd":
        return ["systemctl", "--user", "restart", service]
    raise ValueError(f"no restart command for supervisor {supervisor!r}")


@dataclass(frozen=True)
class Plan:
    target: Target
    supervisor: str

    @property
    def how(self) -> str:
        settings = self.target.settings
        if self.supervisor != "none" and settings.service:
            return f"{' '.join(supervisor_command(self.supervisor, settings.service))}"
        if self.supervisor != "none":
            return f"SIGTERM, then wait for {self.supervisor} to start it again"
        spec = self.target.managed.spec() if self.target.managed else None
        return f"SIGTERM, then start again: {' '.join(spec.argv)}" if spec else ""

    def check(self) -> None:
        """Refuse before anything is touched when the server could not be started again."""
        if self.supervisor not in SUPERVISORS:
            raise RestartFailed(f"unknown supervisor {self.supervisor!r}; use one of {SUPERVISORS}")
        if self.supervisor == "none" and (self.target.managed is None or self.target.managed.spec() is None):
            raise RestartFailed("not started by 'apcctl serve' (no state files to start it again); "
                                "give --supervisor launchd|systemd if a supervisor runs it")


def rolling_restart(targets: Sequence[Target], *, on_progress: Progress, timeout: float = 300.0,
                    force: bool = False, supervisor: str | None = None, dry_run: bool = False,
                    grace: float = 20.0, retry_after: int = 5, poll_s: float = 0.25,
                    run_command: CommandRunner = _run) -> RestartResult:
    """Restart ``targets`` one after the other; see the module docstring for the steps.

    Args:
        timeout: bound on each wait (in-flight requests, readiness), in seconds.
        force: stop even if requests are still in flight after ``timeout``.
        supervisor: ``launchd``/``systemd``/``none`` for every target (default: each target's config).
        grace: seconds between SIGTERM and SIGKILL.
    Returns:
        A ``RestartResult``; ``ok`` is False as soon as one server failed (the rest are untouched).
    """
    plans = [Plan(t, supervisor or t.settings.supervisor) for t in targets]
    results = [ServerRestart(server=p.target.name) for p in plans]
    for plan, result in zip(plans, results):
        try:
            plan.check()
            result.how = plan.how
        except RestartFailed as exc:
            result.phase, result.message = "failed", str(exc)
            on_progress(RestartStep(result.server, "failed", message=result.message))
            return RestartResult(False, dry_run, results)
        on_progress(RestartStep(result.server, "plan", message=f"drain, wait <= {timeout:.0f}s, flush, "
                                f"{result.how}, wait ready, probe an anchor from disk"))
    if dry_run:
        return RestartResult(True, True, results)
    for plan, result in zip(plans, results):
        roll = _OneServer(plan, result, on_progress, timeout=timeout, force=force, grace=grace,
                          retry_after=retry_after, poll_s=poll_s, run_command=run_command)
        if not roll.run():
            return RestartResult(False, False, results)
    return RestartResult(True, False, results)


class _OneServer:
    """The steps for one server; ``run`` returns False (and reports ``failed``) on the first error."""

    def __init__(self, plan: Plan, result: ServerRestart, on_progress: Progress, *, timeout: float,
                 force: bool, grace: float, retry_after: int, poll_s: float, run_command: CommandRunner) -> None:
        self.plan, self.result, self.on_progress = plan, result, on_progress
        self.timeout, self.force, self.grace, self.retry_after = timeout, force, grace, retry_after
        self.poll_s, self.run_command = poll_s, run_command
        self.client: AdminClient = plan.target.client(timeout=30.0)
        self.began = time.monotonic()

    def emit(self, phase: str, message: str = "", in_flight: int = 0) -> None:
        self.result.phase = phase
        self.result.message = message or self.result.message
        self.on_progress(RestartStep(self.result.server, phase, in_flight, message,
                                     time.monotonic() - self.began))

    def warn(self, message: str) -> None:
        self.result.warnings.append(message)
        self.on_progress(RestartStep(self.result.server, self.result.phase, message=f"warning: {message}",
                                     elapsed_s=time.monotonic() - self.began))

    def run(self) -> bool:
        try:
            self._steps()
        except (RestartFailed, AdminError, ManageError, psutil.Error, OSError) as exc:
            message = getattr(exc, "message", None) or str(exc)
            self.emit("failed", f"{self.result.phase}: {message}")
            return False
        self.result.ok = True
        self.emit("done", f"pid {self.result.old_pid} -> {self.result.new_pid}")
        return True

    def _steps(self) -> None:
        status = self.client.status()
        self.result.old_pid = status["server"]["pid"]
        model = status["server"].get("model")
        probe = self._prepare_probe()
        self.emit("draining", f"new requests get 503, Retry-After {self.retry_after}s")
        self.client.drain(self.retry_after)
        try:
            self._wait_idle()
            self._flush()
        except BaseException:
            self._undrain()
            raise
        self.emit("stopping", self.result.how)
        self._stop()
        self.emit("starting")
        self._start()
        self.result.new_pid = self._wait_ready()
        self.emit("ready", f"pid {self.result.new_pid} answers /health and /admin/status")
        self.emit("probing", "a request with the probe's system prompt must restore from disk")
        self._probe(probe, model)

    # ------------------------------------------------------------------ before the stop

    def _prepare_probe(self) -> dict[str, Any]:
        """Pin the probe anchor now; remember the pinned anchors that must come back."""
        before = sorted(a["id"] for a in self.client.anchors() if a.get("pinned")) if self._has_lineage() else []
        system = PROBE_SYSTEM.format(nonce=secrets.token_hex(4))
        made = self.client.new_anchor(system)
        if not made.get("created"):
            raise RestartFailed(f"POST /admin/anchors answered with the existing anchor {made['anchor']['id']} "
                                "instead of creating the probe's")
        lineage = self.client.status().get("lineage") or {}
        return {"anchor_id": made["anchor"]["id"], "system": system, "pinned_before": before,
                "disk": lineage.get("disk_path") is not None}

    def _has_lineage(self) -> bool:
        return self.client.status().get("lineage") is not None

    def _wait_idle(self) -> None:
        start = time.monotonic()
        while True:
            idle = self.client.status()["idle"]
            in_flight = int(idle.get("in_flight", 0)) + int(idle.get("queued", 0))
            waited = time.monotonic() - start
            self.result.waited_s = waited
            self.emit("waiting", f"{in_flight} in flight", in_flight)
            if in_flight == 0:
                return
            if waited >= self.timeout:
                if self.force:
                    self.warn(f"--force: stopped with {in_flight} requests in flight")
                    return
                raise RestartFailed(f"{in_flight} requests still in flight after {self.timeout:.0f}s; "
                                    "drain lifted again (use --force or a longer --timeout)")
            time.sleep(self.poll_s)

    def _flush(self) -> None:
        self.emit("flushing", "writing RAM entries the disk lacks")
        try:
            answer = self.client.flush(timeout=min(self.timeout, 600.0))
        except AdminError as exc:
            if exc.status == 0:
                raise
            # The server also flushes on SIGTERM, and the probe checks what came back.
            self.warn(f"flush failed ({exc.message}); relying on the shutdown flush")
            return
        if not answer.get("complete", True):
            self.warn("flush did not finish in time; the shutdown flush continues it")

    def _undrain(self) -> None:
        try:
            self.client.undrain()
        except AdminError:
            pass

    # ------------------------------------------------------------------ stop and start

    def _stop(self) -> None:
        target, supervisor = self.plan.target, self.plan.supervisor
        if supervisor != "none" and target.settings.service:
            self.run_command(supervisor_command(supervisor, target.settings.service))
        elif supervisor != "none":
            terminate(self._local_process(), self.grace)
        else:
            assert target.managed is not None
            stopped = target.managed.stop(self.grace)
            if stopped.how == "SIGKILL":
                self.warn(f"pid {stopped.pid} ignored SIGTERM for {self.grace:.0f}s and was killed")

    def _local_process(self) -> psutil.Process:
        pid = self.result.old_pid
        try:
            process = psutil.Process(pid)
            if "server_patch.launch" in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            pass
        raise RestartFailed(f"pid {pid} is not a patched server on this machine; give the supervisor's "
                            "service name (config key 'service') to restart a remote or unknown process")

    def _start(self) -> None:
        target = self.plan.target
        if self.plan.supervisor == "none":
            assert target.managed is not None
            spec = target.managed.spec()
            assert spec is not None
            target.managed.start(spec)

    def _wait_ready(self) -> int:
        """A new PID answering /health and /admin/status; the old PID never counts."""
        managed = self.plan.target.managed if self.plan.supervisor == "none" else None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if managed is not None and managed.pid() is None:
                raise RestartFailed(f"the server exited while starting; log tail:\n{managed.log_tail(15)}")
            try:
                self.client.health()
                pid = self.client.status()["server"]["pid"]
                if pid != self.result.old_pid:
                    return pid
            except AdminError as exc:
                if exc.status in (401, 403):
                    raise
            time.sleep(self.poll_s)
        raise RestartFailed(f"not ready within {self.timeout:.0f}s")

    # ------------------------------------------------------------------ after the start

    def _probe(self, probe: dict[str, Any], model: str | None) -> None:
        """The probe anchor restores (from disk), and every anchor pinned before is listed again."""
        anchor_id = probe["anchor_id"]
        seen = max((r["seq"] for r in self.client.requests()), default=0)
        messages = [{"role": "system", "content": probe["system"]}, {"role": "user", "content": PROBE_USER}]
        self.client.chat(messages, model=model, max_tokens=1, temperature=0.0, timeout=self.timeout)
        records = [r for r in self.client.requests(since=seen) if r.get("entry_id") == anchor_id]
        restored = next((r for r in records if r["restore_kind"] in RESTORED_KINDS and r["restored_tokens"]), None)
        listed = {a["id"] for a in self.client.anchors()}
        missing = sorted(set(probe["pinned_before"]) - listed)
        self.result.probe = {**probe, "restore_kind": restored["restore_kind"] if restored else None,
                             "restored_tokens": restored["restored_tokens"] if restored else 0,
                             "missing_anchors": missing}
        self._forget_probe(anchor_id)
        if not probe["disk"]:
            self.warn("the disk tier is off: anchors do not survive a restart")
            return
        if restored is None:
            raise RestartFailed(f"the probe anchor {anchor_id} did not restore after the restart")
        if missing:
            raise RestartFailed(f"anchors pinned before the restart are gone: {', '.join(missing)}")

    def _forget_probe(self, anchor_id: str) -> None:
        try:
            self.client.evict(anchor_id)
        except AdminError as exc:
            if exc.status != 404:
                self.warn(f"could not evict the probe anchor {anchor_id}: {exc.message}")

