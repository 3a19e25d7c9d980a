"""Remake docs/dashboard.png: the Live tab of ``apcctl top`` at 160x40 on a live patched server
(the tiny glm5_next model, budgets scaled down to it) under ``apcctl demo``'s agent-like traffic.

    .venv/bin/pip install cairosvg   # one-off, for this script only: not a dependency of apcctl
    .venv/bin/python docs/dashboard_screenshot.py docs/dashboard.png

Everything (model, state, disk tier, HOME) lives in a temporary directory, removed at the end; the
server is stopped however the script ends. The picture is taken once the traffic is done and the
dashboard shows every request and a non-zero hit ratio.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apcctl.agent_traffic import AgentTraffic
    from apcctl.core.client import AdminClient

SIZE = (160, 40)  # 120 columns or more put the budgets beside the graphs; 160 fit every request column
REQUESTS = 80  # enough to fill the graphs at that width (apcctl demo --requests 80)
BUDGETS = {"APC_LINEAGE_RAM_BUDGET_BYTES": "8M", "APC_LINEAGE_ANCHOR_MAX_ENTRIES": "4",
           "APC_LINEAGE_ANCHOR_MAX_BYTES": "1M"}  # the caption in docs/dashboard.md says these


async def screenshot(client: AdminClient, traffic: AgentTraffic) -> str:
    """The Live tab's SVG once every request the traffic sent is on screen with its hits."""
    from tui.app import make_app
    from tui.source import LiveSource
    from tui.testing import settle, wait_for

    app = make_app(LiveSource(client), refresh_s=1.0)
    async with app.run_test(size=SIZE) as pilot:
        def complete() -> bool:
            status = app.state.status
            return (traffic.done.is_set() and status is not None and status.hits.hits > 0
                    and status.hits.requests >= traffic.sent - traffic.failed
                    and len(app.state.requests) >= traffic.sent - traffic.failed)

        await wait_for(pilot, complete)
        await settle(pilot)
        await pilot.pause(2.5)  # one more poll after the last event: counters and events agree
        await settle(pilot)
        return app.export_screenshot()


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="apcctl-screenshot-") as tmp:
        root = Path(tmp)
        os.environ.update(HOME=str(root), XDG_STATE_HOME=str(root / "state"), XDG_CACHE_HOME=str(root / "cache"),
                          XDG_CONFIG_HOME=str(root / "config"))
        from apcctl.agent_traffic import AgentTraffic
        from apcctl.core.client import AdminClient
        from apcctl.core.hosts import free_port
        from apcctl.core.manage import ManagedServer, build_spec
        from apcctl.lab.tinymodel.build import build_model

        model = build_model(root / "tiny", "tiny")  # the header names the model by its directory
        server = ManagedServer("screenshot", root=root / "state")
        spec = build_spec("screenshot", model=str(model), port=free_port(), env={"HF_HUB_OFFLINE": "1", **BUDGETS},
                          disk_path=root / "disk", directory=server.directory)
        try:
            server.start(spec)
            server.wait_ready(timeout=300)
            traffic = AgentTraffic(AdminClient(spec.url, server.token(), timeout=300), model=str(model),
                                   max_requests=REQUESTS)
            traffic.start()
            svg = asyncio.run(screenshot(AdminClient(spec.url, server.token()), traffic))
            traffic.stop.set()
        finally:
            server.stop(grace=20)
    if traffic.failed:
        sys.exit(f"{traffic.failed} requests failed; no screenshot written")
    if out.suffix == ".svg":
        out.write_text(svg)
        return
    import cairosvg

    # librsvg and cairosvg drop the spaces that right-align the numbers unless told to keep them,
    # and cairosvg draws Textual's "Fira Code, monospace" in a proportional face where Fira Code is absent.
    svg = svg.replace("<svg ", '<svg xml:space="preserve" ', 1).replace(
        "font-family: Fira Code, monospace;", 'font-family: "DejaVu Sans Mono", monospace;')
    cairosvg.svg2png(bytestring=svg.encode(), write_to=str(out))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/dashboard.png"))
