"""The segment finder: notes rendered chat requests, then finds their boundaries in token ids.

How (the anchor's technique, generalised):

* ``note`` runs where the server renders a chat request. It renders the template on message
  prefixes (no generation prompt): ``[]`` with the tools (the tools block / preamble), then
  ``messages[:i]`` for every ``i``. A render that is a text prefix of the full prompt gives a
  boundary at its end; one that is not (a template that renders the last message differently)
  gives one at the longest common prefix, which is still a point where prompts sharing it
  diverge (``Kind.PARTING``), and a label (``Kind.REJOIN``) where its tail rejoins the prompt's
  text: that message's real end, so the drift finder numbers and names every message (Qwen3
  draws the last assistant turn with empty ``<think>`` tags). When the preamble cannot be rendered alone (transformers refuses an empty
  conversation), the first message's start and its content's start are found from the
  difference of two renders of it with another role, and with another content. Optionally
  (``tool_boundaries``) the end of each tool inside the tools block, where renders with
  ``tools[:j]`` (and with one more tool) leave it. A tools block the template renders inside
  the first message (Qwen3: after the system text) is labelled where it starts and ends, from
  the first message's render with and without the tools (``Kind.BEFORE_TOOLS``/``TOOLS_END``).
  Labels (``kinds.LABELS``) are kept only where an added token touches them (a seam there
  changes no piece's tokens) and never become restore points: the policy's captures are as
  without them.
* The rendered text is split at the boundaries and each piece is tokenized on its own. Renders
  are cached by a hash chain over the messages (a conversation's next turn renders only its new
  messages), pieces by their text, so a request costs O(messages) hashing, its new renders and
  the tokenization of its new text.
* ``boundaries(prompt_token_ids)`` runs when prefill is planned. It walks the noted pieces along
  the prompt's tokens (``walk``) and returns the token positions. No note matches: every
  multiple of the fallback stride, the restore points stock 0.7.10 would have.

A boundary is only ever a *suggestion* of where to capture: restore points are matched token
by token, so a wrong or stale boundary costs a useless checkpoint, never a wrong answer.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Mapping

import numpy as np

from server_patch.boundaries import system_points
from server_patch.boundaries.anchors import AnchorMatch, AnchorRegistry, anchor_label
from server_patch.boundaries.candidates import Candidates, paragraph_breaks, verify
from server_patch.boundaries.kinds import LABELS, Kind, outranks
from server_patch.boundaries.notes import (
    Labels, Note, Point, RecentKeys, RenderBudget, RenderCache, Request, SegmentInfo, ToolCuts, Walk,
)
from server_patch.boundaries.settings import SegmentSettings
from server_patch.boundaries.template import TemplateFacts
from server_patch.boundaries.text import (
    SYSTEM_ROLES, AddedTokens, canonical, chain_digest, common_suffix, encoder, leading_system_count, role_of,
    text_digest,
)
from server_patch.boundaries.walk import walk
from server_patch.lineage.model import as_tokens

log = logging.getLogger("server_patch.lineage")

Render = Callable[..., Any]  # mlx-vlm's apply_chat_template(processor, config, messages, **kwargs)

_PROBES = ("A", "B")  # two contents that differ in their first character
_EXTRA_TOOL = {"type": "function", "function": {"name": "zz_segment_probe", "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}
_TEMPLATE_ONLY = ("add_generation_prompt", "num_images", "num_audios", "return_messages")
_UNLIMITED_RENDERS = 1 << 30


class SegmentFinder:
    """Notes rendered chat requests and finds their segment boundaries in token ids. Thread-safe.

    ``registry``: the anchors noted from system+tools prefix renders, the anchor of a prompt
    no note covers.
    """

    def __init__(self, settings: SegmentSettings | None = None, registry: AnchorRegistry | None = None) -> None:
        self.settings = settings or SegmentSettings()
        self.registry = registry if registry is not None else AnchorRegistry()
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._renders = RenderCache(self.settings.render_cache_entries, self.stats)
        self._sent = RecentKeys(self.settings.render_cache_entries)  # chains sent as a whole prompt
        self._pieces: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._piece_tokens = 0
        self._notes: OrderedDict[int, Note] = OrderedDict()
        self._added: dict[int, AddedTokens] = {}
        self.template = TemplateFacts()  # the tokenizer and generation prompts (``boundaries.template``)

    # ------------------------------------------------------------------ noting a request

    def note(self, apply: Render, processor: Any, config: Any, messages: Any,
             kwargs: Mapping[str, Any], rendered: Any) -> Note | None:
        """Render ``messages``' prefixes, find the boundaries inside ``rendered``, remember them."""
        if not self.settings.enabled or not isinstance(messages, list) or not messages:
            return None
        if not isinstance(rendered, str) or not rendered or kwargs.get("return_messages"):
            return None
        tokenizer = getattr(processor, "tokenizer", processor)
        if not hasattr(tokenizer, "encode"):
            return None
        prefix_kwargs = {k: v for k, v in kwargs.items() if k not in _TEMPLATE_ONLY}
        model_type = config if isinstance(config, dict) else getattr(config, "model_type", "")
        base = chain_digest(b"segments/1", str(id(processor)), canonical(model_type),
                            canonical(sorted(prefix_kwargs.items(), key=lambda kv: kv[0])))

        def render(msgs: list[Any], **extra: Any) -> str:
            text = apply(processor, config, msgs, add_generation_prompt=False, **{**prefix_kwargs, **extra})
            if not isinstance(text, str):
                raise TypeError(f"template render returned {type(text).__name__}")
            return text

        added = self.added_tokens(tokenizer)
        request = Request(render, added.parting, rendered, base,
                          RenderBudget(self.settings.max_new_renders or _UNLIMITED_RENDERS),
                          whole_point(rendered, self.template.generation_text(processor, prefix_kwargs)),
                          added.touches, added.texts)
        candidates, anchor_offsets, labels = self._candidates(request, messages, prefix_kwargs)
        offsets = verify(candidates.items, rendered)
        if offsets is None:
            self.stats["not_piecewise"] += 1
            offsets = {}
        anchor_offsets = [o for o in anchor_offsets if o in offsets]
        if offsets and self.settings.system_paragraphs:
            anchor_offsets = paragraph_breaks(messages, rendered, offsets, anchor_offsets,
                                              self.settings.system_paragraphs)
            if self.settings.system_points:
                anchor_offsets = system_points.add_points(messages, rendered, offsets,
                                                          self.settings.system_paragraphs, anchor_offsets)
        if offsets:  # labels last: a restore point found at the same offset keeps its kind
            for offset, kind in (verify(labels.items, rendered) or {}).items():
                offsets.setdefault(offset, kind)
        return self._store(tokenizer, rendered, offsets, anchor_offsets, messages, prefix_kwargs)

    def _candidates(self, request: Request, messages: list[Any],
                    kwargs: Mapping[str, Any]) -> tuple[Candidates, list[int], Candidates]:
        """Candidate boundaries (to verify against the full text), the anchor's candidate
        offsets, and candidate labels (each a witness of its own: verified apart)."""
        out, labels = Candidates(), Candidates()
        render = request.render
        # The preamble (GLM: the tools block): the template with the tools and no message. Many
        # tokenizers refuse an empty conversation; then the first message's start is where two
        # renders of it with different roles part, and where its content starts, where two
        # renders with different contents part.
        preamble = self._cached(request, chain_digest(request.base, b"preamble"),
                                lambda: self._point(request, lambda: render([])))
        out.add_point(preamble, Kind.TOOLS)
        preamble_ok = preamble is not None and preamble.is_prefix
        first = messages[0]
        role_probe: Point | None = None
        if not preamble_ok and isinstance(first, dict) and isinstance(first.get("content"), str):
            role = role_of(first)
            other = "user" if role in SYSTEM_ROLES else "system"
            role_probe = self._cached(request, chain_digest(request.base, b"probe-role", role),
                                      lambda: self._probe(request, [dict(first, role=other), first]))
            out.add_point(role_probe, Kind.TOOLS)
            out.add_point(self._cached(request, chain_digest(request.base, b"probe-content", role),
                                       lambda: self._probe(request, [dict(first, content=c) for c in _PROBES])),
                          Kind.CONTENT)

        points, sent = self._prefix_points(request, messages)
        for i in sorted(points):
            kind = Kind.SYSTEM if role_of(messages[i - 1]) in SYSTEM_ROLES else Kind.MESSAGE
            point = points[i]
            out.add_point(point, kind, witness=i < len(messages), cut_kind=Kind.PARTING)
            if point is not None and point.rejoin > 0:
                labels.add(point.rejoin, Kind.REJOIN, point.rejoin_digest, witness=True)
        for point in sent:  # verified like the others, never a witness
            out.add(point.length, Kind.SENT, point.digest)

        tools = kwargs.get("tools")
        if isinstance(tools, list) and tools and not preamble_ok and isinstance(first, dict):
            found = self._cached(request, chain_digest(request.base, b"tools-block", canonical(first)),
                                 lambda: self._tools_block(request, first))
            for offset, kind, digest in (found.points if isinstance(found, Labels) else ()):
                labels.add(offset, kind, digest, witness=True)
        if self.settings.tool_boundaries and isinstance(tools, list) and len(tools) > 1:
            context: list[Any] = [] if preamble_ok else messages[:1]
            key = chain_digest(request.base, b"tools", canonical(context))
            found = self._cached(request, key, lambda: self._tool_cuts(request, context, tools))
            for cut, digest in (found.cuts if isinstance(found, ToolCuts) else ()):
                out.add(cut, Kind.TOOL, digest)

        n_system = leading_system_count(messages)
        anchor: list[int] = []
        if n_system:
            anchor = [points[i].length for i in range(1, n_system + 1) if points.get(i) is not None]
        elif tools and preamble_ok:
            anchor = [preamble.length]
        elif tools and role_probe is not None:
            anchor = [role_probe.length]
        return out, anchor, labels

    def _prefix_points(self, request: Request, messages: list[Any]) -> tuple[dict[int, Point | None], list[Point]]:
        """Renders of ``messages[:i]``, by ``i``; and the ends of the skipped conversations
        earlier requests sent whole, where known (``Kind.SENT``).

        Every message prefix but two kinds whose end is a few tokens from a restore point, where
        the policy never captures: the whole conversation (the generation prompt follows), and
        a conversation an earlier request sent whole (its entry sits there). Newest first: older
        ones are cached from earlier turns, so a turn renders one new prefix, its question's
        start. The anchor's (the end of the leading system messages) is never skipped. A skipped
        one's end is still a message's end (the drift finder numbers messages by them): the
        earlier request's text less its generation prompt (``Request.whole``) gives it, no render.
        """
        chain, keys = request.base, []
        for message in messages:
            chain = chain_digest(chain, canonical(message))
            keys.append(chain)
        sent = self._sent.seen_then_add(keys, keys[-1], request.whole)
        order = [i for i in range(len(messages) - 1, 0, -1) if i not in sent]
        n_system = leading_system_count(messages)
        if n_system:
            if n_system in order:
                order.remove(n_system)
            order.insert(0, n_system)
        def make(prefix: list[Any]) -> Callable[[], Point]:
            return lambda: self._point(request, lambda: request.render(prefix))

        points: dict[int, Point | None] = {}
        for i in order:
            points[i] = self._cached(request, keys[i - 1], make(messages[:i]))
        ends = [end for i, end in sorted(sent.items()) if end is not None and i not in points]
        return points, ends

    def _cached(self, request: Request, key: bytes, make: Callable[[], Any]) -> Any:
        return self._renders.get(key, make, request.budget,
                                 lambda exc: log.debug("segment render failed: %s", exc))

    def _point(self, request: Request, render: Callable[[], str]) -> Point:
        """One prefix render, where it leaves the prompt's text, and where its last message
        really ends there when it leaves it inside that message."""
        self.stats["renders"] += 1
        text = render()
        cut = request.parting(text, request.full)
        end = rejoin(text, cut, request.full, request.added) if cut < len(text) else -1
        return Point(len(text), text_digest(text), cut, text_digest(text[:cut]),
                     end, text_digest(request.full[:end]) if end > 0 else b"")

    def _tools_block(self, request: Request, first: Any) -> Labels:
        """Where a tools block rendered inside the first message starts and ends: where its
        render with and without the tools part, and where they agree again to their ends."""
        with_tools, without = request.render([first]), request.render([first], tools=None)
        self.stats["renders"] += 2
        start = request.parting(with_tools, without)
        end = len(with_tools) - common_suffix(with_tools[start:], without[start:])
        # the shared tail may begin inside the block's last token: its end is the next added token
        while end < len(with_tools) and not request.exact(with_tools, end):
            end += 1
        found = [(o, k) for o, k in ((start, Kind.BEFORE_TOOLS), (end, Kind.TOOLS_END))
                 if 0 < o < len(with_tools) and start < end and request.exact(with_tools, o)]
        return Labels(tuple((o, k, text_digest(with_tools[:o])) for o, k in found))

    def _probe(self, request: Request, variants: list[Any]) -> Point:
        """Where two one-message renders part (a point whose length is where they part)."""
        a, b = (request.render([m]) for m in variants)
        self.stats["renders"] += 2
        cut = request.parting(a, b)
        digest = text_digest(a[:cut])
        return Point(cut, digest, cut, digest)

    def _tool_cuts(self, request: Request, context: list[Any], tools: list[Any]) -> ToolCuts:
        """The end of each tool: where the render with ``tools[:j]`` (j = 1 .. all, and all plus
        one more, for the last tool's end before the block's closing text) leaves the full one."""
        reference = request.render(context)
        self.stats["renders"] += len(tools) + 1
        usable = request.parting(reference, request.full)
        variants = [tools[:j] for j in range(1, len(tools))] + [list(tools) + [_EXTRA_TOOL]]
        cuts = {request.parting(request.render(context, tools=v), reference) for v in variants}
        return ToolCuts(tuple((c, text_digest(reference[:c])) for c in sorted(cuts) if 0 < c <= usable))

    def _store(self, tokenizer: Any, full: str, offsets: dict[int, str], anchor_offsets: list[int],
               messages: list[Any], kwargs: Mapping[str, Any]) -> Note:
        cuts = sorted(offsets)
        bounds = [0, *cuts, len(full)]
        encode = encoder(tokenizer)
        pieces = [self._piece(full[a:b], encode) for a, b in zip(bounds, bounds[1:])]
        n_system = leading_system_count(messages)
        system = [m for m in messages[:n_system] if isinstance(m, dict)]
        tools = kwargs.get("tools")
        label = anchor_label(system, tools) if (system or tools) else ""
        note = Note(pieces, [offsets[c] for c in cuts], tuple(cuts.index(o) for o in anchor_offsets),
                    label, self.hard_ids(tokenizer))
        note.key = hash(np.concatenate(pieces).tobytes())
        with self._lock:
            self._notes.pop(note.key, None)
            self._notes[note.key] = note
            while len(self._notes) > self.settings.max_notes:
                self._notes.popitem(last=False)
            self.stats["notes"] += 1
        return note

    def hard_ids(self, tokenizer: Any) -> frozenset[int]:
        """The tokenizer's added-token ids, computed once per tokenizer."""
        return self.added_tokens(tokenizer).ids

    def added_tokens(self, tokenizer: Any) -> AddedTokens:
        key = id(tokenizer)
        with self._lock:
            found = self._added.get(key)
        if found is None:
            found = AddedTokens.of(tokenizer)
            with self._lock:
                self._added[key] = found
        return found

    def _piece(self, text: str, encode: Callable[[str], list[int]]) -> np.ndarray:
        """Token ids of one piece of rendered text, cached by the text's digest."""
        key = text_digest(text)
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
            return self.anchor_only(prompt, [])
        key = hash(prompt.tobytes())
        with self._lock:
            exact = self._notes.get(key)
            recent = list(reversed(self._notes.values()))[: self.settings.walk_candidates]
        best: Walk | None = None
        for note in ([exact] if exact is not None else []) + [r for r in recent if r is not exact]:
            found = walk(prompt, note, self.stats)
            if found is not None and (best is None or found.covered > best.covered):
                best = found
            if best is not None and best.covered >= n:
                break
        if best is None or not best.positions:
            self.stats["fallback"] += 1
            return self.anchor_only(prompt, self._stride(n, 0), Kind.STRIDE)
        self.stats["matched_exact" if best.note is exact else "matched_walk"] += 1
        kinds: dict[int, str] = {}
        for p, k in best.positions:
            if 0 < p < n and (p not in kinds or outranks(k, kinds[p])):
                kinds[p] = k
        labels = {p: k for p, k in kinds.items() if k in LABELS}
        kinds = system_points.thin({p: k for p, k in kinds.items() if k not in LABELS},
                                   self.settings.system_paragraphs)
        if best.covered < n - 1:  # the rest of the prompt is unknown to the template: stride
            for p in self._stride(n, best.covered):
                kinds.setdefault(p, Kind.STRIDE)
        anchor = self._anchor(best, n)
        match = AnchorMatch(anchor, best.note.label) if anchor is not None else self.registry.boundary(prompt)
        return SegmentInfo(match.length if match else None, match.label if match else "", sorted(kinds),
                           "template", {**labels, **kinds})

    def _anchor(self, found: Walk, n: int) -> int | None:
        """The end of the leading system messages, less a trailing part shorter than the anchor tail.

        A short trailing system message or paragraph (the time, a session id; mlx-vlm joins
        system messages into one with "\n\n") would make every request's anchor a new one and
        leave the system text before it without a restore point: the policy skips a segment
        that close to the anchor. So the anchor ends before it.
        """
        if len(found.anchors) != len(found.note.anchor_seams) or not found.anchors:
            return None  # the walk stopped inside the system prefix
        ends = found.anchors
        last = ends[-1]
        chosen = next(e for e in ends if last - e < max(1, self.settings.anchor_tail_tokens))
        return chosen if 0 < chosen <= n else None

    def anchor_only(self, prompt: Any, segments: list[int], kind: str = Kind.STRIDE) -> SegmentInfo:
        """The registered anchor of ``prompt`` with ``segments`` (all of ``kind``)."""
        match = self.registry.boundary(prompt)
        return SegmentInfo(match.length if match else None, match.label if match else "", segments,
                           "fallback" if segments else "none", {p: kind for p in segments})

    def _stride(self, n: int, after: int) -> list[int]:
        stride = self.settings.fallback_stride
        if stride <= 0:
            return []
        first = (after // stride + 1) * stride
        return list(range(first, n, stride))

    def __len__(self) -> int:
        return len(self._notes)


def rejoin(text: str, cut: int, full: str, added: tuple[str, ...]) -> int:
    """Where ``text`` (a render of messages up to its last), which parts from the prompt's
    ``full`` text at ``cut``, has that last message end in ``full`` (-1: not found).

    The render's tail rejoins the prompt where everything ``full`` has from the cut on is the
    render's own ending: Qwen3 puts ``<think>`` tags (and the reasoning, which earlier turns
    drop) before the last assistant's content, then the content and ``<|im_end|>`` as the prompt
    has them. The end must be where an added token starts (the next message's header); the
    latest such one within the render's tail's length wins (the most of the message matched)."""
    longest = max((len(t) for t in added), default=0)
    window = full[cut:len(text) + longest]
    ends = sorted({cut + i for t in added for i in _occurrences(window, t) if 0 < i <= len(text) - cut})
    for end in reversed(ends):
        if text.endswith(full[cut:end]):
            return end
    return -1


def _occurrences(text: str, needle: str) -> list[int]:
    found, at = [], text.find(needle)
    while at >= 0:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


def whole_point(rendered: str, generation: str | None) -> Point | None:
    """Where all of a request's messages end in its ``rendered`` text: before the generation
    prompt it ends with (None: not known, or not at the end)."""
    if not generation or not rendered.endswith(generation) or len(rendered) <= len(generation):
        return None
    length = len(rendered) - len(generation)
    digest = text_digest(rendered[:length])
    return Point(length, digest, length, digest)
