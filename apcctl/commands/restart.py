"""``apcctl restart``: idle-checked rolling restart, drawn from ``apcctl.core.restart``'s progress steps."""

from __future__ import annotations

import sys

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from apcctl.commands.common import EXIT_CODES_SHORT, ExitStatus, Targets, server_options
from apcctl.commands.serve import _env, spec_sizing
from apcctl.config import ConfigError, load_config
from apcctl.core import render
from apcctl.core.manage import GRACE_MARGIN_S, ManagedServer
from apcctl.core.model_source import model_problem, weights_problem
from apcctl.core.respec import Changes, Respecified, override_notes, respec
from apcctl.core.restart import SUPERVISORS, Phase, RestartStep, rolling_restart
from apcctl.core.roll import restart_targets
from server_patch import settings as registry


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
@click.option("--force", is_flag=True, help="Stop even if requests are still in flight after --timeout, or the "
              "flush did not write everything to disk (the unwritten RAM entries are lost).")
@click.option("--supervisor", type=click.Choice(SUPERVISORS),
              help="How the server comes back: 'none' = apcctl starts it (default: the config's).")
@click.option("--grace", type=click.FloatRange(min=0),
              help="Seconds from SIGTERM to SIGKILL (default: the server's shutdown flush timeout + "
                   f"{GRACE_MARGIN_S:.0f} s, so the flush is never cut short).")
@click.option("--retry-after", type=click.IntRange(1, 3600), default=5, show_default=True,
              help="Retry-After the drained server sends.")
@click.option("--model", "-m", metavar="DIR|REPO", help="Serve another model from this restart on (not probed).")
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="KEY=VALUE",
              help="Set a variable of the server from this restart on, e.g. -e APC_LINEAGE_RAM_BUDGET_BYTES=32G.")
@click.option("--dry-run", is_flag=True, help="Print the plan; touch nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (progress goes to stderr).")
def restart(targets: Targets, timeout: float, force: bool, supervisor: str | None, grace: float | None,
            model: str | None, env_pairs: tuple[str, ...], retry_after: int, dry_run: bool, as_json: bool) -> None:
    """Restart servers one at a time: drain, wait until idle, flush, stop, start, ready, probe.

    The probe pins a known system prompt before the stop and sends one request with it
    afterwards: it must restore from the disk tier, and every anchor pinned before must be
    listed again; it is skipped (with a warning) when the anchor cap is full, and removed
    afterwards. The first failure stops the roll, and leaves that server as it was: the drain
    lifted, or, when the new process never became ready, the previous command started again
    (a rollback; under a supervisor, the supervisor's job). Servers not on this machine are
    refused.

    What starts is the recorded command with the changes since: the server's config table read
    again (its budgets), then -e KEY=VALUE and --model; the plan lists each change before
    anything is drained, and a roll that stops before the new command runs keeps the old one.

    \b
    Examples:
      apcctl restart --all --dry-run
      apcctl restart --server main --timeout 600
      apcctl restart --server main -e APC_LINEAGE_RAM_BUDGET_BYTES=32G --dry-run
    """
    progress = ProgressPrinter(err=as_json, timeout=timeout)
    changed, notes = respecified(targets, supervisor, Changes(env=_env(env_pairs), model=model))
    for change in changed:  # before anything is drained: what the next start changes
        for line in change.lines():
            progress(RestartStep(change.name, Phase.PLAN, message=f"change {line}"))
    for name, note in notes:  # and what the operator asked for that it does not
        progress(RestartStep(name, Phase.PLAN, message=f"note: {note}"))
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
        for change in changed:
            ManagedServer(change.name).save(change.new)  # what the roll's start (and status) read
        try:
            result = restart_targets(targets, on_progress=progress, timeout=timeout, force=force,
                                     supervisor=supervisor, grace=grace, retry_after=retry_after)
        finally:
            for change in changed:
                change.restore()  # a roll that stopped before the new command ran keeps the old record
    if as_json:
        render.emit_json(result.as_dict())
    if not result.ok:
        failed = next((s for s in result.servers if s.phase == Phase.FAILED), None)
        if not as_json and failed is not None:
            click.echo(f"Error: {failed.server}: {failed.message}", err=True)
            if failed.log_tail:
                where = next((t.managed.log_path for t in targets if t.name == failed.server and t.managed), None)
                click.echo(f"log tail{f' ({where})' if where else ''}:\n{failed.log_tail}", err=True)
        raise click.exceptions.Exit(int(ExitStatus.FAILED))


def respecified(targets: Targets, supervisor: str | None,
                asked: Changes) -> tuple[list[Respecified], list[tuple[str, str]]]:
    """The managed servers whose next start differs from their record: the config table read
    again, then ``-e`` and ``--model``; and ``(server, note)`` for each config key the next
    start does not take (an earlier ``-e`` beats it). A supervised server takes no
    ``-e``/``--model`` (its installed unit says what starts; it reads the config file itself at
    every start). Refused here, before anything is drained, as ``serve`` refuses them: a model
    directory that cannot be served, a value of any setting the server cannot read."""
    if asked.model is not None and (problem := model_problem(asked.model)):
        raise click.UsageError(problem)
    try:
        config = load_config(targets.config_path)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    tables = config.servers
    out, notes = [], []
    for target in targets:
        spec = target.managed.spec() if target.managed is not None else None
        if (supervisor or target.settings.supervisor) != "none" or spec is None:
            if asked.explicit:
                raise click.UsageError(f"{target.name}: -e and --model change what apcctl starts, but "
                                       f"{'a supervisor starts it' if spec else 'apcctl serve did not start it'}: "
                                       f"install it again (apcctl service install --server {target.name} ...)")
            continue
        table = tables.get(spec.name)
        changes = Changes(config_env=table.budget_environment() if table else {}, env=asked.env, model=asked.model)
        new = respec(spec, changes)
        weights = weights_problem(new.model) if new.model != spec.model else None  # the recorded one loaded
        if (problem := model_problem(new.model) or weights) is not None:
            raise click.UsageError(f"{spec.name}: {problem}")
        if new != spec:
            spec_sizing(new)  # a bad value is a usage error now, not a server that exits at start
            out.append(Respecified(spec.name, spec, new))
        elif bad := registry.problems(new.env):  # recorded before serve checked: fix it with -e
            raise click.UsageError(f"{spec.name}: in the recorded command, " + "; ".join(bad)
                                   + ": give a valid value with restart -e KEY=VALUE")
        notes += [(spec.name, note) for note in override_notes(new, changes, config.path)]
    return out, notes

