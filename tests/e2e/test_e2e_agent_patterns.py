"""End to end: real agent clients' patterns, never fewer tokens than stock and answers as cold.

The same requests go to a patched server and to a stock one (``APC_LINEAGE=0``, its cache on),
with a 256-token periodic stride on both (``APC_LINEAGE_PERIODIC_STRIDE``,
``APC_CHECKPOINT_INTERVAL_TOKENS``) so that stock's periodic checkpoints exist on the tiny model
too, and each answer is compared with a cold prefill of the same prompt (a fresh tenant). The
patterns (``apcctl.lab.sim.patterns`` has them for the simulator):

* ``abort``: four turns, a long user turn whose streamed reply the client aborts and drops,
  then a new user message straight after the long one (user after user): stock restores its
  periodic snapshot inside the long turn, which the lineage used to thin away;
* ``aider``: aider's moving reminder, a long system reminder after the newest user message
  only, so every prompt diverges right after the previous user text;
* ``edit``: a few turns, then the last user message rewritten twice;
* ``partial``: streamed turns aborted after a few chunks, the partial reply kept in the history;
* ``retry``: mini-swe-agent after a format error: the reply dropped, a user message appended, so
  the prompt parts at the previous one's generation prompt, where it restores exactly (issue 37);
* ``resume``: qwen-code ``-c``: the first user message (context and a date reminder block)
  rebuilt without the reminder; it restores exactly at the reminder block's start (issue 37).

The exact positions come from the model's own tokenizer and template (``transformers``), the
restored tokens from ``/admin/requests``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from server_patch.boundaries import BPE_SLACK
from tests.server_harness import PatchedServer, assert_same_output, cached_tokens, prompt_tokens, reply_text, text

STRIDE = {"APC_LINEAGE_PERIODIC_STRIDE": "256", "APC_CHECKPOINT_INTERVAL_TOKENS": "256",
          "TOP_LOGPROBS_K": "5"}
PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}
REMINDER = "\n\nSYSTEM REMINDER: " + text(300, 901)  # longer than the 256-token segment gap, as aider's
DATE_BLOCK = "<system-reminder>\nThe current date is 2026-12-05.\n</system-reminder>"


@dataclass
class Sent:
    pattern: str
    step: int
    lineage: dict[str, Any]
    stock: dict[str, Any]
    cold: dict[str, Any]
    messages: list[dict[str, Any]]
    record: dict[str, Any]  # the lineage server's /admin/requests record of it


class Client:
    """Sends each request to both servers and its cold reference; keeps what came back."""

    def __init__(self, lineage: PatchedServer, stock: PatchedServer, pattern: str) -> None:
        self.lineage, self.stock, self.pattern = lineage, stock, pattern
        self.sent: list[Sent] = []

    def chat(self, messages: list[dict]) -> dict[str, Any]:
        tenant = f"agent-{self.pattern}"
        answer = self.lineage.chat(messages, tenant=tenant, **PARAMS)
        status, body = self.lineage.admin("GET", "/requests?limit=5")
        assert status == 200, body
        record = max(body["requests"], key=lambda r: r["seq"])
        reference = self.stock.chat(messages, tenant=tenant, **PARAMS)
        cold = self.lineage.chat(messages, tenant=f"cold-{self.pattern}-{len(self.sent)}", **PARAMS)
        self.sent.append(Sent(self.pattern, len(self.sent), answer, reference, cold, messages, record))
        return answer

    def abort(self, messages: list[dict], chunks: int = 2) -> str:
        """A streamed turn the client gives up on after ``chunks`` chunks, on both servers;
        returns the text the lineage server streamed until then."""
        tenant = f"agent-{self.pattern}"
        streamed = [server.stream_and_drop(messages, chunks=chunks, tenant=tenant, max_tokens=64)
                    for server in (self.lineage, self.stock)][0]
        return "".join((json.loads(line)["choices"][0].get("delta") or {}).get("content") or ""
                       for line in streamed)


def system() -> dict:
    """60 words (it was 100): in every prompt, and prefilled cold by every cold reference and every
    pattern's first request. What the patterns test lies after it and keeps its place against
    stock's 256-token snapshots: the aborted long turn (779 tokens) still passes stock's one at
    768, the reminder block still starts past its one at 256."""
    return {"role": "system", "content": text(60, 900)}


def abort_after_a_long_turn(client: Client) -> None:
    messages = [system(), {"role": "user", "content": text(20, 910)}]
    for turn in range(4):
        answer = client.chat(messages)
        messages = messages + [{"role": "assistant", "content": reply_text(answer)},
                               {"role": "user", "content": text(20, 911 + turn)}]
    long_turn = messages[:-1] + [{"role": "user", "content": text(600, 920)}]
    client.abort(long_turn)  # the partial reply is dropped: the next message follows the long one
    client.chat(long_turn + [{"role": "user", "content": text(15, 921)}])


def aborts_with_the_partial_reply_kept(client: Client) -> None:
    messages = [system(), {"role": "user", "content": text(40, 960)}]
    for turn in range(3):
        partial = client.abort(messages, chunks=4) or "."
        messages = messages + [{"role": "assistant", "content": partial},
                               {"role": "user", "content": text(30, 961 + turn)}]
        client.chat(messages)


def aider_turns(client: Client) -> None:
    history = [system()]
    for turn in range(4):
        question = text(10 + 7 * turn, 930 + turn)
        answer = client.chat(history + [{"role": "user", "content": question + REMINDER}])
        history = history + [{"role": "user", "content": question},
                             {"role": "assistant", "content": reply_text(answer)}]


def edits_of_the_last_message(client: Client) -> None:
    messages = [system(), {"role": "user", "content": text(30, 940)}]
    for turn in range(2):
        answer = client.chat(messages)
        messages = messages + [{"role": "assistant", "content": reply_text(answer)},
                               {"role": "user", "content": text(200, 941 + turn)}]
    client.chat(messages)
    last = messages[-1]["content"].split()
    for k, keep in enumerate((150, 20)):
        messages = messages[:-1] + [{"role": "user", "content": " ".join(last[:keep] + text(30, 950 + k).split())}]
        client.chat(messages)


def retry_dropping_the_reply(client: Client) -> None:
    messages = [system(), {"role": "user", "content": text(300, 970)}]
    client.chat(messages)
    client.chat(messages + [{"role": "user", "content": "Format error: " + text(20, 971)}])


def resume_with_a_rebuilt_first_message(client: Client) -> None:
    context = text(300, 980)
    first = context + "\n" + DATE_BLOCK
    history = [system(), {"role": "user", "content": first}]
    for turn in range(2):
        answer = client.chat(history)
        history = history + [{"role": "assistant", "content": reply_text(answer)},
                             {"role": "user", "content": text(20, 981 + turn)}]
    client.chat([history[0], {"role": "user", "content": context}, *history[2:]])


PATTERNS: dict[str, Callable[[Client], None]] = {
    "abort": abort_after_a_long_turn, "aider": aider_turns, "edit": edits_of_the_last_message,
    "partial": aborts_with_the_partial_reply_kept, "retry": retry_dropping_the_reply,
    "resume": resume_with_a_rebuilt_first_message}


@pytest.fixture(scope="module")
def sent(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Sent]:
    log_dir = tmp_path_factory.mktemp("e2e-agent-patterns")
    lineage = PatchedServer(tiny_model_dir, env=STRIDE, log_dir=log_dir)
    stock = PatchedServer(tiny_model_dir, env={**STRIDE, "APC_LINEAGE": "0"}, log_dir=log_dir)
    out: list[Sent] = []
    try:
        lineage.start()
        stock.start()
        for name, pattern in PATTERNS.items():
            client = Client(lineage, stock, name)
            pattern(client)
            out += client.sent
    finally:
        lineage.stop()
        stock.stop()
    return out


@pytest.mark.server
def test_no_request_restores_fewer_tokens_than_stock(sent: list[Sent]) -> None:
    below = [(s.pattern, s.step, cached_tokens(s.lineage), cached_tokens(s.stock)) for s in sent
             if cached_tokens(s.lineage) < cached_tokens(s.stock)]
    assert below == []


@pytest.mark.server
def test_user_after_user_restores_at_least_the_long_turns_periodic_point(sent: list[Sent]) -> None:
    last = [s for s in sent if s.pattern == "abort"][-1]
    assert cached_tokens(last.stock) >= 512  # stock's interval snapshot inside the long turn
    assert cached_tokens(last.lineage) >= cached_tokens(last.stock)


@pytest.mark.server
def test_aider_turns_restore_past_the_previous_reply(sent: list[Sent]) -> None:
    """Each turn restores at the start of the previous user message or later, never before
    the reply preceding it: the whole previous turn but its user text is reused."""
    turns = [s for s in sent if s.pattern == "aider"]
    for before, turn in zip(turns, turns[1:]):
        assert cached_tokens(turn.lineage) > cached_tokens(before.lineage)
        assert cached_tokens(turn.lineage) >= cached_tokens(turn.stock)


def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def rendered(tok: Any, messages: list[dict[str, Any]], generation: bool) -> str:
    """As mlx-vlm's server renders it (thinking off: the generation prompt is 3 tokens)."""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, enable_thinking=False)


def token_count(tok: Any, text_: str) -> int:
    return len(tok.encode(text_, add_special_tokens=False))


@pytest.mark.server
def test_a_retry_dropping_the_reply_restores_at_the_generation_prompt(sent: list[Sent], tiny_model_dir: Path) -> None:
    """Exactly where the first prompt's generation prompt starts: its messages' tokens."""
    first, retry = [s for s in sent if s.pattern == "retry"]
    tok = tokenizer(tiny_model_dir)
    gen_start = token_count(tok, rendered(tok, first.messages, generation=False))
    assert token_count(tok, rendered(tok, first.messages, generation=True)) == prompt_tokens(first.lineage)
    assert gen_start < prompt_tokens(first.lineage)
    assert retry.record["restored_tokens"] == cached_tokens(retry.lineage) == gen_start, retry.record
    assert retry.record["drift"]["cause"] == "reply dropped on retry" and retry.record["drift"]["position"] == gen_start
    assert cached_tokens(retry.lineage) > cached_tokens(retry.stock)


@pytest.mark.server
def test_a_resume_restores_at_the_rebuilt_reminder_block(sent: list[Sent], tiny_model_dir: Path) -> None:
    """Exactly at the start of the first user message's reminder block (a plain-text seam: the
    finder places it ``BPE_SLACK`` tokens early), past stock's 256-token snapshot."""
    turns = [s for s in sent if s.pattern == "resume"]
    earlier, resumed = turns[-2], turns[-1]
    tok = tokenizer(tiny_model_dir)
    before = rendered(tok, earlier.messages, generation=True)
    block = token_count(tok, before[:before.index(DATE_BLOCK)]) - BPE_SLACK
    assert block > 256
    assert resumed.record["restored_tokens"] == cached_tokens(resumed.lineage) == block, resumed.record
    assert resumed.record["drift"]["cause"] == "history rebuilt on resume", resumed.record["drift"]
    assert resumed.record["drift"]["segment"] == "message 2 (user)"
    assert cached_tokens(resumed.lineage) > cached_tokens(resumed.stock)


@pytest.mark.server
def test_every_answer_equals_a_cold_servers(sent: list[Sent]) -> None:
    for s in sent:
        assert cached_tokens(s.cold) == 0
        assert_same_output(s.lineage, s.cold)
