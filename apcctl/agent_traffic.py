"""Agent-like chat traffic for ``apcctl demo`` and ``apcctl fleet`` (not a command: both send it):
what the lineage cache is built for, in miniature.

One round has: an assistant session over several turns (each turn re-sends the conversation
with the previous reply), a second session sharing the assistant's system prompt (an anchor
hit), a coding agent that spawns a sub-agent with a longer system prompt over the same start,
an edit of the last user message, and a regenerate (the same prompt again). Rounds repeat,
with new questions, until ``max_requests`` or ``duration`` is reached or ``stop`` is set.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from apcctl.core.client import AdminClient, AdminError
from apcctl.lab.tinymodel.corpus import training_corpus

Messages = list[dict[str, str]]


def corpus_text(rng: random.Random, corpus: list[str], sentences: int) -> str:
    """``sentences`` random lines of ``corpus`` joined: a message's text, by seed."""
    return " ".join(rng.choice(corpus) for _ in range(sentences))


@dataclass
class AgentTraffic:
    """Sends the rounds to ``client`` from a background thread; ``sent``/``failed`` count requests."""

    client: AdminClient
    model: str | None = None
    max_requests: int = 40
    duration: float | None = None
    max_tokens: int = 24
    seed: int = 0
    on_request: Callable[[str, str], None] | None = None  # (conversation, kind) before each send
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    failed: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.corpus = training_corpus(400)
        self.assistant = "You are a helpful assistant for a small team. " + corpus_text(self.rng, self.corpus, 12)
        self.coder = "You are a coding agent working in a python repository. " + corpus_text(self.rng, self.corpus, 10)
        self._started = time.monotonic()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="apcctl-demo-traffic", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        try:
            for conv, kind, messages in self._rounds():
                if self._finished():
                    return
                if self.on_request is not None:
                    self.on_request(conv, kind)
                reply = self._send(messages)
                if reply is not None:
                    messages.append({"role": "assistant", "content": reply})
        finally:
            self.done.set()

    def _finished(self) -> bool:
        over_time = self.duration is not None and time.monotonic() - self._started >= self.duration
        return self.stop.is_set() or self.sent >= self.max_requests or over_time

    def _rounds(self) -> Iterator[tuple[str, str, Messages]]:
        """(conversation, kind, messages); a yielded list gets the reply appended after the send."""
        round_no = 0
        while True:
            round_no += 1
            session = [{"role": "system", "content": self.assistant}]
            for turn in range(3):
                session.append({"role": "user", "content": self._question()})
                yield f"assistant/{round_no}", "turn" if turn else "new_session", session
            other = [{"role": "system", "content": self.assistant}, {"role": "user", "content": self._question()}]
            yield f"assistant/{round_no}b", "new_session", other
            coder = [{"role": "system", "content": self.coder}, {"role": "user", "content": self._question()}]
            yield f"coder/{round_no}", "new_session", coder
            sub = [{"role": "system", "content": self.coder + " You are a sub-agent: only read files."},
                   {"role": "user", "content": self._question()}]
            yield f"coder/{round_no}/sub", "subagent", sub
            edited = session[:-2] + [{"role": "user", "content": self._question()}]
            yield f"assistant/{round_no}", "edit", edited
            yield f"assistant/{round_no}", "regenerate", edited[:-1]  # the edit's prompt, without its reply

    def _question(self) -> str:
        return corpus_text(self.rng, self.corpus, 2)

    def _send(self, messages: Messages, attempts: int = 60) -> str | None:
        """One chat request; a draining (503) or restarting (unreachable) server is retried."""
        for _ in range(attempts):
            if self.stop.is_set():
                return None
            try:
                answer: dict[str, Any] = self.client.chat(messages, model=self.model, max_tokens=self.max_tokens,
                                                          temperature=0.0, timeout=300)
                self.sent += 1
                return answer["choices"][0]["message"]["content"] or ""
            except AdminError as exc:
                if exc.status not in (0, 503):
                    self.failed += 1
                    self.sent += 1
                    return None
                time.sleep(0.5)
        self.failed += 1
        return None
