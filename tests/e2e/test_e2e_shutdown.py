"""A server with a dashboard's event stream open still stops on SIGTERM and flushes to disk."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from apcctl.core.client import AdminClient, AdminError
from tests.server_harness import ADMIN_TOKEN, PatchedServer, text


@pytest.mark.server
def test_sigterm_with_an_open_event_stream_exits_gracefully_and_flushes(tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    server = PatchedServer(tiny_model_dir, log_dir=tmp_path).start()
    try:
        server.chat([{"role": "system", "content": text(200, 1)},
                     {"role": "user", "content": text(40, 2)}], max_tokens=2)
        client = AdminClient(server.base_url, ADMIN_TOKEN)
        opened = threading.Event()
        ended = threading.Event()

        def watch() -> None:
            try:
                for _ in client.events(timeout=60):
                    opened.set()
            except AdminError:
                pass
            finally:
                ended.set()

        threading.Thread(target=watch, daemon=True).start()
        assert opened.wait(30)
    finally:
        code = server.stop(timeout=20)
    assert code in (0, -signal.SIGTERM), server.log_tail()  # not -9: no SIGKILL was needed
    assert ended.wait(10)
    assert "Application shutdown complete" in server.log_text()
    files = list((tmp_path / "lineage-disk").rglob("*.safetensors"))
    assert len(files) >= 2  # the anchor and the conversation, written by the shutdown flush
