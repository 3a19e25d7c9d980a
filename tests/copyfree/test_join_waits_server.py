"""A finished prompt batch waits for its join's buffers while the stager makes them (issue 40),
on the real patched server: a long stream decodes, a short request's join buffers are held on
the stager (``APC_TEST_FAULT_JOIN_SPARES_HOLD_FILE``), so its prefill ends first. Its join waits
(the log) while the long stream keeps decoding (its tokens keep coming); once released, the join
takes the buffers made ahead, and the short answer equals the same request served alone.
Answers, logs and token counts, never a time.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_pacing import Stream, stop_streams
from tests.server_harness import PatchedServer, reply_tokens, text, wait_for

LOGPROBS = {"logprobs": True, "top_logprobs": 5}


@pytest.mark.server
def test_a_join_waits_for_its_buffers_while_the_others_decode_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    env = {"TOP_LOGPROBS_K": "5", "APC_TEST_FAULTS": "1", "APC_TEST_FAULT_JOIN_SPARES_HOLD_FILE": str(hold),
           "APC_COPYFREE_JOIN_WAIT_MS": "600000"}  # released by the test, never by the limit
    short = [{"role": "user", "content": text(40, 4501)}]
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        stream = Stream(server, max_tokens=2000)
        stream.start()
        assert stream.decoding.wait(120)
        hold.write_text("hold\n")
        answer: dict[str, Any] = {}
        asked = threading.Thread(target=lambda: answer.update(server.chat(short, tenant="short", max_tokens=8,
                                                                           **LOGPROBS)), daemon=True)
        asked.start()
        wait_for(lambda: "join waits for its buffers made ahead" in server.log_text(), "the join waiting", server, 120)
        assert Path(f"{hold}.held").exists()  # the stager is held on this join's buffers
        tokens = stream.tokens
        wait_for(lambda: stream.tokens > tokens + 5, "the long stream decoding on", server, 120)
        assert not answer  # the short request has not joined: no first token yet
        hold.unlink()
        asked.join(300)
        assert answer and not asked.is_alive()
        log = server.log_text()
        assert "join waited" in log
        assert re.search(r"apc_copyfree join: [1-9]\d* buffers made ahead taken", log), server.log_tail()
        assert "buffers were not made within" not in log
        stop_streams(server, stream)
        alone = server.chat(short, tenant="alone", max_tokens=8, **LOGPROBS)
        # The greedy tokens (mlx-vlm reports no logprobs for a row that joins a batch whose
        # rows asked for none, as the stream here: stock does the same).
        assert reply_tokens(answer) == reply_tokens(alone) and len(reply_tokens(alone)) == 8
