"""The server's drift detector: each prompt against the nearest earlier one of its namespace.

``observe`` runs once per request at lookup, before the prompt joins its namespace's ring:
it finds the nearest earlier sequence (``ring``), and where they part, classifies it
(``causes``). ``observe_reply`` holds a prompt with the reply fed after it (reply reuse), so a
re-rendered reply can be told. Bounded: the ring's limits, and the alignment's window.

``points`` is what the policy captures to absorb the two measured patterns: the generation
prompt's start of every prompt (mini-swe-agent's retry drops the reply and lands there), and,
in a namespace seen rebuilding its history on resume (qwen-code ``-c``), the point where it did,
for every later prompt that shares the tokens before it.

Settings: ``APC_DRIFT=0`` turns detection off; ``APC_DRIFT_TEXT=0`` keeps the cause and position
but no decoded text (the diff holds prompt text; it follows the journal's rules either way);
``APC_DRIFT_POINTS=0`` captures no drift points.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from server_patch import settings
from server_patch.drift.causes import Cause, Decode, Divergence, classify
from server_patch.drift.ring import RecentPrompts

log = logging.getLogger("server_patch.lineage")

REBUILT_PER_NAMESPACE = 4  # points where a namespace rebuilt its history, newest kept


@dataclass(frozen=True)
class DriftSettings:
    enabled: bool = True
    text: bool = True  # the decoded diff on the record (off: cause, segment and position only)
    absorb: bool = True  # restore points where clients part (``points``)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DriftSettings":
        return cls(settings.value("APC_DRIFT", environ), settings.value("APC_DRIFT_TEXT", environ),
                   settings.value("APC_DRIFT_POINTS", environ))


def _digest(prompt: np.ndarray, at: int) -> int:
    return hash(np.asarray(prompt)[:at].tobytes())


class DriftDetector:
    """One per runtime: the rings of recent sequences, and what each request changed."""

    def __init__(self, config: DriftSettings | None = None, ring: RecentPrompts | None = None) -> None:
        self.config = config or DriftSettings()
        self.ring = ring if ring is not None else RecentPrompts()
        self._lock = threading.Lock()
        self._rebuilt: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()  # namespace -> (at, digest)

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
                if found is not None and found.cause == Cause.RESUME:
                    self._note_rebuilt(prompt, namespace, found.position)
            self.ring.add(prompt, namespace, hashes=hashes, kinds=kinds, gen_start=gen_start)
        except Exception as exc:  # an explanation must never fail a request
            log.debug("apc_lineage drift detection failed: %s", exc)
            return {}
        return found.as_dict(text=self.config.text) if found is not None else {}

    def points(self, prompt: np.ndarray, namespace: str, gen_start: int | None = None,
               blocks: Iterable[int] = ()) -> list[int]:
        """Where a restore point would absorb what clients like this one change
        (``LineageCache.plan_captures``' ``drift_points``): the generation prompt's start (a
        retry that drops the reply parts there), the section starts inside its first user
        message (``blocks``: a client resuming a session rebuilds that message without its
        reminder block), and the points where this namespace was seen to rebuild its history on
        resume, where ``prompt`` shares the tokens before them."""
        if not self.config.absorb:
            return []
        found = ([gen_start] if gen_start else []) + [int(b) for b in blocks]
        with self._lock:
            rebuilt = list(self._rebuilt.get(namespace, ()))
        n = int(np.asarray(prompt).shape[0])
        found += [at for at, digest in rebuilt if at < n and _digest(prompt, at) == digest]
        return found

    def _note_rebuilt(self, prompt: np.ndarray, namespace: str, at: int) -> None:
        """``namespace`` rebuilt its history on resume at ``at``: later prompts sharing the
        tokens before it get a restore point there (bounded, newest kept)."""
        with self._lock:
            held = self._rebuilt.pop(namespace, [])
            entry = (at, _digest(prompt, at))
            if entry not in held:
                held = [*held, entry][-REBUILT_PER_NAMESPACE:]
            self._rebuilt[namespace] = held
            while len(self._rebuilt) > self.ring.namespaces:
                self._rebuilt.popitem(last=False)

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
