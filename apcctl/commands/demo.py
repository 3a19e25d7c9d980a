"""``apcctl demo``: the tiny model, a patched server, agent-like traffic and the dashboard, in one command."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import click

from apcctl.commands.common import EXIT_CODES_SHORT, CommandError, json_option
from apcctl.agent_traffic import AgentTraffic
from apcctl.commands.requests import format_request, header
from apcctl.config import ServerConfig, Target
from apcctl.core import render
from apcctl.core.client import AdminError
from apcctl.core.hosts import free_port
from apcctl.core.manage import ManagedServer, ManageError, build_spec
from server_patch.paths import state_dir

NAME = "demo"


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(demo)


def demo_budget() -> dict[str, str]:
    """A RAM budget sized to this machine (a quarter of its memory, at most the server's default),
    unless the shell sets one: the tiny model needs little, and a newcomer on a 24 GB machine
    should not see the default 48 GiB budget and its warning (issue 36)."""
    import os

    import psutil

    from server_patch.lineage.config import LineageConfig

    variable = "APC_LINEAGE_RAM_BUDGET_BYTES"
    if os.environ.get(variable, "").strip():
        return {}
    return {variable: str(min(LineageConfig.ram_budget_bytes, psutil.virtual_memory().total // 4))}


def _dashboard() -> Callable[..., Any] | None:
    """The Textual dashboard, when the ``tui`` package provides one."""
    try:
        from tui.app import run_dashboard
    except ImportError:
        return None
    return run_dashboard


def _open_dashboard(run_dashboard: Callable[..., Any], target: Target, traffic: AgentTraffic) -> None:
    """The dashboard on the demo server, with its Restart tab able to roll it; it says when the
    demo's traffic is done (``q`` then ends the demo)."""
    run_dashboard(target.client(), restart_targets=[target],
                  notices=lambda: traffic_done_line(traffic) + "; q ends the demo" if traffic.done.is_set() else "")


def _print_live(target: Target, traffic: AgentTraffic, err: bool) -> None:
    """Request lines (and cache events) from the server's event stream until the traffic ends."""
    events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    closed = threading.Event()

    def read() -> None:
        try:
            for item in target.client().events(stop=closed):
                events.put(item)
        except AdminError:
            pass  # the server went away

    threading.Thread(target=read, name="apcctl-demo-events", daemon=True).start()
    try:
        _print_events(events, traffic, err)
    finally:
        closed.set()  # an open event stream would hold up the server's graceful shutdown


def earlier_disk_tier(spec: Any) -> str:
    """What an earlier demo left in the disk tier this one starts on ("" when nothing): its first
    requests may restore from there, and the hit rate is no cold start's."""
    from pathlib import Path

    root = Path(spec.env.get("APC_LINEAGE_DISK_PATH", ""))
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")] if root.is_dir() else []
    if not files:
        return ""
    size = sum(p.stat().st_size for p in files)
    return (f"demo: reusing the disk tier an earlier demo left at {root} ({len(files)} files, "
            f"{render.human_bytes(size)}): its first requests may restore from disk; remove that directory "
            "for a cold start")


def traffic_done_line(traffic: AgentTraffic) -> str:
    return (f"demo: traffic done: {traffic.sent} requests sent ({traffic.failed} failed); "
            "the server keeps running until the demo ends")


def _print_events(events: queue.Queue[tuple[str, dict[str, Any]]], traffic: AgentTraffic, err: bool) -> None:
    click.echo(header(), err=err)
    seen, quiet = 0, 0
    announced = False
    # Failed requests leave no record; after the traffic ends, a few quiet seconds also end it.
    while not (traffic.done.is_set() and (seen >= traffic.sent - traffic.failed or quiet >= 10)):
        try:
            name, data = events.get(timeout=0.5)
            quiet = 0
        except queue.Empty:
            quiet += traffic.done.is_set()
            if traffic.done.is_set() and not announced:
                click.echo(traffic_done_line(traffic), err=err)
                announced = True
            continue
        if name == "request":
            seen += 1
            click.echo(format_request(data), err=err)
        elif name == "cache":
            from server_patch.admin.schema import CacheEvent

            event = CacheEvent.of(data)
            size = f" {render.human_bytes(event.bytes)}" if event.bytes else ""
            click.echo(f"{'':>6} cache    {event.event:<12} {event.entry_id} @{event.length}{size} "
                       f"{event.detail or ''}".rstrip(), err=err)
    if not announced:  # every record came before a quiet moment after the traffic ended
        click.echo(traffic_done_line(traffic), err=err)


@click.command(epilog=EXIT_CODES_SHORT)
@click.option("--requests", "max_requests", type=click.IntRange(min=1), default=60, show_default=True,
              help="Stop the traffic after this many requests.")
@click.option("--duration", type=click.FloatRange(min=1), help="Stop the traffic after this many seconds.")
@click.option("--no-dashboard", is_flag=True, help="Print live request lines instead of opening the dashboard.")
@click.option("--port", type=click.IntRange(1, 65535), help="Port (default: a free one).")
@json_option
def demo(max_requests: int, duration: float | None, no_dashboard: bool, port: int | None, as_json: bool) -> None:
    """Build the tiny model, start a patched server on it, drive agent-like traffic
    (sessions sharing system prompts, a sub-agent, an edit, a regenerate) and watch it.

    Everything lives in the state dir; the server is stopped when the demo ends.
    With --json, prints the final status (hit rate by restore kind) as JSON.

    \b
    Example:
      apcctl demo --no-dashboard --requests 20
    """
    from apcctl.lab.tinymodel.build import build_model

    # Its own directory, outside servers/, so 'apcctl status --all' never lists the demo.
    server = ManagedServer(NAME, root=state_dir())
    server.stop(grace=10)  # a demo left over from an interrupted run
    model = build_model(server.directory / "model", "tiny")
    spec = build_spec(NAME, model=str(model), port=port or free_port(), env={"HF_HUB_OFFLINE": "1", **demo_budget()},
                      directory=server.directory)
    click.echo(f"demo: tiny model {model}\ndemo: starting the patched server at {spec.url} (log {server.log_path})",
               err=as_json)
    reused = earlier_disk_tier(spec)
    if reused:
        click.echo(reused, err=as_json)
    try:
        server.start(spec)
        server.wait_ready(timeout=300)
        first_pid = server.pid()
        target = Target(NAME, spec.url, server.token(), ServerConfig(NAME, url=spec.url), server)
        traffic = AgentTraffic(target.client(timeout=300), model=str(model), max_requests=max_requests,
                               duration=duration)
        traffic.start()
        run_dashboard = None if no_dashboard else _dashboard()
        if run_dashboard is None:
            _print_live(target, traffic, err=as_json)
        else:
            _open_dashboard(run_dashboard, target, traffic)
        traffic.stop.set()
        traffic.done.wait(timeout=310)
        summary = _summary(target, traffic, first_pid)
    except (ManageError, AdminError) as exc:
        raise CommandError(f"demo: {exc}\n{server.log_tail(15)}") from None
    finally:
        server.stop(grace=20)
    if as_json:
        render.emit_json(summary)
    else:
        click.echo(summary_line(summary))
    if traffic.failed:
        raise CommandError(f"demo: {traffic.failed} requests failed; see {server.log_path}")


def _summary(target: Target, traffic: AgentTraffic, first_pid: int | None) -> dict[str, Any]:
    """What was sent, and the server's hit counters; ``pids`` tells a restart in between (the
    counters are then the new process's only)."""
    status = target.client().status()
    return {"sent": traffic.sent, "failed": traffic.failed, "hits": status.hits, "url": target.url,
            "pids": [first_pid, status.server.pid]}


def summary_line(summary: dict[str, Any]) -> str:
    """One line; after a restart in the dashboard, the hit rate says it is the current process's."""
    hits, (first, last) = summary["hits"], summary["pids"]
    rates = (f"hit rate {render.percent(hits.hits, hits.requests)}, "
             f"{render.percent(hits.reused_tokens, hits.reused_tokens + hits.prefill_tokens)} of prompt "
             "tokens reused; by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(hits.by_kind.items())))
    sent = f"demo: {summary['sent']} requests ({summary['failed']} failed)"
    if first == last:
        return f"{sent}, {rates}"
    return (f"{sent}; the server restarted (pid {first} -> {last}), so its counters cover the "
            f"{hits.requests} requests since: {rates}")
