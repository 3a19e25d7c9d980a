"""The dashboard against a real patched server on the tiny model.

It fills its tables from the live poll and event stream, a pin and an evict confirmed in the
dialog change what the server holds, it rides out a server restart on the same port, and its
Restart tab rolls a server started by ``apcctl serve`` and follows it to the new process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apcctl.config import select
from apcctl.core.client import AdminClient
from tests.server_harness import ADMIN_TOKEN, PatchedServer
from tests.cli.test_cli_server import serve
from tui.app import DashboardApp, make_app, restarter_for
from tui.screens.confirm import ConfirmScreen
from tui.source import LiveSource
from tui.testing import settle, sync, wait_for

pytestmark = pytest.mark.server
SIZE = (140, 40)
SYSTEM = {"role": "system", "content": "You are the dashboard test's assistant. " * 12}


@pytest.fixture
def server(tiny_model_dir: Path, tmp_path: Path):
    server = PatchedServer(tiny_model_dir, log_dir=tmp_path).start()
    yield server
    server.stop()


def traffic(server: PatchedServer, turns: int = 2) -> None:
    """One conversation over ``turns`` turns and a second session on the same system prompt."""
    messages = [SYSTEM]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question number {turn} about caching."})
        reply = server.chat(messages, max_tokens=4)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "ok"})
    server.chat([SYSTEM, {"role": "user", "content": "A different session."}], max_tokens=4)


def live_app(server: PatchedServer) -> tuple[DashboardApp, AdminClient]:
    client = AdminClient(server.base_url, ADMIN_TOKEN)
    return make_app(LiveSource(client), refresh_s=0.5), client


@sync
async def test_tables_fill_from_the_server_a_pin_then_an_evict_change_it_and_the_app_survives_a_restart(
        server: PatchedServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """One server and one app for all three (their setup is the same traffic): the tables fill from
    the poll and the event stream, then the dialog's pin and evict reach the server, then the
    server is stopped and started again on its port and the app follows it there by itself."""
    traffic(server)
    app, client = live_app(server)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await wait_for(pilot, lambda: len(app.state.requests) >= 3)
        await settle(pilot)
        requests = app.query_one("#requests")
        assert requests.row_count == len(client.requests()) == 3
        entries = {e["id"] for e in client.entries()}
        await pilot.press("2")
        await wait_for(pilot, lambda: {k.value for k in app.query_one("#pane-lineages").table.rows} == entries)
        await pilot.press("3")
        anchors = {a["id"] for a in client.anchors()}
        assert anchors and {k.value for k in app.query_one("#pane-anchors").table.rows} == anchors
        assert app.state.process is not None and app.state.process.pid == server.pid  # psutil: RSS and CPU
        # The Log tab has a line per request of /admin/events, in the server's order.
        await pilot.press("5")
        log = app.query_one("#event-log")
        seqs = [r["seq"] for r in client.requests()]
        await wait_for(pilot, lambda: [line.text.split("#")[1].split()[0] for line in log.lines
                                       if " request " in line.text] == [str(n) for n in seqs])
        # Drill-down: the newest warm request opens the entry it restored from.
        await pilot.press("1")
        held = {e["id"] for e in client.entries()}
        warm = next(r for r in reversed(client.requests()) if r["entry_id"] in held)
        assert requests.select_key(f"{server.pid}:{warm['seq']}")
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one("#pane-lineages").table.selected_key == warm["entry_id"]

        # Pin, then evict, through the dialog: each changes what the server holds.
        target = next(e["id"] for e in client.entries() if e["kind"] == "conversation" and e["tier"] != "disk")
        await pilot.press("2")
        table = app.query_one("#pane-lineages").table
        await wait_for(pilot, lambda: table.select_key(target))
        await pilot.press("p")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await wait_for(pilot, lambda: client.entry(target)["pinned"])
        assert client.entry(target)["kind"] == "anchor"
        await wait_for(pilot, lambda: (app.state.entry(target) or {}).get("pinned"))
        assert table.select_key(target)
        await pilot.press("x")
        assert "Frees" in app.screen.impact.body
        await pilot.press("y")
        await wait_for(pilot, lambda: target not in {e["id"] for e in client.entries()})
        await wait_for(pilot, lambda: app.state.entry(target) is None)

        # The server stops and starts again on the same port: the app notices, and reconnects.
        assert app.state.restarts_seen == 0 and app.state.connection.reconnects == 0
        first_pid = app.state.server.pid
        server.stop()
        await wait_for(pilot, lambda: app.state.connection.state == "lost")
        again = PatchedServer(tiny_model_dir, port=server.port, log_dir=tmp_path / "again").start()
        try:
            await wait_for(pilot, lambda: app.state.connection.state == "live" and app.state.server.pid == again.pid)
            assert again.pid != first_pid and app.state.restarts_seen == 1
            assert app.state.connection.reconnects == 1
            again.chat([SYSTEM, {"role": "user", "content": "After the restart."}], max_tokens=4)
            # The new process numbers its requests from 1 again; the row keys keep both apart.
            await wait_for(pilot, lambda: any(r.key == f"{again.pid}:1" for r in app.state.requests))
            await settle(pilot)
            keys = {k.value for k in app.query_one("#requests").rows}
            assert f"{again.pid}:1" in keys and f"{first_pid}:1" in keys
        finally:
            again.stop()


@sync
async def test_the_restart_tab_rolls_a_managed_server(cli_env: Path, tiny_model_dir: Path) -> None:
    serve("tui", tiny_model_dir)
    target = select("tui")[0]
    client = target.client(timeout=120)
    client.chat([SYSTEM, {"role": "user", "content": "Before the restart."}], model=str(tiny_model_dir),
                max_tokens=2, temperature=0.0)
    app = make_app(LiveSource(client), restarter=restarter_for([target]), refresh_s=0.5)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        old_pid = app.state.server.pid
        pane = app.query_one("#pane-restart")
        await pilot.press("4")
        await wait_for(pilot, lambda: bool(pane.plan))
        await pilot.press("R", "y")
        await wait_for(pilot, lambda: pane.result is not None)
        assert pane.result.ok, [(s.phase, s.message) for s in pane.steps]
        phases = list(dict.fromkeys(s.phase for s in pane.steps))
        assert phases == ["plan", "draining", "waiting", "flushing", "stopping", "starting", "ready", "probing",
                          "done"]
        new_pid = pane.result.servers[0].new_pid
        assert new_pid != old_pid
        await wait_for(pilot, lambda: app.state.server.pid == new_pid and app.state.connection.state == "live")
        assert app.state.restarts_seen == 1
