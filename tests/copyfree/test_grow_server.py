"""A decoding batch outgrowing its KV buffer on the real patched server (``copyfree.grow``, issue
40): two streams decode past their joint buffer's width; the regrow takes the buffers the
runtime's stager made ahead (the server's log), both streams' records name the copy ``grow``,
and the shorter one's answer (it grew at its ~520th token) equals the same request served alone,
whose own cache grows as mlx-vlm's does. Answers, logs and records, never a time.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.test_request_waits import records
from tests.server_harness import PatchedServer, assert_same_output, reply_tokens, text, wait_for

LOGPROBS = {"logprobs": True, "top_logprobs": 5}
TAKEN = re.compile(r"apc_copyfree regrow: (\d+) buffers made ahead taken")
# The second joins while the first decodes; the joint buffer made ahead has at most about two
# allocation steps (512) of room past the join (``batch.joint_shapes``), so both still decode
# when it fills (these greedy replies reach 900 and end at 599 tokens).
FIRST, SECOND = 900, 599


@pytest.mark.server
def test_two_streams_grow_into_buffers_made_ahead_and_answer_as_mlx_vlms_regrow(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    first = [{"role": "user", "content": text(30, 4402)}]  # greedy replies that reach max_tokens
    second = [{"role": "user", "content": text(30, 4404)}]
    with PatchedServer(tiny_model_dir, env={"TOP_LOGPROBS_K": "5"}, log_dir=tmp_path / "grow") as server:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(server.chat, first, tenant="a", max_tokens=FIRST, **LOGPROBS)
            wait_for(lambda: any(r.ttft_ms > 0 and not r.ended for r in records(server)), "the first decoding", server)
            beside = pool.submit(server.chat, second, tenant="b", max_tokens=SECOND, **LOGPROBS)
            together = (long.result(300), beside.result(300))
        wait_for(lambda: len(records(server)) == 2 and all(r.ended for r in records(server)), "both ended", server)
        assert [len(reply_tokens(a)) for a in together] == [FIRST, SECOND]
        taken = [int(n) for n in TAKEN.findall(server.log_text())]
        assert taken and max(taken) > 0, server.log_tail()  # a regrow wrote into buffers made ahead
        for record in records(server):  # each waited for the joint regrow, named as such
            assert record.waited.get("grow", 0) > 0, record

        # The second alone: a lone stream decodes in its own KVCache, which grows as mlx-vlm's.
        assert_same_output(together[1], server.chat(second, tenant="alone", max_tokens=SECOND, **LOGPROBS))
