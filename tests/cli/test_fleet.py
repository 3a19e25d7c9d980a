"""A fleet: three real patched servers behind the real smg gateway, on loopback.

``apcctl fleet up`` starts them; the demo's agent trace (sessions sharing system prompts, a
sub-agent, an edit, a regenerate) goes through the gateway with no routing header and keeps at
least 0.9 of the reuse the same trace gets from one server, and every answer equals a cold
prefill's; ``fleet status --json`` shows the three ready workers beside their servers' own
status; ``fleet restart`` rolls servers through the gateway while a client that never retries
sees no error, and a server whose new command fails is rolled back, put back in the gateway and
ends the roll; ``fleet down`` leaves no process behind.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from apcctl.commands.common import ExitStatus
from apcctl.config import ConfigError
from apcctl.core.client import AdminClient, AdminError
from apcctl.core.fleet_state import FleetState
from apcctl.core.gateway import GatewayClient, worker_state
from apcctl.core.hosts import free_port
from apcctl.core.manage import ManagedServer
from apcctl.fleet.config import parse_fleet
from apcctl.fleet.traffic import RecordingClient, replay
from tests.server_harness import TrafficLoop, assert_same_output
from tui.fleet import LiveFleetSource
from tests.cli.test_cli_server import run, run_json

AGENTS = 3  # agents at once, each with its own system prompts, as several users of one fleet
REQUESTS = 24  # 8 per agent: 3 turns, a second session (the anchor), a coder and its sub-agent, an edit, a regenerate
MAX_TOKENS = 4
LOGPROBS = {"logprobs": True, "top_logprobs": 5}
SHARED_TIER = "fleet-tier"  # fleet up --shared-disk-path, under the module's directory


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that nothing listens on (a small race remains)."""
    for _ in range(50):
        first = free_port()
        if first + count >= 65535:
            continue
        if all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def fleet(cli_env: Path, tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    port = free_ports(4)
    # smg waits about 5 s on SIGTERM even with nothing in flight (its default grace is 180 s);
    # nothing is in flight when `fleet down` stops this module's gateway, so 1 s is all it needs.
    info = run_json("fleet", "up", "--servers", "3", "--model", str(tiny_model_dir), "--port", str(port),
                    "-e", "TOP_LOGPROBS_K=5", "-e", "APC_TENANT_FROM_USER=1", "--gateway-arg=--disable-retries",
                    "--gateway-arg=--shutdown-grace-period-secs=1", "--shared-disk-path", str(cli_env / SHARED_TIER))
    try:
        yield info
    finally:
        run("fleet", "down", "--grace", "10")


def _server_urls(info: dict[str, Any]) -> list[str]:
    return [s["url"] for s in info["servers"]]


@pytest.mark.server
def test_agent_trace_through_the_gateway_keeps_one_servers_reuse(fleet: dict[str, Any],
                                                                 tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    urls = _server_urls(fleet)
    through = replay(fleet["url"], model=model, requests=REQUESTS, max_tokens=MAX_TOKENS, tenant="fleet",
                     agents=AGENTS, extra=LOGPROBS)
    split = [r["status"]["requests"] for r in run_json("fleet", "status")["workers"]]
    direct = replay(urls[0], model=model, requests=REQUESTS, max_tokens=MAX_TOKENS, tenant="one server",
                    agents=AGENTS, extra=LOGPROBS)
    assert through.failed == direct.failed == 0
    assert len(through.sent) == len(direct.sent) == REQUESTS
    assert direct.reuse > 0.5, [(s.kind, s.prompt_tokens, s.cached_tokens) for s in direct.sent]
    print(f"fleet reuse {through.reuse:.3f} (split {split}), one server {direct.reuse:.3f}")  # docs/fleet.md
    assert through.reuse >= 0.9 * direct.reuse, (
        through.reuse, direct.reuse, [(s.conversation, s.kind, s.cached_tokens) for s in through.sent])
    # Every answer the fleet gave equals a cold prefill of the same prompt (a fresh tenant: nothing to
    # reuse), asked of the three servers side by side, one request at a time on each.

    def cold(server: int) -> list[tuple[Any, dict[str, Any]]]:
        client = RecordingClient(urls[server], timeout=300.0, extra=LOGPROBS)
        done = []
        for sent in through.sent[server::len(urls)]:
            client.tenant = f"cold-{uuid.uuid4().hex[:8]}"
            done.append((sent, client.chat(sent.messages, model=model, max_tokens=MAX_TOKENS, temperature=0.0)))
        return done

    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        references = [pair for share in pool.map(cold, range(len(urls))) for pair in share]
    assert len(references) == len(through.sent)
    for sent, reference in references:
        assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, reference["usage"]
        assert_same_output(sent.answer, reference)


def _fleet_view(fleet: dict[str, Any]) -> LiveFleetSource:
    from apcctl.config import load_config, resolve

    config = load_config(None)
    members = [resolve(s["server"], None, config) for s in fleet["servers"]]
    return LiveFleetSource(fleet["url"], "cache_aware", [(t.name, t.client()) for t in members],
                           FleetState(fleet["fleet"]).gateway.key())


def _served(fleet: dict[str, Any]) -> dict[str, int]:
    return {r["server"]: r["status"]["requests"] for r in run_json("fleet", "status")["workers"]}


@pytest.mark.server
def test_a_tenant_crosses_the_gateway_as_the_user_field(fleet: dict[str, Any], tiny_model_dir: Path) -> None:
    """smg drops X-APC-Tenant but forwards the body: with APC_TENANT_FROM_USER=1 the servers take the
    OpenAI ``user`` field as the tenant, so one tenant's entries stay its own behind the gateway."""
    system = "You check tenants behind a gateway. " + " ".join(f"fact {i} is {uuid.uuid4().hex[:6]}." for i in range(12))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which facts?"}]
    client = RecordingClient(fleet["url"], timeout=300.0)  # no tenant header: only the body carries one

    def ask(user: str) -> tuple[int, str]:
        before = _served(fleet)
        client.extra = {"user": user}
        answer = client.chat(messages, model=str(tiny_model_dir), max_tokens=2, temperature=0.0)
        after = _served(fleet)
        (server,) = [name for name in after if after[name] != before[name]]
        return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0), server

    cold, home = ask("tenant-a")
    warm, again = ask("tenant-a")
    other, other_home = ask("tenant-b")
    assert cold == 0 and warm > 0 and again == home, (cold, warm, home, again)
    # Same text, same server (cache_aware follows the prefix), but another tenant: nothing reused.
    assert other_home == home and other == 0, (other, other_home, home)


@pytest.mark.server
def test_status_shows_the_gateway_view_beside_each_server(fleet: dict[str, Any]) -> None:
    view = run_json("fleet", "status")
    assert view["gateway"]["reachable"] and view["gateway"]["pid"] == fleet["gateway_pid"]
    assert view["ready_workers"] == 3
    assert sorted(r["url"] for r in view["workers"]) == sorted(_server_urls(fleet))
    for row in view["workers"]:
        assert row["gateway"]["status"] == "ready" and row["gateway"]["is_healthy"], row
        assert row["status"]["reachable"] and row["status"]["in_flight"] == 0, row
    served = {r["server"] for r in view["workers"] if r["status"]["requests"]}
    human = run("fleet", "status").stdout
    assert all(s["server"] in human for s in fleet["servers"]), human
    # `apcctl status --all` shows the gateway's state of each server beside the server's own status.
    everyone = {r["server"]: r for r in run_json("status", "--all")}
    assert {everyone[s["server"]]["gateway"]["state"] for s in fleet["servers"]} == {"healthy"}, everyone
    assert {everyone[s["server"]]["gateway"]["fleet"] for s in fleet["servers"]} == {"fleet"}
    # Out of the gateway by hand: absent there, still up on its own; back in, healthy again.
    # The gateway's worker API takes the fleet's control-plane key, and nothing without it.
    with pytest.raises(AdminError) as anonymous:
        GatewayClient(fleet["url"], None, timeout=10.0).workers()
    assert anonymous.value.status == 401
    gateway = FleetState(fleet["fleet"]).gateway.client(fleet["url"], timeout=10.0)
    third = fleet["servers"][2]
    gateway.remove_worker(str(gateway.worker_for(third["url"])["id"]))
    while gateway.worker_for(third["url"]) is not None:
        time.sleep(0.2)
    assert f"absent in fleet fleet ({fleet['url']})" in run("status", "--server", third["server"]).stdout
    # The dashboard's fleet view asks the same gateway and servers over HTTP.
    seen = _fleet_view(fleet).snapshot()
    assert [(s.name, s.state) for s in seen.servers] == [("fleet-1", "healthy"), ("fleet-2", "healthy"),
                                                         ("fleet-3", "absent")]
    assert seen.healthy == 2 and all(s.status is not None for s in seen.servers)
    # Each recent request is named by the server that served it (the servers' own records).
    assert {r.data["server"] for r in seen.recent} == served
    assert len({r.key for r in seen.recent}) == len(seen.recent)
    gateway.add_worker(third["url"])
    gateway.wait_ready([third["url"]], 60)
    assert run_json("status", "--server", third["server"])["gateway"]["state"] == "healthy"


@dataclass(kw_only=True)
class NeverRetries(TrafficLoop):
    """Sends short requests through the gateway one after the other, never retrying: any error
    is a failure a client would see."""

    url: str
    model: str

    def __post_init__(self) -> None:
        self.client = RecordingClient(self.url, timeout=120.0)

    def send_round(self, i: int) -> None:
        try:
            self.client.chat([{"role": "user", "content": f"question {i} about the fleet"}], model=self.model,
                             max_tokens=2, temperature=0.0)
            self.ok += 1
        except AdminError as exc:
            self.errors.append(exc.message)


@pytest.mark.server
def test_restart_through_the_gateway_fails_no_request(fleet: dict[str, Any], tiny_model_dir: Path) -> None:
    """Two of the three servers roll (the roll moves on only once the first is back); smg runs
    with --disable-retries, so no gateway retry hides a 503 either."""
    before = {r["server"]: r["status"]["pid"] for r in run_json("fleet", "status")["workers"]}
    client = NeverRetries(url=fleet["url"], model=str(tiny_model_dir))
    thread = threading.Thread(target=client.run)
    thread.start()
    try:
        # The plain 'apcctl restart' knows fleet-1 is behind a running gateway and goes through it;
        # 'fleet restart' does the same for the fleet's own selection.
        plain = run("restart", "--server", "fleet-1", "--grace", "20", "--json")
        result = run_json("fleet", "restart", "--server", "fleet-2", "--grace", "20")
    finally:
        client.stop.set()
        thread.join(timeout=300)
    assert "out of the gateway" in plain.stderr, plain.stderr
    servers = json.loads(plain.stdout)["servers"] + result["servers"]
    assert result["ok"], result
    assert [s["server"] for s in servers] == ["fleet-1", "fleet-2"]
    assert all(s["ok"] and s["new_pid"] != s["old_pid"] for s in servers), servers
    print(f"restart through the gateway: {client.ok} requests, {len(client.errors)} failed")
    assert client.errors == [] and client.ok > 0, client.errors[:5]
    after = run_json("fleet", "status")
    assert after["ready_workers"] == 3
    pids = {r["server"]: r["status"]["pid"] for r in after["workers"]}
    assert pids["fleet-3"] == before["fleet-3"] and pids["fleet-1"] != before["fleet-1"]


@pytest.mark.server
def test_a_failed_restart_rolls_back_rejoins_the_gateway_and_stops_the_roll(fleet: dict[str, Any],
                                                                            tiny_model_dir: Path) -> None:
    """fleet-1's next command exits at once: it is rolled back to the previous one, put back in
    the gateway, and fleet-2 is not touched; the gateway's clients still see no error.
    (``--reload``: server_patch.launch refuses it before loading anything, so the failed start
    costs no import of mlx-vlm; an unknown option fails only in mlx-vlm's own parser.)"""
    managed = ManagedServer("fleet-1")
    previous = managed.spec()
    assert previous is not None
    managed.save(replace(previous, argv=[*previous.argv, "--reload"]))
    before = {r["server"]: r["status"]["pid"] for r in run_json("fleet", "status")["workers"]}
    client = NeverRetries(url=fleet["url"], model=str(tiny_model_dir))
    thread = threading.Thread(target=client.run)
    thread.start()
    try:
        result = run("fleet", "restart", "--server", "fleet-1", "--server", "fleet-2", "--grace", "20", "--json",
                     code=int(ExitStatus.FAILED))
    finally:
        client.stop.set()
        thread.join(timeout=300)
    body = json.loads(result.stdout)
    first, second = body["servers"]
    assert not body["ok"] and not first["ok"] and first["rolled_back"] and first["rollback"]["ready"], first
    assert "--reload is not supported" in first["log_tail"] and "\n" not in first["message"]  # the verdict is one line
    assert second["server"] == "fleet-2" and second["phase"] == "plan" and not second["ok"]
    assert client.errors == [] and client.ok > 0, client.errors[:5]
    after = run_json("fleet", "status")
    assert after["ready_workers"] == 3
    pids = {r["server"]: r["status"]["pid"] for r in after["workers"]}
    assert pids["fleet-2"] == before["fleet-2"] and pids["fleet-1"] != before["fleet-1"]
    assert managed.spec().argv == previous.argv  # the rollback's command is the one kept


@pytest.mark.server
def test_down_server_removes_one_and_its_sessions_continue_from_its_files(fleet: dict[str, Any], cli_env: Path,
                                                                         tiny_model_dir: Path) -> None:
    """``fleet down --server NAME``: flushed, out of the gateway, stopped, off the fleet's list; the
    gateway keeps serving with the others, which restore its sessions from its files (the shared
    tier given by ``fleet up --shared-disk-path``), with a cold prefill's answer."""
    model = str(tiny_model_dir)
    client = RecordingClient(fleet["url"], timeout=300.0, extra=LOGPROBS)
    client.tenant = f"removal-{uuid.uuid4().hex[:8]}"
    counts = {r["server"]: r["status"]["requests"] for r in run_json("fleet", "status")["workers"]}
    turn = [{"role": "system", "content": "You review pull requests for a storage team. " * 12},
            {"role": "user", "content": "Is a rename after fsync enough to publish a file atomically?"}]
    first = client.chat(turn, model=model, max_tokens=MAX_TOKENS, temperature=0.0)
    served = next(r["server"] for r in run_json("fleet", "status")["workers"]
                  if r["status"]["requests"] != counts[r["server"]])
    others = sorted(set(counts) - {served})
    # An unknown name, or every server (that is `fleet down`): usage errors that change nothing.
    unknown = run("fleet", "down", "--server", "fleet-9", code=int(ExitStatus.USAGE))
    assert "not servers of fleet 'fleet': fleet-9" in unknown.output and "Traceback" not in unknown.output
    every = run("fleet", "down", *[a for n in counts for a in ("--server", n)], code=int(ExitStatus.USAGE))
    assert "every server" in every.output
    process = psutil.Process(ManagedServer(served).pid())
    removed = run_json("fleet", "down", "--server", served, "--grace", "10")
    [gone] = removed["removed"]
    assert (gone["server"], gone["left_gateway"], gone["pid"]) == (served, True, process.pid), gone
    assert gone["how"] in ("SIGTERM", "SIGKILL"), gone
    assert not _alive(process)
    view = run_json("fleet", "status")
    assert sorted(r["server"] for r in view["workers"]) == others
    assert all(r["state"] == "healthy" for r in view["workers"]), view["workers"]
    assert [m.name for m in FleetState("fleet").spec().members] == others
    files = list((cli_env / SHARED_TIER / served).rglob("*.safetensors"))
    assert files, "the removed server's files stay for its peers"
    for name in others:  # each remaining server lists the removed one's files (its own scan thread)
        admin = AdminClient(ManagedServer(name).spec().url, ManagedServer(name).token())
        deadline = time.monotonic() + 120
        while (lineage := admin.status()["lineage"]) is not None and not lineage["disk"]["peers"]["files"].get(served):
            assert time.monotonic() < deadline, lineage["disk"]["peers"]
            time.sleep(0.05)
    after = turn + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And on NFS?"}]
    warm = client.chat(after, model=model, max_tokens=MAX_TOKENS, temperature=0.0)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, warm["usage"]  # from the removed one's file
    cold = RecordingClient(ManagedServer(others[0]).spec().url, timeout=300.0, extra=LOGPROBS)
    cold.tenant = f"cold-{uuid.uuid4().hex[:8]}"
    reference = cold.chat(after, model=model, max_tokens=MAX_TOKENS, temperature=0.0)
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_same_output(warm, reference)
    assert all(f.exists() for f in files)  # its peers never remove its files (retention does, much later)


@pytest.mark.server
def test_down_leaves_no_process(fleet: dict[str, Any]) -> None:
    """Last of the fleet tests: it takes the module's fleet down."""
    view = run_json("fleet", "status")
    processes = [psutil.Process(fleet["gateway_pid"])] + [psutil.Process(r["status"]["pid"]) for r in view["workers"]]
    members = [m.name for m in FleetState("fleet").spec().members]  # less one, after fleet down --server
    assert len(processes) == 1 + len(members) and all(_alive(p) for p in processes)
    stopped = run_json("fleet", "down", "--grace", "10")
    assert [s["part"] for s in stopped["stopped"]] == ["gateway", *members]
    assert all(s["how"] in ("SIGTERM", "SIGKILL") for s in stopped["stopped"]), stopped
    assert not any(_alive(p) for p in processes)
    result = run("fleet", "status", "--json", code=int(ExitStatus.UNREACHABLE))
    assert json.loads(result.stdout)["gateway"]["pid"] is None
    # Stopped on purpose: `status --all` lists them as stopped and exits 0 (docker ps -a's Exited);
    # asked for by name, a stopped server is still "not running" (exit 3).
    listed = {r["server"]: r for r in run_json("status", "--all")}
    assert {listed[s["server"]].get("state") for s in fleet["servers"]} == {"stopped"}, listed
    assert "stopped (apcctl serve --server fleet-1" in run("status", "--all").stdout
    run("status", "--server", "fleet-1", code=int(ExitStatus.UNREACHABLE))


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_bad_fleet_input_is_a_usage_error(cli_env: Path, tmp_path: Path) -> None:
    run("fleet", "up", code=int(ExitStatus.USAGE))  # neither --servers nor a [fleet] table
    run("fleet", "up", "--servers", "2", code=int(ExitStatus.USAGE))  # no --model
    run("fleet", "up", "--servers", "2", "--model", "m", "--policy", "nearest", code=int(ExitStatus.USAGE))
    run("fleet", "up", "--servers", "2", "--model", "m", "--cache-boundaries", "2k", code=int(ExitStatus.USAGE))
    run("fleet", "status", "--name", "nothing-here", code=int(ExitStatus.NOT_FOUND))
    run("fleet", "top", "--name", "nothing-here", code=int(ExitStatus.NOT_FOUND))
    config = tmp_path / "config.toml"
    config.write_text('[servers.a]\nmodel = "m"\nport = 9001\n\n[fleet]\nservers = ["a", "b"]\n')
    result = run("fleet", "up", "--config", str(config), code=int(ExitStatus.USAGE))
    assert "names no [servers.*] table" in result.output and "'b'" in result.output


def test_bench_rows_split_the_reuse_by_request_kind() -> None:
    from apcctl.fleet.bench import Row, Variant
    from apcctl.fleet.traffic import Sent, TraceResult

    def sent(kind: str, prompt: int, cached: int) -> Sent:
        return Sent("c", kind, [], {"usage": {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}})

    row = Row(Variant("cache_aware", "cache_aware"), TraceResult([sent("turn", 10, 8), sent("new_session", 6, 0),
                                                                   sent("turn", 20, 15)], 0), [2, 1, 0])
    out = row.as_dict(baseline=0.8)
    assert out["reuse"] == round(23 / 36, 4) and out["of_one_server"] == round(23 / 36 / 0.8, 4)
    assert out["by_kind"] == {"turn": {"requests": 2, "prompt_tokens": 30, "cached_tokens": 23},
                              "new_session": {"requests": 1, "prompt_tokens": 6, "cached_tokens": 0}}


def test_an_unreachable_server_keeps_fleet_status_columns_short() -> None:
    """Why a server does not answer goes below the table: a long error in a cell wrapped the row."""
    from apcctl.commands.fleet import FOREIGN, _notes, _row

    error = "cannot reach http://127.0.0.1:30002: [Errno 111] Connection refused " * 2
    down = {"server": "fleet-2", "url": "http://127.0.0.1:30002", "in_fleet": True, "state": "absent",
            "gateway": None, "status": {"reachable": False, "error": error}}
    up = {"server": None, "url": "http://127.0.0.1:9", "in_fleet": False, "state": "healthy",
          "gateway": {"load": 0}, "status": {"reachable": True, "in_flight": 0, "draining": False, "requests": 3,
                                             "hit_rate": 0.5, "token_hit_rate": 0.25}}
    for row in (_row(down), _row(up)):
        assert len(row) == 9 and max(len(cell) for cell in row[2:]) <= len("unreachable"), row
    assert _row(down)[-1] == "unreachable" and _row(up)[0] == FOREIGN
    notes = _notes({"workers": [down, up], "foreign_workers": [up["url"]]})
    assert notes[0] == f"fleet-2: unreachable: {error}" and up["url"] in notes[1]


def test_worker_state_names_what_the_gateway_does_with_a_server() -> None:
    assert worker_state(None) == "absent"
    assert worker_state({"status": "ready", "is_healthy": True}) == "healthy"
    assert worker_state({"status": "ready", "is_healthy": False}) == "unhealthy"
    assert worker_state({"status": "pending"}) == "unhealthy"
    assert worker_state({"status": "draining", "is_healthy": True}) == "draining"


def test_fleet_table_parses_and_rejects(tmp_path: Path) -> None:
    parsed = parse_fleet({"servers": ["a", "b"], "port": 31000, "policy": "prefix_hash",
                          "cache_boundaries": [8192, 2048]}, "c.toml", {"a", "b"})
    assert parsed.servers == ("a", "b") and parsed.port == 31000 and parsed.cache_boundaries == (2048, 8192)
    for bad in ({"servers": []}, {"servers": ["a"], "port": 0}, {"servers": ["a"], "policy": "x"},
                {"servers": ["a", "a"]}, {"servers": ["a"], "cache_boundaries": [-1]}, {"servers": ["a"], "extra": 1}):
        with pytest.raises(ConfigError):
            parse_fleet(bad, "c.toml", {"a"})


def _through_tenant_middleware(path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                               method: str = "POST") -> tuple[bytes | None, bytes]:
    """What the app behind RequestNamespace (``APC_TENANT_FROM_USER=1``) sees: its X-APC-Tenant
    header and the body it reads."""
    import asyncio

    from server_patch.tenancy.middleware import RequestNamespace

    seen: dict[str, Any] = {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen["tenant"] = dict(scope["headers"]).get(b"x-apc-tenant")
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        seen["body"] = b"".join(chunks)

    parts = [body[:5], body[5:]]  # the body arrives in two messages, as a client may send it

    async def receive() -> dict:
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(RequestNamespace(app, from_user=True)(scope, receive, lambda message: None))
    return seen["tenant"], seen["body"]


JSON = [(b"content-type", b"application/json")]


def test_the_user_field_becomes_the_tenant_header_and_the_body_is_unchanged() -> None:
    body = json.dumps({"model": "m", "messages": [], "user": "alice"}).encode()
    assert _through_tenant_middleware("/v1/chat/completions", body, JSON) == (b"alice", body)
    anthropic = json.dumps({"model": "m", "metadata": {"user_id": "bob"}}).encode()
    assert _through_tenant_middleware("/v1/messages", anthropic, JSON)[0] == b"bob"
    # A tenant header the request carries wins (a blank one does not); /admin, GET and odd values are
    # left alone; any content type is read, as mlx-vlm's handlers call request.json() whatever it says.
    assert _through_tenant_middleware("/v1/chat/completions", body, JSON + [(b"x-tenant-id", b"t")])[0] == b"t"
    assert _through_tenant_middleware("/v1/chat/completions", body, JSON + [(b"x-apc-tenant", b" ")])[0] == b"alice"
    assert _through_tenant_middleware("/admin/anchors", body, JSON)[0] is None
    assert _through_tenant_middleware("/v1/chat/completions", body, [(b"content-type", b"text/plain")])[0] == b"alice"
    for odd in (b"not json", json.dumps({"user": 7}).encode(), json.dumps({"user": "x" * 300}).encode(),
                json.dumps(["user"]).encode(), json.dumps({"user": "  "}).encode()):
        assert _through_tenant_middleware("/v1/chat/completions", odd, JSON) == (None, odd)


def test_tenant_from_user_is_opt_in_and_a_bad_value_stops_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from server_patch.tenancy import middleware as tenant

    class App:
        added: list[Any] = []

        def __init__(self) -> None:
            self.state = types.SimpleNamespace()  # starlette's app.state: install records the key switch there

        def add_middleware(self, cls: Any, **options: Any) -> None:
            self.added.append((cls, options["from_user"]))

    for value, from_user in (("", False), ("0", False), ("1", True)):
        App.added = []
        monkeypatch.setenv(tenant.ENV, value)
        tenant.install(App())  # the namespace middleware is always there; the user field is opt-in
        assert App.added == [(tenant.RequestNamespace, from_user)], value
    monkeypatch.setenv(tenant.ENV, "maybe")
    with pytest.raises(SystemExit, match="APC_TENANT_FROM_USER"):
        tenant.install(App())
