"""The dashboard's own messages: panes ask, the app (which owns the source) acts."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass
class EventsArrived(Message, bubble=False):
    """The event thread queued events; one wake-up drains them all."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, EventsArrived)


@dataclass
class VerbRequested(Message):
    """A pane wants ``verb`` (pin, unpin, evict) done to ``entry_id``, after a confirmation."""

    verb: str
    entry_id: str


@dataclass
class NewAnchorRequested(Message):
    """A pane wants a new anchor pinned from a file (ask for the file, then confirm)."""


@dataclass
class RestartRequested(Message):
    """The restart pane wants the rolling restart started (after a confirmation)."""


@dataclass
class EntryRequested(Message):
    """A request row was chosen: show the entry it restored from (``entry_id`` "" for a cold request)."""

    entry_id: str


@dataclass
class ServerRequested(Message):
    """A Fleet row was chosen: the other tabs show that server from now on (``name``)."""

    name: str


@dataclass
class PollRequested(Message):
    """Poll the server now (a restarted server: the header must not keep the old one's state)."""
