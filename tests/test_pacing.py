"""Decode-aware prefill (issue 29): the chunk size, from the pacer's own measured rate.

The unit tests drive ``PrefillPacer`` and the overlay's two hooks with stand-in batches; the
server test runs the real patched server on the tiny model: the same cold prompt prefills in
more chunks while another stream decodes than alone, and both answers (and a warm turn that
restores the paced prompt's entry) equal a cold prefill's. Counts and answers, never a time.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from server_harness import PatchedServer, assert_same_output, reply_text, reply_tokens, text
from server_patch import pacing


def test_with_nothing_decoding_prefill_keeps_the_full_chunk() -> None:
    pacer = pacing.PrefillPacer(budget_ms=100)
    pacer.observe(1000, 10.0)  # a slow machine: 100 tokens/s
    assert pacer.chunk(2048, decoding=0) == 2048


def test_while_rows_decode_a_chunk_fits_the_budget_at_the_measured_cost() -> None:
    pacer = pacing.PrefillPacer(budget_ms=250)
    assert pacer.chunk(2048, decoding=1) == pacing.FIRST_CHUNK  # nothing measured yet
    pacer.observe(256, 0.256)
    assert pacer.chunk(2048, decoding=1) == 512  # one size known: another one, for the slope
    pacer.observe(512, 0.512)  # 1 ms a token, no fixed cost: 250 tokens in 250 ms
    assert pacer.cost_model() == pytest.approx((0.0, 0.001))
    assert pacer.chunk(2048, decoding=2) == 250
    assert pacer.chunk(100, decoding=1) == 100  # never above what mlx-vlm would take


def test_a_fixed_cost_above_the_budget_keeps_chunks_where_it_is_half_their_time() -> None:
    pacer = pacing.PrefillPacer(budget_ms=250)
    pacer.observe(64, 1.0)  # the bench preset on a loaded CPU: 64 tokens cost about as much as 128
    pacer.observe(128, 1.064)
    fixed, per_token = pacer.cost_model()
    assert fixed == pytest.approx(0.936) and per_token == pytest.approx(0.001)
    assert pacer.chunk(2048, decoding=1) == 512  # the budget cannot be met: a quarter of the chunk
    assert pacer.chunk(8192, decoding=1) == 936  # or where the overhead is half a chunk's time


def test_chunks_stay_within_the_floor_and_learn_from_full_chunks() -> None:
    pacer = pacing.PrefillPacer(budget_ms=1)
    pacer.observe(2048, 4.0)  # alone: mlx-vlm's full chunks only
    assert pacer.chunk(2048, decoding=1) == 1024
    pacer.observe(1024, 2.0)  # 2 ms a token: 1 ms fits none
    assert pacer.chunk(2048, decoding=1) == pacing.MIN_CHUNK
    noisy = pacing.PrefillPacer(budget_ms=250)
    noisy.observe(100, 0.3)
    noisy.observe(200, 0.2)  # faster for more tokens: noise, read as a pure rate
    assert noisy.cost_model() == pytest.approx((0.0, 0.002))
    steady = pacing.PrefillPacer(budget_ms=100)
    for n, t in ((64, 0.084), (128, 0.148), (64, 0.3), (256, 0.276), (64, 0.084)):  # one stray slow chunk
        steady.observe(n, t)
    assert steady.cost_model() == pytest.approx((0.02, 0.001))
    assert steady.chunk(2048, decoding=1) == 80


def test_a_budget_of_zero_is_mlx_vlms_fixed_chunk() -> None:
    pacer = pacing.PrefillPacer(budget_ms=0)
    pacer.observe(10, 1.0)
    assert not pacer.enabled and pacer.chunk(2048, decoding=3) == 2048


def test_the_hooks_tell_the_batch_who_decodes_and_skip_batches_that_cannot_chunk(monkeypatch) -> None:
    monkeypatch.setattr(pacing, "_PACER", pacing.PrefillPacer(budget_ms=0.01))

    class Batch:
        prefill_step_size = 2048

        def prompt_step(self) -> int:
            return pacing.chunk(self, self.prefill_step_size)

    batch = Batch()
    generator = SimpleNamespace(_generation_batch=[object(), object()])
    assert pacing.step(generator, batch) == pacing.FIRST_CHUNK and batch._apc_decoding == 2
    assert pacing.step(generator, batch) == 2 * pacing.FIRST_CHUNK  # the second size, for the slope
    assert pacing.step(generator, batch) == pacing.MIN_CHUNK  # 0.01 ms fits no token
    assert pacing.pacer().stats["paced_chunks"] == 3
    assert pacing.step(SimpleNamespace(_generation_batch=[]), batch) == 2048  # alone: full
    unchunked = SimpleNamespace(prefill_step_size=None, _apc_decoding=2)
    assert pacing.chunk(unchunked, 700) == 700  # mlx-vlm turned chunking off for this model


# ----------------------------------------------------------------------------- real server

PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}


def _chunks(server: PatchedServer) -> list[dict[str, str]]:
    lines = [line.split("apc_pacing chunk ", 1)[1] for line in server.log_text().splitlines()
             if "apc_pacing chunk " in line]
    return [dict(pair.split("=", 1) for pair in line.split()) for line in lines]


class Stream(threading.Thread):
    """A long greedy stream of another session; ``decoding`` is set at its third token."""

    def __init__(self, server: PatchedServer, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.decoding = threading.Event()
        self.tokens = 0

    def run(self) -> None:
        payload = {"model": str(self.server.model_dir), "temperature": 0.0, "stream": True,
                   "max_tokens": self.max_tokens,
                   "messages": [{"role": "user", "content": text(40, 2900)}]}
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=300)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                         headers={"Content-Type": "application/json", "X-APC-Tenant": "stream"})
            for raw in conn.getresponse():
                if raw.startswith(b"data:") and b"[DONE]" not in raw:
                    self.tokens += 1
                    if self.tokens == 3:
                        self.decoding.set()
        finally:
            self.decoding.set()
            conn.close()


@pytest.mark.server
def test_a_prefill_splits_into_more_chunks_while_another_stream_decodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"TOP_LOGPROBS_K": "5", "APC_DECODE_STALL_MS": "0.01"}  # a budget no chunk meets
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        messages = [{"role": "system", "content": text(40, 2901)}, {"role": "user", "content": text(1500, 2902)}]
        alone = server.chat(messages, tenant="alone", **PARAMS)
        alone_chunks = _chunks(server)
        assert alone_chunks and all(c["decoding"] == "0" and c["paced"] == "0" for c in alone_chunks)

        stream = Stream(server, max_tokens=600)
        stream.start()
        assert stream.decoding.wait(120)
        paced = server.chat(messages, tenant="paced", **PARAMS)  # the same cold prefill
        during = _chunks(server)[len(alone_chunks):]
        stream.join(300)
        assert stream.tokens > 3
        split = [c for c in during if c["paced"] == "1"]
        # Smaller chunks than mlx-vlm's, each no smaller than the floor, all while the stream decoded.
        assert split and all(int(c["decoding"]) >= 1 and int(c["tokens"]) < 2048 for c in split)
        prompt_chunks = [c for c in during if c["decoding"] != "0" or c["paced"] == "1"]
        assert len(prompt_chunks) > len(alone_chunks), (alone_chunks, during)

        # The paced prefill answers as the unpaced one (its greedy tokens: a request admitted
        # while another row decodes gets no first-token top logprobs from mlx-vlm 0.7.10, paced
        # or not), and its entry restores correctly.
        assert reply_tokens(paced) == reply_tokens(alone)
        turn = messages + [{"role": "assistant", "content": reply_text(paced)},
                           {"role": "user", "content": text(20, 2903)}]
        warm, line = server.chat_restore(turn, tenant="paced", **PARAMS)
        assert line["kind"] != "cold", line
        assert_same_output(warm, server.chat(turn, tenant="cold", **PARAMS))
