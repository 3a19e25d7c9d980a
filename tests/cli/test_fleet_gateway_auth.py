"""The fleet's gateway is not an open control plane: the real smg behind the real Host guard, on loopback.

No patched server is needed: a fleet gateway with no members is started the way ``fleet up``
starts one (``GatewayProcess.start``), and the attacks of issue 34 item 2 are sent to it over
HTTP: adding a worker and deleting one without the control-plane key (refused, 401), the same with
the key (accepted), a foreign ``Host`` (DNS rebinding) and a cross-origin ``Origin`` (403 on every
route, before smg sees them), and ``fleet status`` naming a worker the fleet did not start.
"""

from __future__ import annotations

import http.client
import http.server
import json
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from apcctl.core.client import AdminError
from apcctl.core.fleet_state import FleetSpec, FleetState, fleets_root
from apcctl.core.gateway import GatewayClient, GatewaySpec
from apcctl.core.hosts import free_port
from apcctl.fleet.guard import judge
from apcctl.fleet.status import fleet_status
from server_patch.serving.origins import OriginPolicy
from tests.cli.test_cli_server import run

NAME = "guarded"


class _Rogue(http.server.BaseHTTPRequestHandler):
    """The attacker's worker of the issue: any HTTP server that passes smg's health and model checks."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"status": "ok", "object": "list", "data": [{"id": "rogue", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def rogues() -> Iterator[list[str]]:
    """Two rogue workers on loopback (one per test that adds one)."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Rogue) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{server.server_address[1]}" for server in servers]
    finally:
        for server in servers:
            server.shutdown()


@pytest.fixture(scope="module")
def gateway(cli_env: Path) -> Iterator[FleetState]:
    state = FleetState(NAME)
    spec = FleetSpec(name=NAME, members=[], gateway=GatewaySpec(port=free_port(), worker_urls=[],
                                                                metrics_port=free_port()))
    state.save(spec)
    state.gateway.start(spec.gateway)
    try:
        _wait_listening(state, spec.gateway.url)
        yield state
    finally:
        state.gateway.stop(grace=10)


def _wait_listening(state: FleetState, url: str, timeout: float = 120.0) -> None:
    """Until the gateway (guard and smg) answers the keyed worker list; fail early if it exits."""
    deadline = time.monotonic() + timeout
    while True:
        assert state.gateway.process() is not None, state.gateway.log_tail(30)
        try:
            state.gateway.client(url).workers()
            return
        except AdminError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _url(state: FleetState) -> str:
    spec = state.spec()
    assert spec is not None
    return spec.gateway.url


def _raw(state: FleetState, method: str, path: str, headers: dict[str, str], body: Any = None) -> tuple[int, str]:
    """One request with exactly these headers (http.client lets us set Host ourselves)."""
    spec = state.spec()
    assert spec is not None
    conn = http.client.HTTPConnection(spec.gateway.host, spec.gateway.port, timeout=30)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in {**headers, **({"Content-Type": "application/json", "Content-Length": str(len(data))}
                                          if data is not None else {})}.items():
            conn.putheader(name, value)
        conn.endheaders(data)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


@pytest.mark.server
def test_the_key_is_private_and_never_on_a_command_line(gateway: FleetState) -> None:
    key_path = gateway.gateway.key_path
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(gateway.directory.stat().st_mode) & 0o077 == 0
    key = gateway.gateway.key()
    assert key and len(key) >= 32
    process = gateway.gateway.process()
    assert process is not None
    assert not any(key in arg for arg in process.cmdline())


@pytest.mark.server
def test_workers_cannot_be_listed_added_or_deleted_without_the_key(gateway: FleetState, rogues: list[str]) -> None:
    url = _url(gateway)
    anonymous, wrong = GatewayClient(url, None), GatewayClient(url, "not-the-key")
    for client in (anonymous, wrong):
        for call in (client.workers, lambda c=client: c.add_worker(rogues[0]), lambda c=client: c.remove_worker("x")):
            with pytest.raises(AdminError) as refused:
                call()
            assert refused.value.status in (401, 403), refused.value.message
    assert gateway.gateway.client(url).workers() == []


@pytest.mark.server
def test_with_the_key_a_worker_is_added_and_deleted(gateway: FleetState, rogues: list[str]) -> None:
    keyed = gateway.gateway.client(_url(gateway))
    added = keyed.add_worker(rogues[0])
    worker = _listed(keyed, rogues[0])
    assert worker["id"] == added["worker_id"]
    keyed.remove_worker(worker["id"])
    deadline = time.monotonic() + 60
    while keyed.worker_for(rogues[0]) is not None:
        assert time.monotonic() < deadline, keyed.workers()
        time.sleep(0.2)


def _listed(keyed: GatewayClient, url: str, timeout: float = 60.0) -> dict[str, Any]:
    """smg queues an addition: wait until its worker list has it."""
    deadline = time.monotonic() + timeout
    while (worker := keyed.worker_for(url)) is None:
        assert time.monotonic() < deadline, keyed.workers()
        time.sleep(0.2)
    return worker


@pytest.mark.server
@pytest.mark.parametrize("path", ["/workers", "/v1/models", "/health"])
def test_a_foreign_host_or_origin_is_refused_before_smg(gateway: FleetState, path: str) -> None:
    spec = gateway.spec()
    assert spec is not None
    own = f"127.0.0.1:{spec.gateway.port}"
    auth = {"Authorization": f"Bearer {gateway.gateway.key()}"}
    status, body = _raw(gateway, "GET", path, {"Host": f"evil.example:{spec.gateway.port}", **auth})
    assert status == 403 and "DNS-rebound" in json.loads(body)["detail"]
    status, body = _raw(gateway, "GET", path, {"Host": own, "Origin": "http://evil.example", **auth})
    assert status == 403 and "cross-origin" in json.loads(body)["detail"]
    # The same request with this gateway's own names reaches smg (no 403: smg's own answer).
    for headers in ({"Host": own}, {"Host": f"localhost:{spec.gateway.port}"}, {"Host": own, "Origin": f"http://{own}"}):
        status, _ = _raw(gateway, "GET", path, {**headers, **auth})
        assert status != 403, (path, headers)


@pytest.mark.server
def test_a_refused_post_never_adds_the_worker(gateway: FleetState, rogues: list[str]) -> None:
    """The rebinding attack end to end: a page at evil.example holding even the right key is refused."""
    spec = gateway.spec()
    assert spec is not None
    status, _ = _raw(gateway, "POST", "/workers", {"Host": f"evil.example:{spec.gateway.port}",
                                                   "Authorization": f"Bearer {gateway.gateway.key()}"},
                     {"url": rogues[1]})
    assert status == 403
    assert gateway.gateway.client(spec.gateway.url).worker_for(rogues[1]) is None


@pytest.mark.server
def test_status_flags_a_worker_the_fleet_did_not_start(gateway: FleetState, rogues: list[str]) -> None:
    keyed = gateway.gateway.client(_url(gateway))
    rogue = rogues[1]
    keyed.add_worker(rogue)
    try:
        _listed(keyed, rogue)
        view = fleet_status(gateway)
        assert view["foreign_workers"] == [rogue]
        assert [r["in_fleet"] for r in view["workers"]] == [False]
        assert (fleets_root() / NAME).resolve() == gateway.directory.resolve()
        shown = run("fleet", "status", "--name", NAME)
        assert "NOT OURS" in shown.stdout
        assert f"warning: the gateway routes to {rogue}" in shown.stderr
    finally:
        worker = keyed.worker_for(rogue)
        if worker is not None:
            keyed.remove_worker(worker["id"])


def test_the_guard_refuses_malformed_and_smuggled_heads() -> None:
    """The head checks, without a socket: one request per connection, as smg must see it."""
    policy = OriginPolicy.from_env({}, bound_hosts=["127.0.0.1"])
    ok = judge(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:30000\r\nConnection: keep-alive\r\n\r\n", policy)
    assert ok.status == 0
    assert ok.head == b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:30000\r\nConnection: close\r\n\r\n"
    for head in (b"GET /x HTTP/1.1\r\nHost: a\r\nHost: 127.0.0.1\r\n\r\n",  # two Hosts
                 b"GET /x HTTP/1.1\r\n\r\n",  # none
                 b"GET http://evil.example/x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # absolute form
                 b"PRI * HTTP/2.0\r\n\r\n",
                 b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n X-Folded: y\r\n\r\n",
                 b"GET /x HTTP/1.1\r\nHost : 127.0.0.1\r\n\r\n"):
        assert judge(head, policy).status == 400, head
    assert judge(b"GET /x HTTP/1.1\r\nHost: evil.example\r\n\r\n", policy).status == 403
    assert judge(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: null\r\n\r\n", policy).status == 403
    listed = OriginPolicy.from_env({"APC_ALLOWED_HOSTS": "gpu.example"}, bound_hosts=["127.0.0.1"])
    assert judge(b"GET /x HTTP/1.1\r\nHost: gpu.example:30000\r\n\r\n", listed).status == 0
