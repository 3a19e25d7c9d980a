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

from tests.server_harness import PatchedServer, assert_same_output, reply_text, reply_tokens, text, wait_for
from server_patch import pacing


def _paced(pacer: pacing.PrefillPacer, tokens: int, seconds: float) -> int:
    """Observe one paced chunk of exactly the size asked for; the next size."""
    pacer.observe(tokens, seconds, chosen=tokens, paced=True)
    return pacer.chunk(2048, decoding=1)


def test_with_nothing_decoding_prefill_keeps_the_full_chunk() -> None:
    pacer = pacing.PrefillPacer(budget_ms=100)
    pacer.observe(2048, 20.0, chosen=2048, paced=False)  # a slow machine
    assert pacer.chunk(2048, decoding=0) == 2048


def test_while_rows_decode_the_chunk_moves_toward_the_budget() -> None:
    pacer = pacing.PrefillPacer(budget_ms=250)
    assert pacer.chunk(2048, decoding=1) == pacing.FIRST_CHUNK  # nothing measured yet
    assert _paced(pacer, 256, 1.0) == 64  # four times the budget: a quarter of the size
    assert _paced(pacer, 64, 0.05) == 128  # well inside it: at most twice as large
    assert _paced(pacer, 128, 0.2) == 160
    assert pacer.chunk(100, decoding=1) == 100  # never above what mlx-vlm would take
    assert _paced(pacer, 160, 1.0) == pacing.MIN_CHUNK  # never below the floor


def test_a_chunk_that_is_mostly_overhead_grows_instead() -> None:
    pacer = pacing.PrefillPacer(budget_ms=250)
    pacer.observe(2026, 5.7, chosen=2048, paced=False)  # the bench preset alone: 355 tokens/s
    assert _paced(pacer, 256, 2.0) == 512  # 128 tokens/s: below half the unpaced rate
    # 205 tokens/s: efficient enough and over the budget, but 256 was found mostly overhead:
    # the size stays where it is (no shrinking back into the overhead, no oscillation).
    assert _paced(pacer, 512, 2.5) == 512
    pacer.observe(2048, 2.0, chosen=2048, paced=False)  # the machine got faster: judged afresh
    assert _paced(pacer, 512, 0.5) == 256  # 1,024 tokens/s, twice the budget: half the size


def test_the_first_paced_chunk_is_the_reference_when_nothing_large_ran_alone() -> None:
    pacer = pacing.PrefillPacer(budget_ms=250)
    assert _paced(pacer, 256, 0.5) == 128  # 512 tokens/s: the reference, and twice the budget
    assert _paced(pacer, 128, 2.0) == 256  # 64 tokens/s: mostly overhead, grows back
    assert _paced(pacer, 256, 1.0) == 256  # over the budget, but 128 was overhead: held


def test_a_chunk_cut_short_or_unpaced_does_not_steer_the_size() -> None:
    pacer = pacing.PrefillPacer(budget_ms=250)
    pacer.observe(23, 1.0, chosen=256, paced=True)  # cut at a checkpoint column
    pacer.observe(30, 0.01, chosen=2048, paced=False)  # a short unpaced remainder
    assert pacer.size is None and pacer.full_rate is None


def test_a_budget_of_zero_is_mlx_vlms_fixed_chunk() -> None:
    pacer = pacing.PrefillPacer(budget_ms=0)
    assert not pacer.enabled and pacer.chunk(2048, decoding=3) == 2048


class Batch:
    """A prompt batch as the door sees one: its chunk, and the ``max_tokens`` each step asked."""

    def __init__(self, prefill_step_size: int | None = 2048) -> None:
        self.prefill_step_size = prefill_step_size
        self.asked: list[int | None] = []

    def prompt_step(self, max_tokens: int | None = None) -> int:
        self.asked.append(max_tokens)
        return min(max_tokens or 2048, 2048)


def test_a_step_asks_for_the_paced_chunk_only_while_rows_decode() -> None:
    pacer, batch = pacing.PrefillPacer(budget_ms=1e-9), Batch()
    assert pacing.step(pacer, batch, decoding=2) == pacing.FIRST_CHUNK
    assert pacing.step(pacer, batch, decoding=2) == pacing.MIN_CHUNK  # 1 ps: no chunk fits, however fast the machine
    assert pacer.stats["paced_chunks"] == 2
    assert pacing.step(pacer, batch, decoding=0) == 2048  # alone: mlx-vlm's full chunk
    unchunked = Batch(prefill_step_size=None)
    assert pacing.step(pacer, unchunked, decoding=2) == 2048 and unchunked.asked == [None]  # cannot chunk
    assert pacing.step(pacing.PrefillPacer(budget_ms=0), batch, decoding=2) == 2048  # pacing off
    assert batch.asked == [pacing.FIRST_CHUNK, pacing.MIN_CHUNK, 2048, None]


def test_the_door_paces_a_lineage_coordinators_prefill_and_leaves_stocks_alone(monkeypatch) -> None:
    from mlx_vlm.apc_coordinator import APCCoordinator

    from server_patch.integration import hooks
    from server_patch.integration.coordinator import LineageCoordinator

    lineage = object.__new__(LineageCoordinator)  # only its runtime's pacer is read
    monkeypatch.setattr(LineageCoordinator, "runtime", SimpleNamespace(pacer=pacing.PrefillPacer(budget_ms=0.01)))
    decoding = SimpleNamespace(apc=lineage, _generation_batch=[object()])
    batch = Batch()
    assert hooks.prefill_step(decoding, batch) == pacing.FIRST_CHUNK and batch.asked == [pacing.FIRST_CHUNK]
    stock = SimpleNamespace(apc=object.__new__(APCCoordinator), _generation_batch=[object()])
    assert hooks.prefill_step(stock, batch) == 2048 and batch.asked[-1] is None  # mlx-vlm's own step
    assert hooks.prefill_step(SimpleNamespace(apc=None, _generation_batch=[]), batch) == 2048


# ----------------------------------------------------------------------------- real server

PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}


def _chunks(server: PatchedServer) -> list[dict[str, str]]:
    lines = [line.split("apc_pacing chunk ", 1)[1] for line in server.log_text().splitlines()
             if "apc_pacing chunk " in line]
    return [dict(pair.split("=", 1) for pair in line.split()) for line in lines]


class Stream(threading.Thread):
    """A long greedy stream of another session; ``decoding`` is set at its third token.

    ``stop`` makes it a client that went away at its next token (the server cancels the row),
    for a test that only needs it decoding while something else happens."""

    def __init__(self, server: PatchedServer, max_tokens: int, seed: int = 2900) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens, self.seed = server, max_tokens, seed
        self.decoding = threading.Event()
        self.stopping = threading.Event()
        self.tokens = 0

    def stop(self) -> None:
        """Drop the connection at the next token read, unread rest and all; ``join`` waits for it."""
        self.stopping.set()

    def run(self) -> None:
        payload = {"model": str(self.server.model_dir), "temperature": 0.0, "stream": True,
                   "max_tokens": self.max_tokens,
                   "messages": [{"role": "user", "content": text(40, self.seed)}]}
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=300)
        tenant = "stream" if self.seed == 2900 else f"stream-{self.seed}"
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                         headers={"Content-Type": "application/json", "X-APC-Tenant": tenant})
            for raw in conn.getresponse():
                if raw.startswith(b"data:") and b"[DONE]" not in raw:
                    self.tokens += 1
                    if self.tokens == 3:
                        self.decoding.set()
                if self.stopping.is_set():
                    break
        finally:
            self.decoding.set()
            if self.stopping.is_set() and conn.sock is not None:
                conn.sock.close()  # gone without reading the rest: the server cancels the row
            conn.close()


def stop_streams(server: PatchedServer, *streams: Stream) -> None:
    """Stop ``streams`` and wait until the server ended their rows (every request record it
    holds says ``ended``): what comes next is admitted with none of them decoding."""
    for stream in streams:
        stream.stop()
    for stream in streams:
        stream.join(120)
        assert not stream.is_alive(), "a stopped stream still reads"

    def all_ended() -> bool:
        status, body = server.admin("GET", "/requests")
        assert status == 200, body
        return all(record["ended"] for record in body["requests"])

    wait_for(all_ended, "the stopped streams' rows ended", server)


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
        stop_streams(server, stream)  # it decoded through the paced prefill: that is all it was for
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
