"""A cold row that shared its prompt batch ends first: its reply is appended, not its row copied.

The real patched server on the tiny model. A long cold prefill (many small steps) keeps two
more requests queued until both are admitted in one prompt batch; each is copied out at its
prefill end into buffers with room for its reply (``reason=prefill-end`` in the log). The one
with the smaller ``max_tokens`` ends while the other decodes: ``/admin/stats`` counts a reply
append and no whole-row copy, and its next turn, restored past the appended reply, answers as
a cold server does (a fresh tenant is a cold namespace).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.e2e.test_e2e_conversation import _run_concurrently
from tests.server_harness import PatchedServer, assert_same_output, cached_tokens, reply_text, text, wait_for

pytestmark = pytest.mark.server


def _stats(server: PatchedServer) -> dict:
    status, body = server.admin("GET", "/status")
    assert status == 200, body
    return body["lineage"]["stats"]


def test_a_cold_row_that_shared_its_prompt_batch_appends_its_reply(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"PREFILL_STEP_SIZE": "16", "TOP_LOGPROBS_K": "5"}
    params = {"logprobs": True, "top_logprobs": 5}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        long = threading.Thread(target=lambda: server.chat([{"role": "user", "content": text(1500, 1)}],
                                                           tenant="long", max_tokens=2))
        mark = len(server.log_text())
        long.start()
        wait_for(lambda: "Request started" in server.log_text()[mark:], "the long prefill", server)
        convs = [[{"role": "user", "content": text(60, 2)}], [{"role": "user", "content": text(60, 3)}]]
        short, longer = _run_concurrently([lambda: server.chat(convs[0], tenant="a", max_tokens=3, **params),
                                           lambda: server.chat(convs[1], tenant="b", max_tokens=40, **params)])
        long.join(timeout=300)
        log = server.log_text()[mark:]
        assert log.count("reason=prefill-end") >= 2, "the two requests were not admitted in one prompt batch"
        stats = _stats(server)
        assert stats.get("reply_appends", 0) >= 1 and stats.get("reply_row_copies", 0) == 0, stats
        follow = convs[0] + [{"role": "assistant", "content": reply_text(short)},
                             {"role": "user", "content": text(20, 4)}]
        warm = server.chat(follow, tenant="a", max_tokens=4, **params)
        assert cached_tokens(warm) > short["usage"]["prompt_tokens"], warm["usage"]  # past the reply
        cold = server.chat(follow, tenant="cold", max_tokens=4, **params)
        assert cached_tokens(cold) == 0
        assert_same_output(warm, cold)
        assert longer["usage"]["completion_tokens"] > short["usage"]["completion_tokens"]
