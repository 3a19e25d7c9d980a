"""The server's drift detector: each prompt against the nearest earlier one of its namespace.

``observe`` runs once per request at lookup, before the prompt joins its namespace's ring:
it finds the nearest earlier sequence (``ring``), and where they part, classifies it
(``causes``). ``observe_reply`` holds a prompt with the reply fed after it (reply reuse), so a
re-rendered reply can be told. Bounded: the ring's limits, and the alignment's window.

Settings: ``APC_DRIFT=0`` turns it off; ``APC_DRIFT_TEXT=0`` keeps the cause and position but
no decoded text (the diff holds prompt text; it follows the journal's rules either way).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from server_patch import settings
from server_patch.drift.causes import Decode, Divergence, classify
from server_patch.drift.ring import RecentPrompts

log = logging.getLogger("server_patch.lineage")


@dataclass(frozen=True)
class DriftSettings:
    enabled: bool = True
    text: bool = True  # the decoded diff on the record (off: cause, segment and position only)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DriftSettings":
        return cls(settings.value("APC_DRIFT", environ), settings.value("APC_DRIFT_TEXT", environ))


class DriftDetector:
    """One per runtime: the rings of recent sequences, and what each request changed."""

    def __init__(self, config: DriftSettings | None = None, ring: RecentPrompts | None = None) -> None:
        self.config = config or DriftSettings()
        self.ring = ring if ring is not None else RecentPrompts()

    def observe(self, prompt: np.ndarray, namespace: str, *, kinds: Mapping[int, str] | None = None,
                gen_start: int | None = None, decode: Decode | None = None) -> dict[str, Any]:
        """What ``prompt`` changed against the nearest earlier sequence of ``namespace`` ({}:
        nothing, or off), as the record's ``drift``; the prompt then joins the ring. Never raises."""
        if not self.config.enabled:
            return {}
        found: Divergence | None = None
        try:
            prompt = np.asarray(prompt)
            hashes = self.ring.hashes(prompt)
            earlier, shared = self.ring.nearest(prompt, namespace, hashes)
            if earlier is not None:
                found = classify(earlier, prompt, shared, kinds or {}, decode)
            self.ring.add(prompt, namespace, hashes=hashes, kinds=kinds, gen_start=gen_start)
        except Exception as exc:  # an explanation must never fail a request
            log.debug("apc_lineage drift detection failed: %s", exc)
            return {}
        return found.as_dict(text=self.config.text) if found is not None else {}

    def observe_sequence(self, namespace: str, tokens: np.ndarray, kind: str) -> None:
        """A processed sequence (``MissBook.sequence_listeners``): a prompt with its fed reply is
        held, its reply starting where the held prompt it extends ends."""
        if kind != "reply" or not self.config.enabled:
            return
        tokens = np.asarray(tokens)
        earlier, shared = self.ring.nearest(tokens, namespace)
        if earlier is not None and shared == earlier.length and not earlier.reply_from:
            self.observe_reply(tokens, namespace, earlier.length)

    def observe_reply(self, tokens: np.ndarray, namespace: str, reply_from: int) -> None:
        """``namespace``'s prompt (``tokens[:reply_from]``) with the reply fed after it."""
        if self.config.enabled:
            try:
                self.ring.add(np.asarray(tokens), namespace, reply_from=reply_from)
            except Exception as exc:
                log.debug("apc_lineage drift reply note failed: %s", exc)


__all__ = ["DriftDetector", "DriftSettings"]
