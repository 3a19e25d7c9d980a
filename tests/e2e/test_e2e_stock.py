"""End to end: ``APC_LINEAGE=0`` is stock mlx-vlm 0.7.10.

The launcher with ``APC_LINEAGE=0`` installs no overlay: ``/health`` has no
``apc_lineage_patch``, there is no ``/admin``, and a 3-turn conversation gets the same greedy
tokens and the same ``cached_tokens`` sequence as ``python -m mlx_vlm.server`` run directly
with the same environment (APC on, stock exact mode).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import HOST, PatchedServer, reply_tokens, text

ENV = {"APC_LINEAGE": "0", "APC_ENABLED": "1", "TOP_LOGPROBS_K": "5"}
PARAMS = {"max_tokens": 8, "logprobs": True, "top_logprobs": 5}


class StockServer(PatchedServer):
    """``python -m mlx_vlm.server`` itself (no launcher, no overlay), same harness otherwise."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "mlx_vlm.server", "--host", HOST,
                "--model", str(self.model_dir), "--port", str(self.port), *self.args]


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("e2e-stock")
    off = PatchedServer(tiny_model_dir, env=ENV, log_dir=log_dir)
    stock = StockServer(tiny_model_dir, env=ENV, log_dir=log_dir)
    try:
        off.start()
        stock.start()
        yield off, stock
    finally:
        off.stop()
        stock.stop()


def _conversation(server: PatchedServer) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": text(300, 401)},
                {"role": "user", "content": text(150, 402)}]
    answers = []
    for turn in range(3):
        answer = server.chat(messages, **PARAMS)
        answers.append(answer)
        messages = messages + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "."},
                               {"role": "user", "content": text(60, 403 + turn)}]
    return answers


@pytest.mark.server
def test_lineage_off_has_no_patch_and_no_admin(pair) -> None:
    off, stock = pair
    health = off.get_json("/health")
    assert "apc_lineage_patch" not in health and health["apc_enabled"] is True
    assert health.keys() == stock.get_json("/health").keys()
    assert "running stock mlx-vlm" in off.log_text()
    assert "overlay installed" not in off.log_text()
    for server in (off, stock):
        status, _ = server.admin("GET", "/status")
        assert status == 404
    off.chat([{"role": "user", "content": "hello"}], max_tokens=2)
    assert off.lineage_lines("restore") == [] and off.lineage_lines("timing") == []
    assert "apc_lineage" not in off.log_text()


@pytest.mark.server
def test_lineage_off_conversation_matches_stock_mlx_vlm(pair) -> None:
    off, stock = pair
    got, expected = _conversation(off), _conversation(stock)
    for mine, theirs in zip(got, expected):
        assert mine["usage"] == theirs["usage"]
        assert reply_tokens(mine) == reply_tokens(theirs)
        assert mine["choices"][0]["logprobs"] == theirs["choices"][0]["logprobs"]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in got]
    prompts = [a["usage"]["prompt_tokens"] for a in got]
    # Stock exact mode: each turn restores the previous whole prompt at n - 1.
    assert cached == [0, prompts[0] - 1, prompts[1] - 1], (cached, prompts)
