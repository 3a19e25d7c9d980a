"""Chat-template segment boundaries: where agent prompts diverge the first time they are seen.

A recurrent state cannot be rewound, so a prompt that diverges from everything stored can only
restore at a checkpoint at or before the divergence. Agent prompts diverge at the chat
template's seams: after the tools block (a new system text, a timestamp, a variant), after a
system message, at the start of a message (an edit, a sub-agent, a new question). Those points
are known before prefill: this module finds them, and the coordinator asks the policy to
capture a checkpoint at each one that lies in the prompt's uncached region.

How (the anchor's technique, generalised):

* ``note_request`` runs where mlx-vlm renders a chat request (the ``apply_chat_template``
  wrapper in ``anchors``). It renders the template on message prefixes (no generation prompt):
  ``[]`` with the tools (the tools block / preamble), then ``messages[:i]`` for every ``i``.
  A render that is a text prefix of the full prompt gives a boundary at its end; one that is
  not (a template that renders the last message differently) gives one at the longest common
  prefix, which is still a point where prompts sharing it diverge. When the preamble cannot be
  rendered alone (transformers refuses an empty conversation), the first message's start and
  its content's start are found from the difference of two renders of it with another role,
  and with another content. Optionally (``APC_SEGMENTS_TOOLS=1``) the end of each tool inside
  the tools block, where renders with ``tools[:j]`` (and with one more tool) leave it.
* The rendered text is split at the boundaries and each piece is tokenized on its own.
  Renders are cached by a hash chain over the messages (a conversation's next turn renders
  only its new messages), pieces by their text, so a request costs O(messages) hashing, its
  new renders and the tokenization of its new text.
* ``boundaries(prompt_token_ids)`` runs in the generator when prefill is planned. It walks the
  noted pieces along the prompt's tokens (the exact match is found by hash; otherwise the
  most recent notes are tried, a tokenizer-added BOS is skipped, and where the tokenizer
  merged tokens across a seam the walk resynchronises a few tokens on) and returns the token
  positions. A seam next
  to a special (added) token cannot be merged by BPE and is exact; any other seam is moved
  ``BPE_SLACK`` tokens earlier, as the anchor is.
* No note matches (no chat template, a template that cannot be rendered piecewise, a prompt
  the server changed after rendering): the fallback is every multiple of the periodic stride
  (``APC_SEGMENTS_FALLBACK_STRIDE``, default 2048), the restore points stock 0.7.10 would have.

A boundary is only ever a *suggestion* of where to capture: restore points are matched token
by token, so a wrong or stale boundary costs a useless checkpoint, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from server_patch.envconfig import env_values
from server_patch.integration import anchors
from server_patch.lineage.lookup import common_prefix_len
from server_patch.lineage.model import as_tokens

log = logging.getLogger("server_patch.lineage")

BPE_SLACK = anchors.BPE_SLACK

# Boundary kinds (what ends at the boundary).
PREAMBLE = "tools"  # the tools block, or whatever the template renders before the first message
TOOL = "tool"  # one tool inside the tools block (opt-in)
CONTENT = "content"  # the header of the first message (its content starts here)
SYSTEM = "system"  # a system/developer message
PARAGRAPH = "paragraph"  # a paragraph break ("\n\n") inside a system message
MESSAGE = "message"  # any other message: the next one starts here
STRIDE = "stride"  # fallback: a multiple of the periodic stride
_KIND_RANK = {SYSTEM: 0, PREAMBLE: 1, MESSAGE: 2, CONTENT: 3, PARAGRAPH: 4, TOOL: 5}
_MIN_PARAGRAPH_SEARCH = 64  # a system text shorter than this is not searched for paragraphs

_SYSTEM_ROLES = ("system", "developer")
_MAX_BOS = 4  # tokens a tokenizer may put before the rendered text (BOS and the like)
_MERGE_TOKENS = 3  # tokens on either side of a seam that a BPE merge may change
_PROBES = ("A", "B")  # two contents that differ in their first character
_EXTRA_TOOL = {"type": "function", "function": {"name": "zz_segment_probe", "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class SegmentInfo:
    """Where this prompt's template segments end, as token lengths.

    ``anchor_len``/``anchor_label``: the system+tools prefix (as ``anchors`` computes it),
    ``segments``: every boundary, sorted; ``kinds``: the kind of each; ``source``:
    "template" (from a noted render), "fallback" (stride) or "none".
    """

    anchor_len: int | None
    anchor_label: str
    segments: list[int]
    source: str = "none"
    kinds: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SegmentSettings:
    """Knobs, read from ``APC_SEGMENTS_*``."""

    enabled: bool = True
    # Segments when no template boundaries are known (0: none).
    fallback_stride: int = 2048
    # Boundaries between tools inside the tools block. Off by default: with the current policy
    # they are adopted by the anchor and crowd out the tools end (docs/segments.md).
    tool_boundaries: bool = False
    # Paragraph breaks reported per system message, the last ones (-1: all, 0: none). mlx-vlm
    # 0.7.10 joins every system/developer message into one with "\n\n", so these are also where
    # the client's system messages ended (a clock, a session note, a variant's last section).
    system_paragraphs: int = 2
    # Renders a request may add to the cache (a cold 200-message conversation renders the
    # newest ones); 0 means no limit.
    max_new_renders: int = 8
    # Trailing leading-system messages shorter than this (in total) stay out of the anchor.
    anchor_tail_tokens: int = 256
    max_notes: int = 64
    walk_candidates: int = 16
    render_cache_entries: int = 16_384
    piece_cache_tokens: int = 8_000_000

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "SegmentSettings":
        """``APC_SEGMENTS`` (on/off) and ``APC_SEGMENTS_<NAME>`` for the fields in ``ENV``."""
        env = os.environ if env is None else env
        values = env_values(cls, {name: key for key, name in ENV.items()}, env)
        for name, value in values.items():
            if not isinstance(value, bool) and value < (-1 if name == "system_paragraphs" else 0):
                key = next(k for k, n in ENV.items() if n == name)
                raise ValueError(f"{key} must be >= 0, got {value}")
        return replace(cls(), **values)


# Environment variable -> SegmentSettings field.
ENV = {
    "APC_SEGMENTS": "enabled",
    "APC_SEGMENTS_FALLBACK_STRIDE": "fallback_stride",
    "APC_SEGMENTS_TOOLS": "tool_boundaries",
    "APC_SEGMENTS_SYSTEM_PARAGRAPHS": "system_paragraphs",
    "APC_SEGMENTS_ANCHOR_TAIL": "anchor_tail_tokens",
    "APC_SEGMENTS_MAX_NEW_RENDERS": "max_new_renders",
}


# ---------------------------------------------------------------------------- small helpers


def _digest(*parts: bytes | str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part)
        h.update(b"\x1f")
    return h.digest()


def _text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _canonical(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        return repr(value)


def _lcp(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _role(message: Any) -> str:
    if isinstance(message, dict):
        return str(message.get("role", ""))
    return str(getattr(message, "role", "user" if isinstance(message, str) else ""))


def _leading_system(messages: Sequence[Any]) -> int:
    count = 0
    for message in messages:
        if _role(message) not in _SYSTEM_ROLES:
            break
        count += 1
    return count


def _added_tokens(tokenizer: Any) -> tuple[frozenset[int], tuple[str, ...]]:
    """Ids and texts of added/special tokens: the pre-tokenizer splits on them, so BPE never
    merges across them, and a boundary must never fall inside one."""
    ids: set[int] = set()
    texts: set[str] = set()
    try:
        added = tokenizer.get_added_vocab()
        ids.update(int(i) for i in added.values())
        texts.update(str(t) for t in added if len(str(t)) > 1)
    except Exception:
        pass
    try:
        ids.update(int(i) for i in tokenizer.all_special_ids)
        texts.update(str(t) for t in tokenizer.all_special_tokens if len(str(t)) > 1)
    except Exception:
        pass
    return frozenset(ids), tuple(sorted(texts, key=len, reverse=True))


def _snap(cut: int, text: str, specials: tuple[str, ...]) -> int:
    """``cut`` moved to the start of an added token whose text it would split (else unchanged).

    Where two renders part inside a special token (GLM's ``<|system|>`` against ``<|user|>``
    share ``<|``), the boundary belongs before the token.
    """
    for special in specials:
        start = text.rfind(special, max(0, cut - len(special) + 1), cut + len(special) - 1)
        if start != -1 and start < cut < start + len(special):
            return start
    return cut


# ---------------------------------------------------------------------------- notes


@dataclass
class _Candidate:
    """A boundary in the rendered text: its character offset and the digest of the text before it."""

    offset: int
    kind: str
    digest: bytes
    # A whole prefix render that lies before the end of the last message: one of these must
    # verify for the template to count as renderable piecewise (the render of all messages
    # is a prefix of almost any template's output, and a common prefix alone proves nothing).
    witness: bool = False


@dataclass
class _Note:
    """One rendered request: its text split at verified boundaries, each piece tokenized."""

    pieces: list[np.ndarray]
    kinds: list[str]  # kinds[j]: the boundary at the end of piece j (len(pieces) - 1 of them)
    anchor_seams: tuple[int, ...]  # seams ending each leading system message (or the tools alone)
    label: str
    hard_ids: frozenset[int]
    key: int = 0

    @property
    def length(self) -> int:
        return sum(int(p.shape[0]) for p in self.pieces)


@dataclass
class _Walk:
    """How far a note matched a prompt: boundary positions (slack applied) and tokens covered."""

    note: _Note
    positions: list[tuple[int, str]]
    covered: int
    anchors: list[int]  # token positions of the leading system message ends the walk reached


class SegmentFinder:
    """Notes rendered chat requests and finds their segment boundaries in token ids. Thread-safe."""

    def __init__(self, settings: SegmentSettings | None = None) -> None:
        self.settings = settings or SegmentSettings()
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._renders: OrderedDict[bytes, tuple | None] = OrderedDict()
        self._pieces: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._piece_tokens = 0
        self._notes: OrderedDict[int, _Note] = OrderedDict()
        self._sent: OrderedDict[bytes, None] = OrderedDict()  # message chains sent as a whole prompt
        self._added: dict[int, tuple[frozenset[int], tuple[str, ...]]] = {}

    # ------------------------------------------------------------------ noting a request

    def note(self, apply: Callable[..., Any], processor: Any, config: Any, messages: Any,
             kwargs: Mapping[str, Any], rendered: Any) -> _Note | None:
        """Render ``messages``' prefixes, find the boundaries inside ``rendered``, remember them."""
        if not self.settings.enabled or not isinstance(messages, list) or not messages:
            return None
        if not isinstance(rendered, str) or not rendered or kwargs.get("return_messages"):
            return None
        tokenizer = getattr(processor, "tokenizer", processor)
        if not hasattr(tokenizer, "encode"):
            return None
        prefix_kwargs = {k: v for k, v in kwargs.items()
                         if k not in ("add_generation_prompt", "num_images", "num_audios", "return_messages")}
        base = _digest(b"segments/1", str(id(processor)), _canonical(config if isinstance(config, dict)
                                                                      else getattr(config, "model_type", "")),
                       _canonical(sorted(prefix_kwargs.items(), key=lambda kv: kv[0])))

        def render(msgs: list[Any], **extra: Any) -> str:
            text = apply(processor, config, msgs, add_generation_prompt=False, **{**prefix_kwargs, **extra})
            if not isinstance(text, str):
                raise TypeError(f"template render returned {type(text).__name__}")
            return text

        specials = self._added_tokens(tokenizer)[1]

        def lcp(a: str, b: str) -> int:
            return _snap(_lcp(a, b), a, specials)

        budget = [self.settings.max_new_renders or 1 << 30]
        candidates, anchor_offsets = self._candidates(render, lcp, base, messages, prefix_kwargs, rendered,
                                                      budget)
        offsets = self._verify(candidates, rendered)
        anchor_offsets = [o for o in anchor_offsets if o in offsets]
        if offsets and self.settings.system_paragraphs:
            anchor_offsets = self._paragraphs(messages, rendered, offsets, anchor_offsets)
        return self._store(tokenizer, rendered, offsets, anchor_offsets, messages, prefix_kwargs)

    def _cached(self, key: bytes, make: Callable[[], tuple | None], budget: list[int]) -> tuple | None:
        with self._lock:
            if key in self._renders:
                self._renders.move_to_end(key)
                self.stats["render_hits"] += 1
                return self._renders[key]
        if budget[0] <= 0:
            self.stats["render_skipped"] += 1
            return None
        budget[0] -= 1
        try:
            value = make()
        except Exception as exc:  # a template that cannot render this prefix: no boundary here
            log.debug("segment render failed: %s", exc)
            value = None
            self.stats["render_failures"] += 1
        with self._lock:
            self._renders[key] = value
            while len(self._renders) > self.settings.render_cache_entries:
                self._renders.popitem(last=False)
        return value

    def _point(self, render: Callable[[], str], lcp: Callable[[str, str], int],
               full: str) -> tuple[int, bytes, int, bytes]:
        """(length, digest, common prefix with the prompt text, its digest) of one prefix render.

        The cache keeps these, not the text: a later prompt verifies them against its own text.
        """
        self.stats["renders"] += 1
        text = render()
        cut = lcp(text, full)
        return (len(text), _text_digest(text), cut, _text_digest(text[:cut]))

    def _candidates(self, render: Callable[..., str], lcp: Callable[[str, str], int], base: bytes,
                    messages: list[Any],
                    kwargs: Mapping[str, Any], full: str,
                    budget: list[int]) -> tuple[list[_Candidate], list[int]]:
        """Candidate boundaries (to verify against ``full``) and the anchor's candidate offsets."""
        out: list[_Candidate] = []

        def add(point: tuple | None, kind: str, witness: bool = True) -> None:
            if point is None:
                return
            length, digest, lcp, lcp_digest = point
            if length > 0:
                out.append(_Candidate(length, kind, digest, witness))
            if 0 < lcp < length:  # not a prefix: the point where it leaves the prompt's text
                out.append(_Candidate(lcp, kind, lcp_digest))

        # The preamble (GLM: the tools block): the template with the tools and no message. Many
        # tokenizers refuse an empty conversation; then the first message's start is where two
        # renders of it with different roles part, and where its content starts, where two
        # renders with different contents part.
        preamble = self._cached(_digest(base, b"preamble"), lambda: self._point(lambda: render([]), lcp, full),
                                budget)
        add(preamble, PREAMBLE)
        preamble_ok = preamble is not None and preamble[2] == preamble[0]
        first = messages[0]
        role_probe: tuple | None = None
        if not preamble_ok and isinstance(first, dict) and isinstance(first.get("content"), str):
            role = _role(first)
            other = "user" if role in _SYSTEM_ROLES else "system"
            role_probe = self._cached(_digest(base, b"probe-role", role),
                                      lambda: self._probe(render, lcp, [dict(first, role=other), first]),
                                      budget)
            add(role_probe, PREAMBLE)
            add(self._cached(_digest(base, b"probe-content", role),
                             lambda: self._probe(render, lcp, [dict(first, content=c) for c in _PROBES]),
                             budget),
                CONTENT)

        # Every message prefix but two kinds whose end is a few tokens from a restore point,
        # where the policy never captures: the whole conversation (the generation prompt
        # follows), and a conversation an earlier request sent whole (its entry sits there).
        # Newest first: older ones are cached from earlier turns, so a turn renders one new
        # prefix, its question's start. The anchor's is never skipped.
        chain, keys = base, []
        for message in messages:
            chain = _digest(chain, _canonical(message))
            keys.append(chain)
        n_system = _leading_system(messages)
        with self._lock:
            sent = {i for i in range(1, len(messages)) if keys[i - 1] in self._sent}
            self._sent[keys[-1]] = None
            self._sent.move_to_end(keys[-1])
            while len(self._sent) > self.settings.render_cache_entries:
                self._sent.popitem(last=False)
        order = [i for i in range(len(messages) - 1, 0, -1) if i not in sent]
        if n_system:
            if n_system in order:
                order.remove(n_system)
            order.insert(0, n_system)
        points: dict[int, tuple | None] = {}
        for i in order:
            prefix = messages[:i]
            points[i] = self._cached(keys[i - 1], lambda p=prefix: self._point(lambda: render(p), lcp, full),
                                     budget)
        for i in sorted(points):
            add(points[i], SYSTEM if _role(messages[i - 1]) in _SYSTEM_ROLES else MESSAGE, i < len(messages))

        tools = kwargs.get("tools")
        if self.settings.tool_boundaries and isinstance(tools, list) and len(tools) > 1:
            context: list[Any] = [] if preamble_ok else messages[:1]
            key = _digest(base, b"tools", _canonical(context))
            found = self._cached(key, lambda: self._tool_cuts(render, lcp, context, tools, full), budget)
            for cut, digest in (found or ((),))[0]:
                out.append(_Candidate(cut, TOOL, digest))

        anchor: list[int] = []
        if n_system:
            anchor = [points[i][0] for i in range(1, n_system + 1) if points.get(i) is not None]
        elif tools and preamble_ok:
            anchor = [preamble[0]]
        elif tools and role_probe is not None:
            anchor = [role_probe[0]]
        return out, anchor

    def _probe(self, render: Callable[..., str], lcp: Callable[[str, str], int], variants: list[Any]) -> tuple:
        """Where two one-message renders part: (cut, digest, cut, digest) of their common prefix."""
        a, b = (render([m]) for m in variants)
        self.stats["renders"] += 2
        cut = lcp(a, b)
        return (cut, _text_digest(a[:cut]), cut, _text_digest(a[:cut]))

    def _paragraphs(self, messages: list[Any], full: str, offsets: dict[int, str],
                    anchor_offsets: list[int]) -> list[int]:
        """Add the last paragraph breaks of each system message to ``offsets`` (found verbatim in
        the prompt text, so no render is needed); those of the last leading system message become
        anchor candidates too (the anchor may end before a short trailing paragraph)."""
        keep = self.settings.system_paragraphs
        n_system = _leading_system(messages)
        search = 0
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if _role(message) not in _SYSTEM_ROLES or not isinstance(content, str) \
                    or len(content) < _MIN_PARAGRAPH_SEARCH or "\n\n" not in content:
                continue
            at = full.find(content, search)
            if at < 0:
                continue
            search = at + len(content)
            breaks, j = [], content.find("\n\n")
            while j >= 0:
                stop = j + 2
                while stop < len(content) and content[stop] == "\n":
                    stop += 1
                if 0 < j and stop < len(content):
                    breaks.append(at + stop)  # where the next paragraph's text starts
                j = content.find("\n\n", stop)
            if keep > 0:
                breaks = breaks[-keep:]
            for b in breaks:
                offsets.setdefault(b, PARAGRAPH)
            if i == n_system - 1 and anchor_offsets:
                anchor_offsets = sorted(set(anchor_offsets) | set(breaks))
        return anchor_offsets

    def _tool_cuts(self, render: Callable[..., str], lcp: Callable[[str, str], int], context: list[Any],
                   tools: list[Any], full: str) -> tuple:
        """The end of each tool: where the render with ``tools[:j]`` (j = 1 .. all, and all plus
        one more, for the last tool's end before the block's closing text) leaves the full one."""
        reference = render(context)
        self.stats["renders"] += len(tools) + 1
        usable = lcp(reference, full)
        variants = [tools[:j] for j in range(1, len(tools))] + [list(tools) + [_EXTRA_TOOL]]
        cuts = {lcp(render(context, tools=v), reference) for v in variants}
        return (tuple((c, _text_digest(reference[:c])) for c in sorted(cuts) if 0 < c <= usable),)

    def _verify(self, candidates: list[_Candidate], full: str) -> dict[int, str]:
        """Offsets whose text prefix equals the prompt's (one incremental hash over the prompt)."""
        good: dict[int, str] = {}
        h = hashlib.blake2b(digest_size=16)
        position, piecewise = 0, False
        for cand in sorted(candidates, key=lambda c: c.offset):
            if not 0 < cand.offset < len(full):
                continue
            h.update(full[position:cand.offset].encode("utf-8", "surrogatepass"))
            position = cand.offset
            if h.copy().digest() != cand.digest:
                continue
            piecewise = piecewise or cand.witness
            old = good.get(cand.offset)
            if old is None or _KIND_RANK[cand.kind] < _KIND_RANK[old]:
                good[cand.offset] = cand.kind
        if not piecewise:
            self.stats["not_piecewise"] += 1
            return {}
        return good

    def _store(self, tokenizer: Any, full: str, offsets: dict[int, str], anchor_offsets: list[int],
               messages: list[Any], kwargs: Mapping[str, Any]) -> _Note | None:
        cuts = sorted(offsets)
        bounds = [0, *cuts, len(full)]
        encode = self._encoder(tokenizer)
        pieces = [self._piece(full[a:b], encode) for a, b in zip(bounds, bounds[1:])]
        n_system = _leading_system(messages)
        system = [m for m in messages[:n_system] if isinstance(m, dict)]
        tools = kwargs.get("tools")
        label = anchors.label(system, tools) if (system or tools) else ""
        note = _Note(pieces, [offsets[c] for c in cuts],
                     tuple(cuts.index(o) for o in anchor_offsets),
                     label, self.hard_ids(tokenizer))
        note.key = hash(np.concatenate(pieces).tobytes())
        with self._lock:
            self._notes.pop(note.key, None)
            self._notes[note.key] = note
            while len(self._notes) > self.settings.max_notes:
                self._notes.popitem(last=False)
            self.stats["notes"] += 1
        return note

    def _encoder(self, tokenizer: Any) -> Callable[[str], list[int]]:
        def encode(text: str) -> list[int]:
            try:
                return tokenizer.encode(text, add_special_tokens=False)
            except TypeError:
                return tokenizer.encode(text)
        return encode

    def hard_ids(self, tokenizer: Any) -> frozenset[int]:
        """The tokenizer's added-token ids, computed once per tokenizer."""
        return self._added_tokens(tokenizer)[0]

    def _added_tokens(self, tokenizer: Any) -> tuple[frozenset[int], tuple[str, ...]]:
        key = id(tokenizer)
        with self._lock:
            found = self._added.get(key)
        if found is None:
            found = _added_tokens(tokenizer)
            with self._lock:
                self._added[key] = found
        return found

    def _piece(self, text: str, encode: Callable[[str], list[int]]) -> np.ndarray:
        """Token ids of one piece of rendered text, cached by the text's digest."""
        key = _text_digest(text)
        with self._lock:
            hit = self._pieces.get(key)
            if hit is not None:
                self._pieces.move_to_end(key)
                self.stats["piece_hits"] += 1
                return hit
        ids = as_tokens(encode(text))
        self.stats["pieces_tokenized"] += 1
        self.stats["tokens_tokenized"] += int(ids.shape[0])
        with self._lock:
            self._pieces[key] = ids
            self._piece_tokens += int(ids.shape[0])
            while self._piece_tokens > self.settings.piece_cache_tokens and len(self._pieces) > 1:
                _, old = self._pieces.popitem(last=False)
                self._piece_tokens -= int(old.shape[0])
        return ids

    # ------------------------------------------------------------------ finding boundaries

    def boundaries(self, prompt_token_ids: Any) -> SegmentInfo:
        """Segment boundaries of ``prompt_token_ids`` (token lengths, sorted) and its anchor."""
        prompt = as_tokens(prompt_token_ids)
        n = int(prompt.shape[0])
        if not self.settings.enabled or n == 0:
            return self._anchor_only(prompt, [])
        key = hash(prompt.tobytes())
        with self._lock:
            exact = self._notes.get(key)
            recent = list(reversed(self._notes.values()))[: self.settings.walk_candidates]
        best: _Walk | None = None
        for note in ([exact] if exact is not None else []) + [r for r in recent if r is not exact]:
            walk = self._walk(prompt, note)
            if walk is not None and (best is None or walk.covered > best.covered):
                best = walk
            if best is not None and best.covered >= n:
                break
        if best is None or not best.positions:
            self.stats["fallback"] += 1
            return self._anchor_only(prompt, self._stride(n, 0), STRIDE)
        self.stats["matched_exact" if best.note is exact else "matched_walk"] += 1
        kinds: dict[int, str] = {}
        for p, k in best.positions:
            if 0 < p < n and (p not in kinds or _KIND_RANK.get(k, 9) < _KIND_RANK.get(kinds[p], 9)):
                kinds[p] = k
        if best.covered < n - 1:  # the rest of the prompt is unknown to the template: stride
            for p in self._stride(n, best.covered):
                kinds.setdefault(p, STRIDE)
        anchor = self._anchor(best, n)
        if anchor is not None:
            anchor_len, label = anchor, best.note.label
        else:
            registered = anchors.REGISTRY.boundary(prompt)
            anchor_len, label = registered if registered else (None, "")
        return SegmentInfo(anchor_len, label, sorted(kinds), "template", kinds)

    def _anchor(self, walk: _Walk, n: int) -> int | None:
        """The end of the leading system messages, less a trailing part shorter than the anchor tail.

        A short trailing system message or paragraph (the time, a session id; mlx-vlm joins
        system messages into one with "\n\n") would make every request's anchor a new one and
        leave the system text before it without a restore point: the policy skips a segment
        that close to the anchor. So the anchor ends before it.
        """
        if len(walk.anchors) != len(walk.note.anchor_seams) or not walk.anchors:
            return None  # the walk stopped inside the system prefix
        ends = walk.anchors
        last = ends[-1]
        chosen = next(e for e in ends if last - e < max(1, self.settings.anchor_tail_tokens))
        return chosen if 0 < chosen <= n else None

    def _anchor_only(self, prompt: np.ndarray, segments: list[int], kind: str = STRIDE) -> SegmentInfo:
        registered = anchors.REGISTRY.boundary(prompt)
        anchor_len, label = registered if registered else (None, "")
        return SegmentInfo(anchor_len, label, segments, "fallback" if segments else "none",
                           {p: kind for p in segments})

    def _stride(self, n: int, after: int) -> list[int]:
        stride = self.settings.fallback_stride
        if stride <= 0:
            return []
        first = (after // stride + 1) * stride
        return list(range(first, n, stride))

    def _walk(self, prompt: np.ndarray, note: _Note) -> _Walk | None:
        """Match ``note``'s pieces along ``prompt``; None when not even its first piece matches.

        Pieces were tokenized apart. Where the prompt's tokenization merged the tail of one
        piece with the head of the next, the piece is accepted when at most ``_MERGE_TOKENS``
        of its tokens differ, the seam is put before the merge (minus the slack), and the walk
        resynchronises on the next piece a few tokens on.
        """
        n = int(prompt.shape[0])
        pieces = note.pieces
        if len(pieces) < 2 or pieces[0].shape[0] == 0:
            return None
        first = pieces[0]
        pos, best_shared = -1, 0
        for o in range(min(_MAX_BOS, n - 1) + 1):  # tokens the tokenizer put first (BOS)
            shared = common_prefix_len(prompt[o:], first)
            if shared > best_shared:
                pos, best_shared = o, shared
            if shared == first.shape[0]:
                break
        if pos < 0 or best_shared < min(int(first.shape[0]), 4):
            return None
        hard = note.hard_ids
        positions: list[tuple[int, str]] = []
        anchors_at: list[int] = []
        skip = 0  # head tokens of the current piece that a merge already consumed
        for j, ids in enumerate(pieces):
            body = ids[skip:]
            size = int(body.shape[0])
            agreed = common_prefix_len(prompt[pos:], body)
            if j == len(pieces) - 1:  # the tail (generation prompt): nothing to place after it
                pos += agreed
                break
            nxt = pieces[j + 1]
            if agreed == size:
                pos += size
                at = pos
                if not (skip == 0 and ((size and int(body[-1]) in hard) or (nxt.shape[0] and int(nxt[0]) in hard))):
                    at = max(0, pos - BPE_SLACK)
                skip = 0
            elif size - agreed <= _MERGE_TOKENS:
                at = max(pos, pos + agreed - BPE_SLACK)
                found = self._resync(prompt, pos + agreed, nxt)
                if found is None:
                    positions.append((at, note.kinds[j]))
                    if j in note.anchor_seams:
                        anchors_at.append(at)
                    pos += agreed
                    break
                pos, skip = found
                self.stats["seam_merges"] += 1
            else:
                pos += agreed
                break
            positions.append((at, note.kinds[j]))
            if j in note.anchor_seams:
                anchors_at.append(at)
        if not positions:
            return None
        return _Walk(note, positions, pos, anchors_at)

    @staticmethod
    def _resync(prompt: np.ndarray, start: int, nxt: np.ndarray) -> tuple[int, int] | None:
        """(position, skipped head tokens) where ``nxt`` continues after a merged seam."""
        n = int(prompt.shape[0])
        for r in range(0, _MERGE_TOKENS + 1):
            width = min(4, int(nxt.shape[0]) - r)
            if width <= 0:
                break
            for q in range(start, min(n - width, start + _MERGE_TOKENS) + 1):
                if np.array_equal(prompt[q:q + width], nxt[r:r + width]):
                    return q, r
        return None

    # ------------------------------------------------------------------ inspection

    def __len__(self) -> int:
        return len(self._notes)

    def clear(self) -> None:
        with self._lock:
            self._renders.clear()
            self._sent.clear()
            self._pieces.clear()
            self._piece_tokens = 0
            self._notes.clear()
            self.stats.clear()


FINDER = SegmentFinder(SegmentSettings.from_env())


def boundaries(prompt_token_ids: Any) -> SegmentInfo:
    """The coordinator's entry point: anchor and segment boundaries of one prompt."""
    try:
        return FINDER.boundaries(prompt_token_ids)
    except Exception as exc:  # never break prefill over a hint
        log.warning("apc_lineage segment boundaries failed: %s", exc)
        registered = anchors.REGISTRY.boundary(prompt_token_ids)
        return SegmentInfo(registered[0] if registered else None, registered[1] if registered else "", [])


def note_request(apply: Callable[..., Any], processor: Any, config: Any, prompt: Any,
                 kwargs: Mapping[str, Any], rendered: Any) -> None:
    """Called by the ``apply_chat_template`` wrapper after each render (best effort)."""
    if not kwargs.get("add_generation_prompt", True):
        return
    try:
        FINDER.note(apply, processor, config, prompt, kwargs, rendered)
    except Exception as exc:
        log.debug("segment note failed: %s", exc)
