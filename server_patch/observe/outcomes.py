"""How a request's record says it ended: the words of ``/admin/requests`` and the journal.

The timing record (``integration.timings``) writes them and the answers' types
(``admin.schema``) parse them; they lived in the timing record, so ``admin`` imported
``integration`` while ``integration`` mounts ``admin`` (issue 35). Imports nothing of
``server_patch``.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """How a request ended, when not by itself ("" in its record: it went on past its first token)."""

    CANCELLED = "cancelled"  # its client went away


class Phase(StrEnum):
    """Where a cancelled request was."""

    QUEUED = "queued"  # before its prefill and lookup: its record is made at the cancel
    PREFILL = "prefill"  # no first token: its record ends there
    DECODE = "decode"  # after its first token


class Stored(StrEnum):
    """What a cancelled request's entry kept."""

    NOTHING = "nothing"
    PROMPT = "prompt"  # the prompt-end commit
    REPLY = "reply"  # reply reuse kept what was fed


__all__ = ["Outcome", "Phase", "Stored"]
