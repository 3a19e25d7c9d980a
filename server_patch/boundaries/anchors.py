"""The anchor: where the system prompt + tools end and the conversation begins.

The template is rendered on the leading system messages plus the tool list, without the
generation prompt: that text is the prefix every session of an agent shares. It is tokenized
once per distinct text and remembered; a prompt's anchor is its common prefix with one of them,
minus ``BPE_SLACK`` tokens for BPE merges at the boundary. No slack is needed when the prefix
ends next to an added (special) token, such as GLM's ``<|user|>``: the tokenizer splits on those
before BPE, so nothing can merge across them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from server_patch.boundaries.kinds import BPE_SLACK
from server_patch.boundaries.text import SYSTEM_ROLES
from server_patch.lineage.lookup import common_prefix_len
from server_patch.lineage.model import as_tokens

log = logging.getLogger("server_patch.lineage")

# How many trailing anchor tokens may differ and still count as "this prompt's anchor".
MATCH_TOLERANCE = 4
MAX_TEXTS = 256

Render = Callable[..., Any]  # mlx-vlm's apply_chat_template(processor, config, messages, **kwargs)


class AnchorMatch(NamedTuple):
    """A prompt's anchor: its length in tokens and the label operators see."""

    length: int
    label: str


@dataclass(frozen=True)
class _Prefix:
    ids: np.ndarray
    label: str
    hard_ids: frozenset[int]


class AnchorRegistry:
    """Distinct system+tools prefixes seen, as token ids, with a short label each. Thread-safe."""

    def __init__(self, max_texts: int = MAX_TEXTS) -> None:
        self.max_texts = max_texts
        self._lock = threading.Lock()
        self._texts: OrderedDict[str, _Prefix] = OrderedDict()

    def note(self, text: str, tokenize: Callable[[str], list[int]], label: str,
             hard_ids: frozenset[int] = frozenset()) -> None:
        """Remember one prefix; ``hard_ids`` are the tokenizer's added tokens (BPE never merges them)."""
        with self._lock:
            if text in self._texts:
                self._texts.move_to_end(text)
                return
        ids = as_tokens(tokenize(text))  # outside the lock: tokenizing may take a while
        with self._lock:
            self._texts[text] = _Prefix(ids, label, frozenset(hard_ids))
            while len(self._texts) > self.max_texts:
                self._texts.popitem(last=False)

    def boundary(self, prompt: Any) -> AnchorMatch | None:
        """The anchor of ``prompt``, or None when no known prefix starts it."""
        prompt = as_tokens(prompt)
        best: AnchorMatch | None = None
        with self._lock:
            candidates = list(self._texts.values())
        for prefix in candidates:
            ids, hard = prefix.ids, prefix.hard_ids
            shared = common_prefix_len(prompt, ids)
            if shared < len(ids) - MATCH_TOLERANCE or shared - BPE_SLACK <= 0:
                continue
            length = shared - BPE_SLACK
            if shared == len(ids) and hard and (int(ids[-1]) in hard or (
                    prompt.shape[0] > shared and int(prompt[shared]) in hard)):
                length = shared  # the prefix ends at a special token: no merge to allow for
            if best is None or length > best.length:
                best = AnchorMatch(length, prefix.label)
        return best

    def note_request(self, apply: Render, processor: Any, config: Any, prompt: Any,
                     kwargs: Mapping[str, Any], hard_ids: frozenset[int]) -> None:
        """Render and remember the system+tools prefix of one chat request (best effort)."""
        if not isinstance(prompt, list) or kwargs.get("return_messages"):
            return
        if not kwargs.get("add_generation_prompt", True):
            return
        system = leading_system_messages(prompt)
        tools = kwargs.get("tools")
        if not system and not tools:
            return
        prefix_kwargs = dict(kwargs, add_generation_prompt=False)
        prefix_kwargs.pop("num_images", None)
        try:
            text = apply(processor, config, system, **prefix_kwargs)
        except Exception as exc:  # a template that cannot render piecewise: no anchor
            log.debug("anchor prefix render failed: %s", exc)
            return
        if not isinstance(text, str) or not text:
            return
        tokenizer = getattr(processor, "tokenizer", processor)
        self.note(text, lambda t: tokenizer.encode(t, add_special_tokens=False), anchor_label(system, tools),
                  hard_ids)

    def __len__(self) -> int:
        return len(self._texts)


def leading_system_messages(messages: list[Any]) -> list[dict]:
    """The system/developer dicts at the start of a conversation."""
    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") in SYSTEM_ROLES:
            out.append(message)
        else:
            break
    return out


def anchor_label(system: list[dict], tools: Any) -> str:
    """How an anchor is shown to operators: its system text, shortened, and its tool count."""
    text = " ".join(str(m.get("content", "")) for m in system).strip().replace("\n", " ")
    tool_note = f" [+{len(tools)} tools]" if tools else ""
    return (text[:77] + "...") if len(text) > 80 else (text + tool_note)
