"""``apcctl restart``: idle-checked rolling restart, drawn from ``apcctl.core.restart``'s progress steps."""

from __future__ import annotations

import sys

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from apcctl.commands.common import EXIT_CODES_SHORT, ExitStatus, server_options
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.manage import GRACE_MARGIN_S
from apcctl.core.restart import SUPERVISORS, Phase, RestartStep, rolling_restart
from apcctl.core.roll import restart_targets


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(restart)


class ProgressPrinter:
    """One line per phase; while waiting for in-flight requests, a bar on a terminal."""

    def __init__(self, *, err: bool, timeout: float) -> None:
        self.err = err
        self.timeout = timeout
        self.bar: Progress | None = None
        self.task = None
        self.last_in_flight: int | None = None
        self.tty = (sys.stderr if err else sys.stdout).isatty()

    def __call__(self, step: RestartStep) -> None:
        if step.phase == Phase.WAITING and not step.message.startswith("warning:"):
            self._waiting(step)
            return
        self._close_bar()
        self.last_in_flight = None
        click.echo(f"{step.server:<12} {step.phase:<9} {step.message}", err=self.err)

    def _waiting(self, step: RestartStep) -> None:
        if not self.tty:
            if step.in_flight != self.last_in_flight:
                click.echo(f"{step.server:<12} {Phase.WAITING:<9} {step.in_flight} requests in flight", err=self.err)
            self.last_in_flight = step.in_flight
            return
        if self.bar is None:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                console=render.console() if not self.err else None, transient=True)
            self.task = self.bar.add_task("", total=self.timeout)
            self.bar.start()
        self.bar.update(self.task, description=f"{step.server}: waiting for {step.in_flight} in flight",
                        completed=min(self.timeout, step.elapsed_s))

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


@click.command(epilog=EXIT_CODES_SHORT + " restart exits 1 when the roll stopped; later servers are untouched.")
@server_options(allow_all=True)
@click.option("--timeout", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds to wait for in-flight requests, and for readiness.")
@click.option("--force", is_flag=True, help="Stop even if requests are still in flight after --timeout.")
@click.option("--supervisor", type=click.Choice(SUPERVISORS),
              help="How the server comes back: 'none' = apcctl starts it (default: the config's).")
@click.option("--grace", type=click.FloatRange(min=0),
              help="Seconds from SIGTERM to SIGKILL (default: the server's shutdown flush timeout + "
                   f"{GRACE_MARGIN_S:.0f} s, so the flush is never cut short).")
@click.option("--retry-after", type=click.IntRange(1, 3600), default=5, show_default=True,
              help="Retry-After the drained server sends.")
@click.option("--dry-run", is_flag=True, help="Print the plan; touch nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (progress goes to stderr).")
def restart(targets: list[Target], timeout: float, force: bool, supervisor: str | None, grace: float | None,
            retry_after: int, dry_run: bool, as_json: bool) -> None:
    """Restart servers one at a time: drain, wait until idle, flush, stop, start, ready, probe.

    The probe pins a known system prompt before the stop and sends one request with it
    afterwards: it must restore from the disk tier, and every anchor pinned before must be
    listed again; it is skipped (with a warning) when the anchor cap is full, and removed
    afterwards. The first failure stops the roll, and leaves that server as it was: the drain
    lifted, or, when the new process never became ready, the previous command started again
    (a rollback; under a supervisor, the supervisor's job). Servers not on this machine are
    refused.

    \b
    Examples:
      apcctl restart --all --dry-run
      apcctl restart --server main --timeout 600
    """
    progress = ProgressPrinter(err=as_json, timeout=timeout)
    # Every target is planned (and a bad plan refused) before anything is touched; then a server
    # behind a running fleet's gateway is taken out of the gateway instead of being drained
    # (apcctl.core.roll), so the fleet's clients never see a 503.
    planned: list[RestartStep] = []
    result = rolling_restart(targets, on_progress=progress if dry_run else planned.append, timeout=timeout,
                             supervisor=supervisor, dry_run=True, grace=grace)
    if not result.ok:
        for step in planned:
            progress(step)
    elif not dry_run:
        result = restart_targets(targets, on_progress=progress, timeout=timeout, force=force,
                                 supervisor=supervisor, grace=grace, retry_after=retry_after)
    if as_json:
        render.emit_json(result.as_dict())
    if not result.ok:
        failed = next((s for s in result.servers if s.phase == Phase.FAILED), None)
        if not as_json and failed is not None:
            click.echo(f"Error: {failed.server}: {failed.message}", err=True)
        raise click.exceptions.Exit(int(ExitStatus.FAILED))
