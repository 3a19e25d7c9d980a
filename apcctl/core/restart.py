"""Rolling restart, one server at a time, never cutting a request (unless forced).

For each server: drain (new requests get 503 + Retry-After), wait until nothing is in flight,
flush the cache to disk (a flush that did not write everything stops the roll before the stop,
unless forced), stop the process (SIGTERM, SIGKILL after a grace period that covers the
server's shutdown flush), start it again (from the state files ``apcctl serve`` wrote) or let
launchd/systemd bring it back, wait for readiness, and probe that an anchor comes back from the
disk tier. Only then the next server. The first failure stops the roll: later servers are not
touched.

Every failure after the drain leaves the server as it was: the drain is lifted when the old
process still runs; when it is gone and the new one never becomes ready, the command the old one
ran is started again and probed (a rollback; under a supervisor that is the supervisor's job).
The probe anchor is removed whatever happened, and it is only created when the anchor cap has
room for it, so it never pushes out an operator's anchor. Servers that are not on this machine
are refused before anything is touched: signals, ``systemctl`` and ``launchctl`` act locally.

No printing here: every step goes to ``on_progress``, so the CLI draws a progress bar and the
dashboard can drive the same code.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import psutil

from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import is_local_url
from apcctl.core.manage import (CREATE_TIME_TOLERANCE_S, GRACE_MARGIN_S, LAUNCHER, ManageError, ServerSpec,
                                default_grace, same_process, terminate)

if TYPE_CHECKING:  # the CLI's resolved server (the engine reads only its fields; no import at run time)
    from apcctl.config import Target
    from server_patch.admin.schema import Budgets, EntryInfo, ServerInfo, Status


class Phase(StrEnum):
    """Where one server's restart is, in order; the values are the JSON's and the progress lines' words."""

    PLAN = "plan"
    DRAINING = "draining"
    WAITING = "waiting"
    FLUSHING = "flushing"
    STOPPING = "stopping"
    STARTING = "starting"
    READY = "ready"
    PROBING = "probing"
    ROLLBACK = "rollback"
    DONE = "done"
    FAILED = "failed"


SUPERVISORS = ("none", "launchd", "systemd")
# A system prompt no client sends: its anchor is created before the stop and must restore after.
# The nonce comes first, so no entry left by an earlier probe shares more than the template's
# opening with it, and the server captures a fresh anchor every time.
PROBE_SYSTEM = ("[apcctl restart probe {nonce}] You are the apcctl restart probe. This system prompt exists so "
                "that a rolling restart can check that a pinned anchor comes back from the disk tier.")
PROBE_USER = "Ready?"
# Tokens a chat template may add around the probe's system prompt (an upper bound, for the cap check).
TEMPLATE_TOKENS = 64
RAM_TIERS = ("ram", "ram+disk")
FAILURES = (AdminError, ManageError, psutil.Error, OSError)
ROLLBACK_READY_S = 300.0  # the least a rollback's start waits (the default --timeout): see _roll_back


@dataclass(frozen=True)
class RestartStep:
    """One progress report: which server, which phase, how many requests are still in flight."""

    server: str
    phase: Phase
    in_flight: int = 0
    message: str = ""
    elapsed_s: float = 0.0  # since this server's turn began


@dataclass
class ServerRestart:
    """What happened to one server."""

    server: str
    ok: bool = False
    phase: Phase = Phase.PLAN  # the last phase reached
    message: str = ""
    how: str = ""  # how it is stopped and started
    old_pid: int | None = None
    new_pid: int | None = None
    waited_s: float = 0.0  # time spent waiting for in-flight requests
    warnings: list[str] = field(default_factory=list)
    probe: dict[str, Any] = field(default_factory=dict)
    rolled_back: bool = False  # the previous command was started again
    rollback: dict[str, Any] = field(default_factory=dict)  # its pid, whether it came up, its probe
    log_tail: str = ""  # the server log's last lines after the failure (said once, after the one-line message)


@dataclass
class RestartResult:
    ok: bool
    dry_run: bool
    servers: list[ServerRestart]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RestartFailed(RuntimeError):
    """A step failed; the roll stops here. ``phase`` is where, when the message already says it."""

    def __init__(self, message: str, phase: Phase | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.phase = phase
        self.log_tail = log_tail


Progress = Callable[[RestartStep], None]
CommandRunner = Callable[[list[str]], None]


def _run(argv: list[str]) -> None:
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if completed.returncode != 0:
        raise RestartFailed(f"{' '.join(argv)} exited {completed.returncode}: {completed.stderr.strip()}")


def _message(exc: BaseException) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__


def supervisor_command(supervisor: str, service: str) -> list[str]:
    """The command that restarts ``service`` under its supervisor (stop and start in one)."""
    if supervisor == "launchd":
        return ["launchctl", "kickstart", "-k", f"gui/{os.getuid()}/{service}"]
    if supervisor == "systemd":
        return ["systemctl", "--user", "restart", service]
    raise ValueError(f"no restart command for supervisor {supervisor!r}")


def grace_for(status: Status, spec: ServerSpec | None) -> float:
    """SIGTERM-to-SIGKILL time covering the shutdown flush: the running server's setting if it
    reports one, else the setting its command's environment gives it."""
    config = status.lineage.config if status.lineage else {}
    if isinstance(config.get("shutdown_flush_s"), (int, float)):
        return float(config["shutdown_flush_s"]) + GRACE_MARGIN_S
    return default_grace(spec.env if spec else None)


def anchor_cap_full(budgets: Budgets | Mapping[str, Any], entries: Callable[[], list[EntryInfo] | list[dict[str, Any]]],
                    system: str) -> str:
    """Why one more pinned anchor would make the server evict one (empty when it fits).

    Read by key, so a budget an older server lacks (or none at all, ``{}``) is no cap.

    The probe's size is bounded from the entries held in RAM: bytes grow with length, so an
    entry at least as long bounds it, and a shorter one does once scaled up by the length ratio.
    """
    count, count_limit = budgets.get("anchor_count"), budgets.get("anchor_count_limit")
    if isinstance(count, int) and isinstance(count_limit, int) and count + 1 > count_limit:
        return f"the anchor cap is full ({count} of {count_limit} anchors)"
    used, limit = budgets.get("anchor_bytes"), budgets.get("anchor_bytes_limit")
    if not isinstance(used, int) or not isinstance(limit, int):
        return ""
    tokens = len(system.encode()) + TEMPLATE_TOKENS  # never fewer bytes than byte-level tokens
    bounds = [int(e["bytes"] * max(1.0, tokens / e["length"])) for e in entries()
              if e.get("tier") in RAM_TIERS and e.get("bytes", 0) > 0 and e.get("length", 0) > 0]
    needed = min(bounds, default=0)
    if used + needed > limit:
        return f"the anchor byte cap is full ({used} of {limit} bytes; the probe may need {needed})"
    return ""


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
        """Refuse before anything is touched when the server could not be started again, or is
        not on this machine (every way of stopping it acts on local processes)."""
        if self.supervisor not in SUPERVISORS:
            raise RestartFailed(f"unknown supervisor {self.supervisor!r}; use one of {SUPERVISORS}")
        if not is_local_url(self.target.url):
            verb = (f"'{supervisor_command(self.supervisor, self.target.settings.service)[0]}'"
                    if self.supervisor != "none" and self.target.settings.service else "signals")
            raise RestartFailed(f"{self.target.url} is not on this machine (its host is not loopback or a local "
                                f"address): restart stops and starts local processes ({verb}); run apcctl "
                                "restart on the server's own machine")
        if self.supervisor == "none" and (self.target.managed is None or self.target.managed.spec() is None):
            raise RestartFailed("not started by 'apcctl serve' (no state files to start it again); "
                                "give --supervisor launchd|systemd if a supervisor runs it")


def rolling_restart(targets: Sequence[Target], *, on_progress: Progress, timeout: float = 300.0,
                    force: bool = False, supervisor: str | None = None, dry_run: bool = False,
                    grace: float | None = None, retry_after: int = 5, poll_s: float = 0.25,
                    run_command: CommandRunner = _run) -> RestartResult:
    """Restart ``targets`` one after the other; see the module docstring for the steps.

    Args:
        timeout: bound on each wait (in-flight requests, readiness), in seconds.
        force: stop even if requests are still in flight after ``timeout``, or the flush did not
            write everything to disk.
        supervisor: ``launchd``/``systemd``/``none`` for every target (default: each target's config).
        grace: seconds between SIGTERM and SIGKILL (default: the server's shutdown flush timeout
            plus a margin, so a stop never cuts the flush short).
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
            result.phase, result.message = Phase.FAILED, str(exc)
            on_progress(RestartStep(result.server, Phase.FAILED, message=result.message))
            return RestartResult(False, dry_run, results)
        on_progress(RestartStep(result.server, Phase.PLAN, message=f"drain, wait <= {timeout:.0f}s, flush, "
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
                 force: bool, grace: float | None, retry_after: int, poll_s: float,
                 run_command: CommandRunner) -> None:
        self.plan, self.result, self.on_progress = plan, result, on_progress
        self.timeout, self.force, self.grace, self.retry_after = timeout, force, grace, retry_after
        self.poll_s, self.run_command = poll_s, run_command
        self.client: AdminClient = plan.target.client(timeout=30.0)
        self.managed = plan.target.managed if plan.supervisor == "none" else None
        self.began = time.monotonic()
        self.old_process: psutil.Process | None = None
        self.previous: ServerSpec | None = None  # what a rollback starts
        self.probe: dict[str, Any] | None = None  # the probe anchor, until it is removed
        self.model: str | None = None

    def emit(self, phase: Phase, message: str = "", in_flight: int = 0) -> None:
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
        except (RestartFailed, *FAILURES) as exc:
            phase = getattr(exc, "phase", None) or self.result.phase
            self.emit(Phase.FAILED, f"{phase}: {_message(exc)}")
            return False
        self.result.ok = True
        self.emit(Phase.DONE, f"pid {self.result.old_pid} -> {self.result.new_pid}")
        return True

    def _steps(self) -> None:
        status = self.client.status()
        self.result.old_pid = status.server.pid
        self.old_process = self._identify(status.server)
        self.previous = self.managed.running_spec() if self.managed else None
        if self.grace is None:
            self.grace = grace_for(status, self.previous)
        self.model = status.server.model
        try:
            self.probe = None if self._model_changes() else self._prepare_probe(status)
            self._roll()
        finally:
            self._forget_probe()

    def _roll(self) -> None:
        self.emit(Phase.DRAINING, f"new requests get 503, Retry-After {self.retry_after}s")
        try:
            self.client.drain(self.retry_after)  # inside: a drain that timed out may still have landed
            self._wait_idle()
            self._flush()
            self.emit(Phase.STOPPING, f"{self.result.how} (SIGKILL after {self.grace:.0f}s)")
            self._stop()
            self.emit(Phase.STARTING)
            self._start()
            self.result.new_pid = self._wait_ready()
        except (RestartFailed, *FAILURES) as exc:
            phase = self.result.phase
            self.result.log_tail = getattr(exc, "log_tail", "")
            raise RestartFailed(f"{_message(exc)}; {self._recover()}", phase) from exc
        except BaseException:  # Ctrl-C: no rollback, but never leave a running server drained
            if self._old_alive():
                self._undrain()
            raise
        self.emit(Phase.READY, f"pid {self.result.new_pid} answers /health and /admin/status")
        if self.probe is not None:
            self.emit(Phase.PROBING, "a request with the probe's system prompt must restore from disk")
            self.result.probe = self._check_probe()
            if self.result.probe.get("failure"):
                raise RestartFailed(self.result.probe["failure"])

    # ------------------------------------------------------------------ identity

    def _identify(self, server: ServerInfo) -> psutil.Process | None:
        """The old server's process, known by PID and create time; refuse if it is not ours."""
        if self.managed is not None:
            process = self.managed.process()
            if process is None or process.pid != server.pid:
                named = f"pid {process.pid}" if process else "no running process"
                raise RestartFailed(f"{self.plan.target.url} is served by pid {server.pid}, but the PID file of "
                                    f"'apcctl serve --server {self.managed.name}' names {named}: refusing to stop a "
                                    "process apcctl did not start")
            if isinstance(server.create_time, (int, float)) and not _reported_matches(process, server):
                raise RestartFailed(f"pid {process.pid} was created at another time than the server at "
                                    f"{self.plan.target.url} reports: the PID was reused")
            return process
        if self.plan.target.settings.service:
            try:  # the supervisor stops it; knowing the process only helps a failed stop's cleanup
                return self._local_process(server)
            except RestartFailed:
                return None
        return self._local_process(server)

    def _local_process(self, server: ServerInfo) -> psutil.Process:
        """The local process behind the status' PID; a reused PID or another machine's is refused."""
        pid = server.pid
        try:
            process = psutil.Process(pid)
            if _reported_matches(process, server):
                return process
        except psutil.Error:
            pass
        raise RestartFailed(f"pid {pid} is not a patched server on this machine; give the supervisor's "
                            "service name (config key 'service') to restart a remote or unknown process")

    def _old_alive(self) -> bool:
        """The old server still runs (asked of the process, or of the server when it is unknown)."""
        process = self.old_process
        try:
            if process is None:
                return self.client.status().server.pid == self.result.old_pid
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except (psutil.Error, AdminError):
            return False

    # ------------------------------------------------------------------ before the stop

    def _prepare_probe(self, status: Status) -> dict[str, Any] | None:
        """Pin the probe anchor now, if the anchor cap has room; remember the pinned anchors.

        A server that has not served yet reports no lineage (it starts with the first request):
        nothing is in RAM then, so the probe fits, and creating it starts the cache.
        """
        system = PROBE_SYSTEM.format(nonce=secrets.token_hex(4))
        full = anchor_cap_full(status.lineage.budgets if status.lineage else {}, self.client.entries, system)
        if full:
            self.warn(f"{full}: the restart is not probed (a probe anchor would push out an operator's)")
            return None
        in_ram = {a.id for a in self._anchors() if a.pinned and a.tier in RAM_TIERS}
        made = self.client.new_anchor(system)
        if not made.created:
            raise RestartFailed(f"POST /admin/anchors answered with the existing anchor {made.anchor.id} "
                                "instead of creating the probe's")
        anchor_id = made.anchor.id
        self.probe = {"anchor_id": anchor_id, "system": system}  # from here on, removed whatever happens
        anchors = self.client.anchors()
        lineage = self.client.status().lineage
        self.probe.update(pinned_before=sorted(a.id for a in anchors if a.pinned and a.id != anchor_id),
                          disk=lineage is not None and lineage.disk_path is not None)
        pushed = in_ram - {a.id for a in anchors if a.tier in RAM_TIERS}
        if pushed:
            self._forget_probe()
            self.warn(f"the probe anchor pushed {', '.join(sorted(pushed))} out of RAM (it reloads from disk on "
                      "its next use); probe removed, the restart is not probed")
        return self.probe

    def _model_changes(self) -> bool:
        """The next start serves another model (restart --model): its disk tier is another
        fingerprint's, so no anchor can come back from it, and the restart is not probed."""
        following = self.managed.spec() if self.managed is not None else None
        if self.previous is None or following is None or following.model == self.previous.model:
            return False
        self.warn(f"the model changes ({self.previous.model} -> {following.model}): anchors of the old model do "
                  "not restore for the new one; the restart is not probed")
        return True

    def _anchors(self) -> list[EntryInfo]:
        """The anchors, or none before the first request (the cache does not exist yet: 409)."""
        try:
            return self.client.anchors()
        except AdminError as exc:
            if exc.status == 409:
                return []
            raise

    def _wait_idle(self) -> None:
        start = time.monotonic()
        while True:
            try:
                idle = self.client.status().idle
            except AdminError as exc:
                # A busy server (every core decoding) may not answer one poll in time; that is
                # no reason to give up the restart before the wait itself runs out.
                if exc.status != 0 or time.monotonic() - start >= self.timeout:
                    raise
                self.emit(Phase.WAITING, f"no answer to a status poll ({exc.message}); still waiting")
                time.sleep(self.poll_s)
                continue
            in_flight = idle.in_flight + idle.queued
            waited = time.monotonic() - start
            self.result.waited_s = waited
            self.emit(Phase.WAITING, f"{in_flight} in flight", in_flight)
            if in_flight == 0:
                return
            if waited >= self.timeout:
                if self.force:
                    self.warn(f"--force: stopped with {in_flight} requests in flight")
                    return
                raise RestartFailed(f"{in_flight} requests still in flight after {self.timeout:.0f}s "
                                    "(use --force or a longer --timeout)")
            time.sleep(self.poll_s)

    def _flush(self) -> None:
        self.emit(Phase.FLUSHING, "writing RAM entries the disk lacks")
        try:
            answer = self.client.flush(timeout=min(self.timeout, 600.0))
        except AdminError as exc:
            if exc.status in (0, 409):  # unreachable: fails the roll; 409: no cache yet, nothing to lose
                if exc.status == 0:
                    raise
                return
            self._flush_failed(f"flush failed ({exc.message})")
            return
        if not answer.complete:
            self._flush_failed(f"flush wrote {answer.written} entries, {answer.failed} not "
                               f"({answer.reason or 'incomplete'})")

    def _flush_failed(self, why: str) -> None:
        """Stopping now would lose what RAM holds and the disk lacks: nothing is stopped, unless forced."""
        if not self.force:
            raise RestartFailed(f"{why}: stopping the server would lose its RAM tier; nothing stopped "
                                "(--force stops it anyway)")
        self.warn(f"--force: {why}; stopping anyway")

    # ------------------------------------------------------------------ stop and start

    def _stop(self) -> None:
        target, supervisor = self.plan.target, self.plan.supervisor
        assert self.grace is not None
        if supervisor != "none" and target.settings.service:
            self.run_command(supervisor_command(supervisor, target.settings.service))
        elif supervisor != "none":
            assert self.old_process is not None
            terminate(self.old_process, self.grace)
        else:
            assert self.managed is not None
            stopped = self.managed.stop(self.grace)
            if stopped.how == "SIGKILL":
                self.warn(f"pid {stopped.pid} ignored SIGTERM for {self.grace:.0f}s and was killed")

    def _start(self) -> None:
        if self.managed is not None:
            spec = self.managed.spec()
            if spec is None:
                raise RestartFailed(f"{self.managed.spec_path} is gone or unreadable")
            self.managed.start(spec)

    def _wait_ready(self, timeout: float | None = None) -> int:
        """A new process answering /health and /admin/status within ``timeout`` (default: the
        restart's): under apcctl, the one its PID file names (create time and all); under a
        supervisor, any PID but the old one."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            process = self.managed.process() if self.managed is not None else None
            if self.managed is not None and process is None:
                raise RestartFailed(f"the server exited while starting{self.managed.cause()}",
                                    log_tail=self.managed.log_tail(15))
            try:
                self.client.health()
                pid = self.client.status().server.pid
                if (pid == process.pid) if process is not None else (pid != self.result.old_pid):
                    return pid
            except AdminError as exc:
                if exc.status in (401, 403):
                    raise
            time.sleep(self.poll_s)
        raise RestartFailed(f"not ready within {timeout:.0f}s")

    # ------------------------------------------------------------------ after a failure

    def _recover(self) -> str:
        """Put the server back as it was; returns what was done, for the failure's message."""
        if self._old_alive():
            self._forget_probe()
            error = self._undrain()
            return (f"pid {self.result.old_pid} still runs but the drain could not be lifted: {error}" if error
                    else f"drain lifted, pid {self.result.old_pid} still serves")
        if self.managed is None:
            self._forget_probe()
            self._undrain()  # whatever answers now must not stay drained
            return (f"not rolled back: {self.plan.supervisor} is left to start it again (apcctl does not start a "
                    "supervised server)")
        return self._roll_back()

    def _roll_back(self) -> str:
        """Start the command the old process ran, wait for it, and probe it."""
        assert self.managed is not None and self.previous is not None and self.grace is not None
        managed, previous = self.managed, self.previous
        self.result.rolled_back = True
        self.emit(Phase.ROLLBACK, f"starting the previous command again: {' '.join(previous.argv)}")
        try:
            if managed.process() is not None:  # the new process, up but never ready
                managed.stop(self.grace)
            current = managed.spec()
            kept = ""
            if current is not None and (current.argv, current.env) != (previous.argv, previous.env):
                kept = f"; the command that failed is kept in {managed.keep_failed(current)}"
            self.result.rollback = {"pid": managed.start(previous), "ready": False}
            # The previous command served until now: its start gets at least the default wait,
            # so a short --timeout meant to fail a bad new command fast never leaves the server
            # down because the known-good one loads slower than that.
            self.result.rollback.update(pid=self._wait_ready(max(self.timeout, ROLLBACK_READY_S)), ready=True)
        except (RestartFailed, *FAILURES) as exc:
            self.result.rollback["error"] = _message(exc)
            self.result.log_tail = getattr(exc, "log_tail", "") or self.result.log_tail
            return f"rollback failed, the server is down: {_message(exc)}"
        pid = self.result.rollback["pid"]
        done = f"rolled back: pid {pid} runs the previous command again{kept}"
        if self.probe is None:
            return f"{done} (not probed)"
        try:
            probe = self._check_probe()
        except FAILURES as exc:
            probe = {"failure": f"its probe failed: {_message(exc)}"}
        self.result.rollback["probe"] = probe
        if probe.get("failure"):
            return f"{done}, but {probe['failure']}"
        return f"{done}, and its probe restored {probe['restored_tokens']} tokens ({probe['restore_kind']})"

    def _undrain(self) -> str:
        """Lift the drain; returns why it could not be lifted (empty when it was)."""
        try:
            self.client.undrain()
            return ""
        except AdminError as exc:
            return exc.message

    # ------------------------------------------------------------------ the probe

    def _check_probe(self) -> dict[str, Any]:
        """Send the probe's prompt: the anchor must restore (from disk), and every anchor pinned
        before must be listed again. Returns what was seen; ``failure`` says what went wrong."""
        assert self.probe is not None
        probe, anchor_id = self.probe, self.probe["anchor_id"]
        seen = max((r.seq for r in self.client.requests()), default=0)
        messages = [{"role": "system", "content": probe["system"]}, {"role": "user", "content": PROBE_USER}]
        self.client.chat(messages, model=self.model, max_tokens=1, temperature=0.0, timeout=self.timeout)
        records = [r for r in self.client.requests(since=seen) if r.entry_id == anchor_id]
        from server_patch.lineage.model import ANCHOR, DISK  # (the server package: loaded for a probe only)

        restored = next((r for r in records if r.restore_kind in (ANCHOR, DISK) and r.restored_tokens), None)
        missing = sorted(set(probe["pinned_before"]) - {a.id for a in self.client.anchors()})
        seen_now = {**probe, "restore_kind": str(restored.restore_kind) if restored else None,
                    "restored_tokens": restored.restored_tokens if restored else 0, "missing_anchors": missing}
        if not probe["disk"]:
            self.warn("the disk tier is off: anchors do not survive a restart")
        elif restored is None:
            seen_now["failure"] = f"the probe anchor {anchor_id} did not restore after the restart"
        elif missing:
            seen_now["failure"] = f"anchors pinned before the restart are gone: {', '.join(missing)}"
        return seen_now

    def _forget_probe(self) -> None:
        """Remove the probe anchor from whichever process answers now (RAM and disk)."""
        if self.probe is None:
            return
        from server_patch.lineage.model import Reason

        anchor_id = self.probe["anchor_id"]
        try:
            self.client.evict(anchor_id, reason=Reason.RESTART_PROBE)
        except AdminError as exc:
            if exc.status != 404:
                self.warn(f"could not evict the probe anchor {anchor_id}: {exc.message}; "
                          f"apcctl anchors evict {anchor_id} once the server answers")
                return
        self.probe = None


def _reported_matches(process: psutil.Process, server: ServerInfo | Mapping[str, Any]) -> bool:
    """``process`` is the server that answered /admin/status with ``server``.

    With a reported ``create_time`` that is exact; without one (older servers) the process must
    run the launcher and predate the moment the server says it started.
    """
    if isinstance(server.get("create_time"), (int, float)):
        return same_process(process, float(server["create_time"]))
    try:
        started = server.get("started")
        if isinstance(started, (int, float)) and process.create_time() > started + CREATE_TIME_TOLERANCE_S:
            return False
        return " ".join(LAUNCHER) in " ".join(process.cmdline())
    except psutil.Error:
        return False
