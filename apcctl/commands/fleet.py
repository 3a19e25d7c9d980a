"""``apcctl fleet up|down|status``: several patched servers behind smg, as one.

The servers are ordinary managed servers (``apcctl serve``: own state dir, disk tier, admin token,
PID file and log), so ``apcctl status --all`` and ``apcctl restart`` see them; the gateway is
``smg launch`` with its PID file and log in ``<state dir>/fleets/NAME/``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from apcctl.commands.common import EXIT_CODES_SHORT, CommandError, ExitStatus, json_option
from apcctl.config import ConfigError, load_config
from apcctl.core import render
from apcctl.core.fleet_state import DEFAULT_FLEET, FleetMember, FleetSpec, FleetState
from apcctl.core.gateway import DEFAULT_POLICY, POLICIES, GatewayError, GatewaySpec, require_smg
from apcctl.core.hosts import free_port
from apcctl.core.manage import ServerSpec
from apcctl.fleet.config import DEFAULT_GATEWAY_PORT, FleetConfig, load_fleet
from apcctl.fleet import shared_disk
from apcctl.fleet.lifecycle import STOP_GRACE_S, FleetError, down, remove, up
from apcctl.fleet.status import fleet_status
from apcctl.fleet.traffic import TRACES


def register(main: click.Group, bench: click.Group) -> None:
    main.add_command(fleet)
    bench.add_command(bench_fleet)


def boundaries_option(fn: Any) -> Any:
    return click.option("--cache-boundaries", metavar="N,N,...", callback=_boundaries,
                        help="Token positions for prefix_hash (smg --cache-boundaries), e.g. 2048,8192.")(fn)


def _boundaries(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int]:
    if not value:
        return []
    try:
        out = sorted(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of token positions") from None
    if any(b <= 0 for b in out):
        raise click.BadParameter("token positions must be positive")
    return out


name_option = click.option("--name", "fleet_name", metavar="NAME", help=f"Fleet name (default: the config's, "
                           f"else {DEFAULT_FLEET!r}); its state is <state dir>/fleets/NAME.")
config_option = click.option("--config", "config_path", envvar="APCCTL_CONFIG",
                             type=click.Path(dir_okay=False, path_type=Path),
                             help="TOML config file with a [fleet] table. [env: APCCTL_CONFIG]")


@click.group()
def fleet() -> None:
    """Several patched servers behind the SGLang Model Gateway (smg), managed as one.

    \b
    Quick start (no config file):
      apcctl fleet up --servers 3 --model ~/models/glm5-next --port 30000
      apcctl fleet status
      apcctl fleet top                 # the dashboard, with a Fleet tab
      apcctl fleet down
    Clients then talk to http://127.0.0.1:30000/v1 as to one server. docs/fleet.md.
    """


@fleet.command("up", epilog=EXIT_CODES_SHORT)
@name_option
@click.option("--servers", "count", type=click.IntRange(1, 64), help="Start this many servers on loopback "
              "(without it: the [fleet] table of the config).")
@click.option("--model", "-m", metavar="DIR|REPO", help="Model every started server serves (with --servers).")
@click.option("--port", "-p", type=click.IntRange(1, 65535), help=f"Gateway port (default: the config's, else "
              f"{DEFAULT_GATEWAY_PORT}).")
@click.option("--first-server-port", type=click.IntRange(1, 65535),
              help="With --servers: server i listens on this port + i - 1 (default: the gateway port + 1).")
@click.option("--policy", type=click.Choice(POLICIES), help=f"smg routing policy (default: the config's, else "
              f"{DEFAULT_POLICY}, chosen by apcctl bench fleet).")
@boundaries_option
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for every server started, as for apcctl serve -e.")
@click.option("--shared-disk-path", metavar="DIR",
              help="The servers' shared disk tier (default: the config's [fleet] shared_disk_path, else "
                   "<state dir>/fleets/NAME/shared-disk): each writes DIR/SERVER and restores from the others'. "
                   "DIR must be yours, writable by you only; '' keeps each server's tier private.")
@click.option("--gateway-arg", "gateway_args", multiple=True, metavar="ARG",
              help="Passed to 'smg launch' unchanged (repeat it), e.g. --gateway-arg=--health-check-interval-secs "
                   "--gateway-arg=5.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for each server and for the gateway to list them ready.")
@config_option
@json_option
def fleet_up(fleet_name: str | None, count: int | None, model: str | None, port: int | None,
             first_server_port: int | None, policy: str | None, cache_boundaries: list[int],
             env_pairs: tuple[str, ...], shared_disk_path: str | None, gateway_args: tuple[str, ...], timeout: float,
             config_path: Path | None, as_json: bool) -> None:
    """Start the servers (those not running yet), then smg in front of them on PORT.

    \b
    With --servers N: servers NAME-1 .. NAME-N on loopback, ports PORT+1 .. PORT+N, each an
    'apcctl serve' server (own state dir, disk tier, admin token, PID file, log).
    Without: the [fleet] table of the config (its servers are [servers.*] tables).
    """
    spec, server_specs = plan(fleet_name, count, model, port, first_server_port, policy, cache_boundaries,
                              gateway_args, config_path, env_pairs, shared_disk_path)
    try:
        state = FleetState(spec.name)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    running = state.gateway.process()
    if running is not None:
        raise CommandError(f"fleet {spec.name!r} is already up (gateway pid {running.pid}); "
                           f"apcctl fleet down --name {spec.name}")
    _check_ports(spec.gateway, server_specs)
    try:
        require_smg()  # before any server starts
        workers = up(state, spec, server_specs, timeout=timeout,
                     on_progress=lambda line: click.echo(f"{spec.name}: {line}", err=True))
    except (FleetError, GatewayError) as exc:
        raise CommandError(str(exc)) from None
    process = state.gateway.process()
    info = {"fleet": spec.name, "url": spec.gateway.url, "policy": spec.gateway.policy,
            "gateway_pid": process.pid if process else None,
            "gateway_log": str(state.gateway.log_path), "workers": len(workers),
            "servers": [{"server": m.name, "url": m.url, "managed": m.managed} for m in spec.members]}
    if as_json:
        render.emit_json(info)
    else:
        click.echo(f"{spec.name}: gateway {info['url']} (pid {info['gateway_pid']}, policy {spec.gateway.policy}) "
                   f"in front of {', '.join(m.url for m in spec.members)}")


def plan(fleet_name: str | None, count: int | None, model: str | None, port: int | None,
         first_server_port: int | None, policy: str | None, cache_boundaries: list[int],
         gateway_args: tuple[str, ...], config_path: Path | None,
         env_pairs: tuple[str, ...] = (),
         shared_disk_path: str | None = None) -> tuple[FleetSpec, dict[str, ServerSpec]]:
    """The fleet to start: from the flags (``--servers N``) or the config's ``[fleet]``; flags win."""
    try:
        table = load_fleet(config_path)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if count is None and table is None:
        raise click.UsageError("give --servers N --model DIR, or a [fleet] table in the config file")
    table = table or FleetConfig(servers=())
    name = fleet_name or table.name
    gateway_port = port or table.port
    if count is not None:
        if not model:
            raise click.UsageError("--servers needs --model")
        first = first_server_port or gateway_port + 1
        if first + count - 1 > 65535:
            raise click.UsageError("the server ports run past 65535: give --first-server-port")
        members, server_specs = _started(name, count, model, first, config_path, env_pairs)
    else:
        members, server_specs = _configured(table, config_path, env_pairs)
    server_specs = _shared(name, server_specs, shared_disk_path, table.shared_disk_path)
    urls = [m.url for m in members]
    gateway = GatewaySpec(port=gateway_port, worker_urls=urls, host=table.host, policy=policy or table.policy,
                          cache_boundaries=cache_boundaries or list(table.cache_boundaries),
                          args=[*table.gateway_args, *gateway_args], metrics_port=table.metrics_port or free_port())
    return FleetSpec(name=name, members=members, gateway=gateway), server_specs


def _shared(name: str, specs: dict[str, ServerSpec], flag: str | None,
            table: str | None) -> dict[str, ServerSpec]:
    """One disk tier the servers share (issue 38): ``--shared-disk-path``, else the ``[fleet]`` table's,
    else the fleet's own directory (where a server's own setting does not say otherwise); "" keeps
    each server's tier private."""
    chosen = flag if flag is not None else table
    if chosen == "":
        return {n: replace(s, env={**s.env, shared_disk.SHARED_ENV: ""}) for n, s in specs.items()}
    try:
        directory = shared_disk.checked(chosen) if chosen is not None else None
    except shared_disk.SharedDiskError as exc:
        raise click.UsageError(str(exc)) from None
    return shared_disk.share_for(name, specs, directory)


def _started(fleet_name: str, count: int, model: str, first_port: int, config_path: Path | None,
             env_pairs: tuple[str, ...]) -> tuple[list[FleetMember], dict[str, ServerSpec]]:
    from apcctl.commands.serve import server_spec

    specs = {}
    for i in range(count):
        name = f"{fleet_name}-{i + 1}"
        spec, _ = server_spec(name, model, first_port + i, None, None, env_pairs, config_path, ())
        specs[name] = spec
    return [FleetMember(n, s.url) for n, s in specs.items()], specs


def _configured(table: FleetConfig, config_path: Path | None,
                env_pairs: tuple[str, ...]) -> tuple[list[FleetMember], dict[str, ServerSpec]]:
    """A table with a model is started like ``apcctl serve --server NAME``; one with only a url is fronted."""
    from apcctl.commands.serve import server_spec

    config = load_config(config_path)
    members, specs = [], {}
    for name in table.servers:
        settings = config.servers[name]
        if settings.model is None and settings.url:
            members.append(FleetMember(name, settings.url.rstrip("/"), managed=False))
            continue
        spec, _ = server_spec(name, None, None, None, None, env_pairs, config_path, ())
        specs[name] = spec
        members.append(FleetMember(name, spec.url))
    return members, specs


def _check_ports(gateway: GatewaySpec, server_specs: dict[str, ServerSpec]) -> None:
    from apcctl.commands.serve import port_busy
    from apcctl.core.manage import ManagedServer

    if port_busy(gateway.host, gateway.port):
        raise CommandError(f"gateway port {gateway.port} on {gateway.host} is already in use")
    for name, spec in server_specs.items():
        if ManagedServer(name).pid() is None and port_busy(spec.host, spec.port):
            raise CommandError(f"port {spec.port} for server {name!r} is already in use")


@fleet.command("down", epilog=EXIT_CODES_SHORT)
@name_option
@click.option("--server", "-s", "only", multiple=True, metavar="NAME",
              help="Remove only this server from the fleet (repeat it): flushed, out of the gateway, stopped; "
                   "the gateway and the other servers keep serving, and its files stay readable to them.")
@click.option("--grace", type=click.FloatRange(min=0), default=STOP_GRACE_S, show_default=True,
              help="Seconds between SIGTERM (each server flushes its cache) and SIGKILL.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="With --server: seconds to wait for the flush and for the gateway to let the server go.")
@config_option
@json_option
def fleet_down(fleet_name: str | None, only: tuple[str, ...], grace: float, timeout: float,
               config_path: Path | None, as_json: bool) -> None:
    """Stop the gateway, then the fleet's servers (those the fleet started; remote ones are left alone).

    \b
    With --server NAME: only that server leaves the fleet, as 'fleet restart' takes one out (its
    RAM flushed to the shared disk tier first, then out of smg, which finishes what it sent there),
    then it is stopped and dropped from the fleet's list. Its sessions restore on the other servers
    from its files until APC_SHARED_DISK_RETENTION_S (7 days) after its newest. docs/fleet.md.
    """
    if only:
        _remove_servers(fleet_name, only, grace, timeout, config_path, as_json)
        return
    state = _existing(fleet_name, config_path)
    stopped = down(state, grace)
    results = [{"part": s.part, "pid": s.result.pid, "how": s.result.how} for s in stopped]
    if as_json:
        render.emit_json({"fleet": state.name, "stopped": results})
        return
    for r in results:
        click.echo(f"{r['part']}: " + ("not running" if r["pid"] is None else f"stopped pid {r['pid']} ({r['how']})"))


def _remove_servers(fleet_name: str | None, names: tuple[str, ...], grace: float, timeout: float,
                    config_path: Path | None, as_json: bool) -> None:
    """``fleet down --server``: each named server out of the fleet, in order; the first failure stops."""
    from apcctl.core.client import AdminError

    state, spec, targets = _members(fleet_name, config_path, names)
    if len(set(names)) >= len(spec.members):
        raise click.UsageError(f"that is every server of fleet {state.name!r}: apcctl fleet down --name "
                               f"{state.name} stops the whole fleet")
    results = []
    for target in targets:
        try:
            removed = remove(state, target, grace=grace, timeout=timeout,
                             on_progress=lambda line, name=target.name: click.echo(f"{name}: {line}", err=True))
        except (FleetError, GatewayError, AdminError) as exc:
            raise CommandError(f"{target.name}: not removed: {exc}") from None
        results.append({"server": removed.server, "left_gateway": removed.left_gateway,
                        "pid": removed.result.pid if removed.result else None,
                        "how": removed.result.how if removed.result else "not ours: left running"})
    if as_json:
        render.emit_json({"fleet": state.name, "removed": results})
        return
    for r in results:
        stop = "not started by the fleet, left running" if r["how"].startswith("not ours") else (
            "was not running" if r["pid"] is None else f"stopped pid {r['pid']} ({r['how']})")
        click.echo(f"{r['server']}: " + ("out of the gateway, " if r["left_gateway"] else "")
                   + f"{stop}; its files stay readable to the other servers until the retention")


@fleet.command("status", epilog=EXIT_CODES_SHORT)
@name_option
@config_option
@json_option
def fleet_status_command(fleet_name: str | None, config_path: Path | None, as_json: bool) -> None:
    """The gateway's view of each worker (smg GET /workers) beside the server's own /admin/status.

    A worker the fleet did not start (added to the gateway by someone else) is flagged: smg sends
    clients' prompts to it like to the fleet's own servers."""
    state = _existing(fleet_name, config_path)
    view = fleet_status(state, config_path)
    if as_json:
        render.emit_json(view)
    else:
        gateway = view["gateway"]
        click.echo(f"fleet {view['fleet']}: gateway {gateway['url']} policy {gateway['policy']} "
                   + (f"pid {gateway['pid']}" if gateway["pid"] else "not running")
                   + ("" if gateway.get("reachable") else f" (unreachable: {gateway.get('error')})"))
        render.console().print(render.table(
            ["server", "url", "gateway", "load", "in flight", "draining", "requests", "hit rate", "token reuse"],
            [_row(r) for r in view["workers"]], numeric=("load", "in flight", "requests", "hit rate", "token reuse")))
        for note in _notes(view):
            click.echo(note, err=True)
    if not view["gateway"].get("reachable"):
        raise click.exceptions.Exit(int(ExitStatus.UNREACHABLE))


FOREIGN = "NOT OURS"  # the server cell of a gateway worker the fleet did not start


def _row(r: dict[str, Any]) -> list[str]:
    """One row, every cell a short word or number (why a server is unreachable goes below the
    table, so a long error does not wrap one cell over several lines)."""
    g, s, state = r["gateway"] or {}, r["status"], r["state"]
    server = (r["server"] or "-") if r.get("in_fleet", True) else FOREIGN
    if not s.get("reachable"):
        return [server, r["url"], state, str(g.get("load", "-")), "-", "-", "-", "-", "unreachable"]
    return [server, r["url"], state, str(g.get("load", "-")), str(s["in_flight"]),
            "yes" if s["draining"] else "no", str(s["requests"]), _pct(s["hit_rate"]), _pct(s["token_hit_rate"])]


def _notes(view: dict[str, Any]) -> list[str]:
    notes = [f"{r['server'] or r['url']}: unreachable: {r['status'].get('error')}"
             for r in view["workers"] if not r["status"].get("reachable")]
    notes += [f"warning: the gateway routes to {url}, a worker this fleet did not start (someone with the "
              f"control-plane key added it); prompts sent to the gateway can reach it" for url in view["foreign_workers"]]
    return notes


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _existing(fleet_name: str | None, config_path: Path | None) -> FleetState:
    try:
        table = load_fleet(config_path)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        state = FleetState(fleet_name or (table.name if table else DEFAULT_FLEET))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if state.spec() is None:
        raise CommandError(f"no fleet {state.name!r} (start one with apcctl fleet up)", ExitStatus.NOT_FOUND)
    return state


@click.command("fleet")
@click.option("--model", "-m", metavar="DIR", help="Model for every server (default: the tiny model, built here).")
@click.option("--servers", type=click.IntRange(2, 8), default=3, show_default=True)
@click.option("--requests", type=click.IntRange(4, 400), default=24, show_default=True,
              help="Requests of the trace per policy.")
@click.option("--trace", type=click.Choice(sorted(TRACES)), default="agents", show_default=True,
              help="agents: the demo's agents, sessions sharing system prompts; conversations: the e2e "
                   "tests' independent chats (multi-turn, edit, regenerate, shared openings).")
@click.option("--max-tokens", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--agents", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Clients sending at once, each with its own prompts (the requests are shared out).")
@boundaries_option
@click.option("--only", multiple=True, metavar="POLICY", help="Run only these (a policy name, 'direct', or a label).")
@json_option
def bench_fleet(model: str | None, servers: int, requests: int, trace: str, max_tokens: int, agents: int,
                cache_boundaries: list[int], only: tuple[str, ...], as_json: bool) -> None:
    """Reuse of a trace per smg policy on a loopback fleet, beside one server's.

    Every policy gets a fresh gateway and its own tenant (no entries shared between runs); the
    reuse is cached_tokens / prompt_tokens from the answers' usage. docs/fleet.md.

    \b
    Example:
      apcctl bench fleet --servers 3 --requests 24
      apcctl bench fleet --trace conversations --requests 33
    """
    import shutil
    import tempfile

    from apcctl.fleet.bench import run_bench
    from apcctl.lab.tinymodel.build import build_model

    root = Path(tempfile.mkdtemp(prefix="apcctl-bench-fleet-"))  # servers, disk tiers, logs: kept only on failure
    model = model or str(build_model(root / "model", "tiny"))
    try:
        rows = run_bench(model, servers=servers, requests=requests, max_tokens=max_tokens, agents=agents,
                         boundaries=tuple(cache_boundaries) or (64, 256), only=only, root=root,
                         on_progress=lambda line: click.echo(f"bench fleet: {line}", err=True), trace=trace)
    except Exception as exc:  # GatewayError, ManageError, AdminError, OSError: one message, not a traceback
        raise CommandError(f"bench fleet: {type(exc).__name__}: {exc} (logs kept in {root})") from None
    shutil.rmtree(root, ignore_errors=True)
    baseline = next((r.result.reuse for r in rows if r.variant.policy is None), 0.0)
    out = [r.as_dict(baseline) for r in rows]
    if as_json:
        render.emit_json({"servers": servers, "requests": requests, "max_tokens": max_tokens, "agents": agents,
                          "trace": trace, "rows": out})
        return
    render.console().print(render.table(
        ["policy", "requests", "prompt tokens", "cached", "reuse", "of one server", "split", "anchors pinned",
         "prefilled"],
        [[r["policy"], r["requests"], r["prompt_tokens"], r["cached_tokens"], f"{r['reuse']:.3f}",
          "-" if r["of_one_server"] is None else f"{r['of_one_server']:.2f}", "/".join(map(str, r["split"])),
          render.human_bytes(r["anchor_bytes"]), r["prefilled_tokens"]] for r in out],
        numeric=("requests", "prompt tokens", "cached", "reuse", "of one server", "anchors pinned", "prefilled")))


@fleet.command("restart", epilog=EXIT_CODES_SHORT)
@name_option
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Bound on each wait (the gateway's drain, in-flight requests, readiness), in seconds.")
@click.option("--grace", type=click.FloatRange(min=0), help="Seconds between SIGTERM and SIGKILL (default: the "
              "server's shutdown flush timeout + a margin).")
@click.option("--force", is_flag=True, help="Stop a server even if requests are still in flight after --timeout.")
@click.option("--server", "-s", "only", multiple=True, metavar="NAME",
              help="Restart only these servers of the fleet (repeat it; default: all, in the fleet's order).")
@config_option
@json_option
def fleet_restart_command(fleet_name: str | None, timeout: float, grace: float | None, force: bool,
                          only: tuple[str, ...], config_path: Path | None, as_json: bool) -> None:
    """Restart the fleet's servers one at a time through the gateway: each is taken out of smg
    (it drains there), restarted like 'apcctl restart' (flush, stop, start, probe; a failure rolls
    it back and stops the roll), and put back; clients of the gateway never get a 503."""
    from apcctl.core.restart import RestartStep
    from apcctl.core.roll import fleet_restart

    state, spec, targets = _members(fleet_name, config_path, only)

    def progress(step: RestartStep) -> None:
        click.echo(f"{step.server}: {step.phase} {step.message}".rstrip(), err=True)

    gateway = state.gateway.client(spec.gateway.url, timeout=10.0)
    result = fleet_restart(gateway, targets, on_progress=progress, timeout=timeout, grace=grace, force=force)
    if as_json:
        render.emit_json({"fleet": state.name, **result.as_dict()})
    else:
        for server in result.servers:
            click.echo(f"{server.server}: {'ok' if server.ok else server.phase} {server.message}".rstrip())
    if not result.ok:
        raise click.exceptions.Exit(int(ExitStatus.FAILED))


def _members(fleet_name: str | None, config_path: Path | None,
             only: tuple[str, ...] = ()) -> tuple[FleetState, FleetSpec, list[Any]]:
    """The fleet, its spec and its servers as ``apcctl.config.Target`` (``only``: these names, in the
    fleet's order); an unknown name is a usage error."""
    from apcctl.config import resolve

    state = _existing(fleet_name, config_path)
    spec = state.spec()
    if spec is None:  # removed since _existing looked
        raise CommandError(f"no fleet {state.name!r}", ExitStatus.NOT_FOUND)
    unknown = sorted(set(only) - {m.name for m in spec.members})
    if unknown:
        raise click.UsageError(f"not servers of fleet {state.name!r}: {', '.join(unknown)}")
    try:
        config = load_config(config_path)
        targets = [resolve(m.name if m.managed else m.url, None, config) for m in spec.members
                   if not only or m.name in only]
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return state, spec, targets


@fleet.command("top", epilog=EXIT_CODES_SHORT)
@name_option
@click.option("--server", "-s", "shown", metavar="NAME",
              help="The server the Live, Lineages, Anchors and Log tabs show first (default: the one that "
                   "answered the most requests); Enter on a Fleet row shows another.")
@click.option("--read-only", is_flag=True, help="Hide every key that changes a server: pin, unpin, evict, "
                                                "new anchor, restart.")
@click.option("--interval", type=click.FloatRange(min=0.1, max=3600), default=1.0, show_default=True,
              metavar="SECONDS", help="Seconds between polls (+ and - change it inside).")
@config_option
def fleet_top_command(fleet_name: str | None, shown: str | None, read_only: bool, interval: float,
                      config_path: Path | None) -> None:
    """The dashboard (apcctl top) of one server of the fleet, with a Fleet tab: each server's gateway
    state (healthy, draining, absent), in flight, hit ratio and budgets, and which server each recent
    request went to. Its Restart tab rolls every server of the fleet through the gateway.

    \b
    Examples:
      apcctl fleet top
      apcctl fleet top --server fleet-2 --read-only
    """
    open_fleet_dashboard(fleet_name, shown, read_only=read_only, interval=interval, config_path=config_path)


def open_fleet_dashboard(fleet_name: str | None, shown: str | None, *, read_only: bool, interval: float,
                         config_path: Path | None) -> None:
    """``apcctl fleet top`` and ``apcctl top --fleet``: one server's tabs plus the Fleet tab."""
    from tui.app import run_dashboard
    from tui.fleet import LiveFleetSource, busiest
    from tui.source import SourceError

    state, spec, targets = _members(fleet_name, config_path)
    fleet_source = LiveFleetSource(spec.gateway.url, spec.gateway.policy, [(t.name, t.client()) for t in targets],
                                   state.gateway.key())
    # Without --server: the server the gateway sent the most requests to (Enter on a Fleet row switches).
    if not shown:
        try:
            shown = busiest(fleet_source.snapshot())
        except SourceError:
            shown = None
    chosen = [t for t in targets if t.name == shown] if shown else targets[:1]
    if not chosen:
        raise click.UsageError(f"not a server of fleet {state.name!r}: {shown}")
    run_dashboard(chosen[0].client(), read_only=read_only, restart_targets=targets, refresh_s=interval,
                  fleet=fleet_source)
