"""Where a prompt parts from an earlier one of its namespace, in which segment, and why.

``classify`` is handed the earlier sequence (``ring.Seen``), the new prompt, the token where
they part, each one's segment boundaries (``boundaries.Kind`` by position: what *ends* there)
and, when the server has a tokenizer, a decoder. It aligns what follows the divergence (the
first run of ``SYNC_TOKENS`` equal tokens within ``WINDOW_TOKENS``), so it knows what the
client removed and added, and names a ``Cause``, first that applies:

* the earlier sequence's reply, re-rendered: only its final stop token differs, its thinking
  was dropped, only whitespace differs, or otherwise;
* the earlier prompt's generation prompt: a retry that dropped the reply (mini-swe-agent after
  a format error);
* a date or time changed in place (only digits, month and day names differ);
* the segment's tokens re-ordered: a tools block (``tools re-ordered``), else a moved block;
  a removed or added block found further on in the other: a moved block;
* a system (or tools) segment otherwise: a system prompt edit;
* a message the earlier prompt had messages after, re-synchronised later: the history rebuilt
  on resume (qwen-code ``-c`` rebuilds its first user message without the date reminder);
* re-synchronised otherwise: a block removed, or a message edited.

A prompt that never re-synchronises inside a message is another conversation (a branch, a new
task with the same system prompt), not drift: ``classify`` returns None for it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Mapping

import numpy as np

from server_patch.boundaries.kinds import BPE_SLACK, Kind
from server_patch.drift.ring import Seen

Decode = Callable[[np.ndarray], str]

WINDOW_TOKENS = 1024  # what follows a divergence is aligned within this many tokens of each
SYNC_TOKENS = 8  # equal tokens in a row that count as the two back in step
MIN_SHARED = 16  # an unsynced system edit sharing fewer tokens is another client's system prompt
DIFF_CHARS = 80  # each side of the text diff, at most
CONTEXT_CHARS = 40

# Boundaries at the end of a whole message (or of the template's preamble); ``SENT``, ``REJOIN``:
# a message end the finder places no restore point at (an earlier request sent the conversation
# whole; a render that draws the message as the last one rejoins the prompt there).
_MESSAGE_ENDS = {Kind.TOOLS, Kind.SYSTEM, Kind.MESSAGE, Kind.SENT, Kind.REJOIN}
# Segments inside the first message: its text, and a tools block the template renders after it.
_TOOLS_ENDS = {Kind.TOOLS, Kind.TOOLS_END}
_SYSTEM_ENDS = {Kind.SYSTEM, Kind.SYSTEM_TEXT, Kind.BEFORE_TOOLS}
_SEGMENT_ENDS = _MESSAGE_ENDS | _TOOLS_ENDS | _SYSTEM_ENDS
_ROLES = ("system", "developer", "user", "assistant", "tool")


class Cause(StrEnum):
    """What the client changed (the ``cause`` label of the counter, the report's rows)."""

    REPLY_STOP = "reply re-rendered: stop token"
    REPLY_THINKING = "reply re-rendered: thinking dropped"
    REPLY_WHITESPACE = "reply re-rendered: whitespace"
    REPLY_OTHER = "reply re-rendered"
    RETRY = "reply dropped on retry"
    DATE = "date/time changed"
    TOOLS = "tools re-ordered"
    MOVED = "block moved"
    SYSTEM = "system prompt edited"
    RESUME = "history rebuilt on resume"
    REMOVED = "block removed"
    EDIT = "message edited"


@dataclass(frozen=True)
class Divergence:
    """One prompt against the nearest earlier sequence of its namespace."""

    position: int  # the first token that differs
    segment: str  # "tools", "system", "message 3 (user)", "reply", "generation prompt", "unknown"
    cause: Cause
    tokens: int  # the earlier sequence's tokens past the divergence (what the change put out of reach, at most)
    earlier_tokens: int  # the earlier sequence's length
    earlier_seq: int = 0  # its number in the ring (which earlier request)
    removed: str = ""  # the decoded text diff (empty without a decoder or with text off)
    added: str = ""
    context: str = ""  # the text just before the divergence

    def as_dict(self, text: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"position": self.position, "segment": self.segment, "cause": str(self.cause),
                               "tokens": self.tokens, "earlier_tokens": self.earlier_tokens}
        if text:
            out.update(context=self.context, removed=self.removed, added=self.added)
        return out


@dataclass(frozen=True)
class _Aligned:
    removed: np.ndarray  # earlier tokens from the divergence to where the two are back in step
    added: np.ndarray
    synced: bool


def align(earlier: np.ndarray, prompt: np.ndarray, at: int, window: int = WINDOW_TOKENS,
          sync: int = SYNC_TOKENS) -> _Aligned:
    """What each side has from ``at`` until they are back in step (``sync`` equal tokens, or
    equal tokens up to the earlier one's end), within ``window`` tokens of each."""
    a, b = earlier[at:at + window], prompt[at:at + window]
    # autojunk: a token making up over 1 % of the window is no anchor for a match, which bounds
    # the cost on repetitive text (without it 1k repeated tokens took seconds)
    matcher = difflib.SequenceMatcher(None, a.tolist(), b.tolist(), autojunk=True)
    blocks = matcher.get_matching_blocks()
    for k, (i, j, size) in enumerate(blocks):
        # a pure removal or insertion, back in step at once but for a few tokens the template
        # renders otherwise after it (a reply re-rendered with empty thinking tags)
        after = blocks[k + 1] if k + 1 < len(blocks) else None
        if size and not (i and j) and after is not None and after.size >= sync \
                and after.a - (i + size) <= sync and after.b - (j + size) <= sync:
            return _Aligned(a[:i], b[:j], True)
        # equal up to the earlier one's end (within the BPE slack: its generation prompt's last
        # token may merge with what the new prompt renders after it) counts for a pure removal
        # or insertion, or a short swap
        reaches_end = i + size >= len(earlier) - at - BPE_SLACK
        if size >= sync or (size and reaches_end and (not (i and j) or size > max(i, j))):
            return _Aligned(a[:i], b[:j], True)
    return _Aligned(a, b, False)


def contains(hay: np.ndarray, needle: np.ndarray) -> bool:
    """Whether ``needle`` occurs as a run in ``hay`` (token ids)."""
    n = int(needle.shape[0])
    if n == 0 or n > int(hay.shape[0]):
        return False
    h, s = hay.astype(np.int64).tobytes(), needle.astype(np.int64).tobytes()
    at = h.find(s)
    while at >= 0:
        if at % 8 == 0:
            return True
        at = h.find(s, at + 1)
    return False


def _segment_ends(kinds: Mapping[int, str]) -> list[tuple[int, str]]:
    return sorted((p, k) for p, k in kinds.items() if k in _SEGMENT_ENDS)


def _segment_span(kinds: Mapping[int, str], at: int, length: int) -> tuple[int, int, str]:
    """The whole message (or preamble, or tools block) ``at`` falls in: (start, end, kind of
    its end: "" for the last message)."""
    start, end, kind = 0, length, ""
    for p, k in _segment_ends(kinds):
        if p <= at:
            start = p
        else:
            end, kind = p, k
            break
    return start, end, kind


def segment_name(kinds: Mapping[int, str], at: int, tokens: np.ndarray, decode: Decode | None) -> str:
    """Which segment of a prompt with these boundaries position ``at`` falls in."""
    if not kinds or all(k == Kind.STRIDE for k in kinds.values()):
        return "unknown"
    start, end, kind = _segment_span(kinds, at, int(tokens.shape[0]))
    if kind in _TOOLS_ENDS:
        return "tools"
    if kind in _SYSTEM_ENDS:
        return "system"
    index = 1 + sum(1 for p, k in kinds.items() if p <= at and k in _MESSAGE_ENDS and k != Kind.TOOLS)
    role = _role(tokens[start:start + 8], decode)
    return f"message {index}" + (f" ({role})" if role else "")


def _role(head: np.ndarray, decode: Decode | None) -> str:
    if decode is None:
        return ""
    text = decode(head).lower()
    found = [(text.find(r), r) for r in _ROLES if r in text]
    return min(found)[1] if found else ""


# A date or a time of day, in the spellings agents inject.
_MONTHS = "jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|" \
          "oct(?:ober)?|nov(?:ember)?|dec(?:ember)?"
_DAYS = "mon(?:day)?|tue(?:s(?:day)?)?|wed(?:nesday)?|thu(?:rs(?:day)?)?|fri(?:day)?|sat(?:urday)?|sun(?:day)?"
_DATE = re.compile(rf"\d{{4}}-\d{{1,2}}-\d{{1,2}}|\d{{1,2}}[/.]\d{{1,2}}[/.]\d{{2,4}}|\d{{1,2}}:\d{{2}}|"
                   rf"\b(?:{_MONTHS})\b|\b(?:{_DAYS})\b", re.IGNORECASE)
_DIGIT_GAPS = re.compile(r"(?<=[\d:/.-]) (?=[\d:/.-])")
_VARIABLE = re.compile(rf"\d+|\b(?:{_MONTHS}|{_DAYS}|am|pm|utc|gmt)\b", re.IGNORECASE)


def is_date_change(removed: str, added: str) -> bool:
    """Both sides name a date or time, and they differ in nothing else (a decoder that spaces
    digit tokens, "2 0 2 6 - 1 2", is read as "2026-12")."""
    removed, added = _DIGIT_GAPS.sub("", removed), _DIGIT_GAPS.sub("", added)
    if not (_DATE.search(removed) and _DATE.search(added)):
        return False
    return _masked(removed) == _masked(added)


def _date_changed(earlier: Seen, prompt: np.ndarray, at: int, aligned: _Aligned, decode: Decode) -> bool:
    """``is_date_change`` on each side's text with a few shared tokens around it (a token may
    hold only a date's last digits)."""
    before = prompt[max(0, at - 16):at]
    e_to, p_to = at + len(aligned.removed), at + len(aligned.added)
    return is_date_change(decode(np.concatenate([before, earlier.tokens[at:e_to + 4]])),
                          decode(np.concatenate([before, prompt[at:p_to + 4]])))


def _masked(text: str) -> str:
    return re.sub(r"\s+", " ", _VARIABLE.sub("#", text)).strip()


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _thinking(text: str) -> int:
    return len(re.findall(r"</?think(?:ing)?>", text))


def printable(text: str, limit: int, *, tail: bool = False) -> str:
    """``text`` for a terminal: newlines as ⏎, tabs as →, other control characters dropped,
    cut to ``limit`` characters (its end when ``tail``)."""
    text = text.replace("\r\n", "\n").replace("\n", "⏎").replace("\t", "→")
    text = "".join(c for c in text if c.isprintable())
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1):] if tail else text[:limit - 1] + "…"


def classify(earlier: Seen, prompt: np.ndarray, at: int, prompt_kinds: Mapping[int, str],
             decode: Decode | None = None) -> Divergence | None:
    """The divergence of ``prompt`` from ``earlier`` at token ``at`` (see the module
    docstring); None when it is not the client's drift (nothing differs, too little shared,
    another conversation)."""
    e_len, p_len = earlier.length, int(prompt.shape[0])
    if at >= e_len or at >= p_len or at < 1:
        return None
    aligned = align(earlier.tokens, prompt, at)
    text = (lambda ids: decode(ids) if len(ids) else "") if decode is not None else (lambda ids: "")
    removed, added = text(aligned.removed), text(aligned.added)
    cause, segment = _cause(earlier, prompt, at, prompt_kinds, aligned, removed, added, decode)
    if cause is None:
        return None
    context = text(prompt[max(0, at - 16):at])
    return Divergence(at, segment, cause, min(e_len, p_len) - at, e_len, earlier.seq,
                      printable(removed, DIFF_CHARS), printable(added, DIFF_CHARS),
                      printable(context, CONTEXT_CHARS, tail=True))


def _cause(earlier: Seen, prompt: np.ndarray, at: int, kinds: Mapping[int, str], aligned: _Aligned,
           removed: str, added: str, decode: Decode | None) -> tuple[Cause | None, str]:
    e_len = earlier.length
    if earlier.reply_from and at >= earlier.reply_from:
        if at == e_len - 1:
            return Cause.REPLY_STOP, "reply"
        if decode is not None and _thinking(removed) > _thinking(added):
            return Cause.REPLY_THINKING, "reply"
        if decode is not None and _squeezed(removed) == _squeezed(added):
            return Cause.REPLY_WHITESPACE, "reply"
        return Cause.REPLY_OTHER, "reply"
    if earlier.gen_start is not None and at >= earlier.gen_start:
        return Cause.RETRY, "generation prompt"
    # Named where the earlier prompt had it (a change at the end of a message parts at the next
    # message's start in the new prompt, but inside that message in the earlier one).
    segment = segment_name(earlier.kinds, at, earlier.tokens, decode) if earlier.kinds else \
        segment_name(kinds, at, prompt, decode)
    if decode is not None and _date_changed(earlier, prompt, at, aligned, decode):
        return Cause.DATE, segment
    moved = _reordered(earlier, prompt, at, kinds)
    if moved:
        tools = segment == "tools" or any(w in (removed + added) for w in ('"name"', "<tools>", "function"))
        return (Cause.TOOLS if tools else Cause.MOVED), segment
    if aligned.synced and (contains(prompt[at + len(aligned.added):], aligned.removed)
                           or contains(earlier.tokens[at + len(aligned.removed):], aligned.added)):
        return Cause.MOVED, segment
    if segment in ("tools", "system") and (aligned.synced or at >= MIN_SHARED):
        return Cause.SYSTEM, segment
    if not aligned.synced:
        return None, segment
    later = any(p > at + len(aligned.removed) and k in _MESSAGE_ENDS for p, k in earlier.kinds.items())
    if later:
        return Cause.RESUME, segment
    return (Cause.REMOVED if not len(aligned.added) else Cause.EDIT), segment


def _reordered(earlier: Seen, prompt: np.ndarray, at: int, kinds: Mapping[int, str]) -> bool:
    """The segment ``at`` falls in holds the same tokens in both, in another order."""
    p_start, p_end, _ = _segment_span(kinds, at, int(prompt.shape[0]))
    e_start, e_end, _ = _segment_span(earlier.kinds or kinds, at, earlier.length)
    if not kinds or p_end - p_start < SYNC_TOKENS or p_end - p_start != e_end - e_start or p_start != e_start:
        return False
    mine, theirs = prompt[p_start:p_end], earlier.tokens[e_start:e_end]
    return not np.array_equal(mine, theirs) and np.array_equal(np.sort(mine), np.sort(theirs))


__all__ = ["Cause", "Divergence", "align", "classify", "contains", "is_date_change", "printable", "segment_name"]
