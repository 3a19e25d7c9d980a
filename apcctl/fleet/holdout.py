"""Holdout-style traffic: the conversations of this project's own end-to-end tests, as a trace.

``tests/e2e/test_e2e_conversation.py`` checks one server with independent conversations that share
no system prompt: a long multi-turn chat, a chat whose last message is edited and then
regenerated, and two requests that share a long opening and differ only at the end (twins).
The agent trace (``apcctl.agent_traffic.AgentTraffic``) is the opposite: sessions of a
few agents that share system prompts. A routing policy should keep the reuse of both, so
``apcctl bench fleet --trace conversations`` sends this one the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from apcctl.agent_traffic import AgentTraffic, Messages, corpus_text

# Sentences of the synthetic corpus (about 9 words each), sized like the e2e tests' texts.
SYSTEM, OPENING, FOLLOW_UP, SHARED = 30, 12, 6, 60
TURNS = 4


@dataclass
class ConversationTraffic(AgentTraffic):
    """Rounds of three independent conversations; each round draws new texts (no shared prompt)."""

    def _rounds(self) -> Iterator[tuple[str, str, Messages]]:
        round_no = 0
        while True:
            round_no += 1
            chat = [{"role": "system", "content": self._say(SYSTEM)}]
            for turn in range(TURNS):
                chat.append({"role": "user", "content": self._say(OPENING if turn == 0 else FOLLOW_UP)})
                yield f"chat/{round_no}", "turn" if turn else "new_session", chat
            edit = [{"role": "system", "content": self._say(SYSTEM)}, {"role": "user", "content": self._say(OPENING)}]
            yield f"edit/{round_no}", "new_session", edit
            edit.append({"role": "user", "content": self._say(OPENING)})
            yield f"edit/{round_no}", "turn", edit
            edited = edit[:-2] + [{"role": "user", "content": self._say(OPENING)}]
            yield f"edit/{round_no}", "edit", edited
            yield f"edit/{round_no}", "regenerate", edited[:-1]  # the edit's prompt again, without its reply
            shared = self._say(SHARED)
            first = [{"role": "user", "content": f"{shared} {self._say(2)}"}]
            yield f"twins/{round_no}/a", "new_session", first
            yield f"twins/{round_no}/b", "shared_prefix", [{"role": "user", "content": f"{shared} {self._say(2)}"}]
            first.append({"role": "user", "content": self._say(FOLLOW_UP)})
            yield f"twins/{round_no}/a", "turn", first

    def _say(self, sentences: int) -> str:
        return corpus_text(self.rng, self.corpus, sentences)
