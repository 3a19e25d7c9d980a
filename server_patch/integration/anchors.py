"""The anchor boundary: where the system prompt + tools end and the conversation begins.

The server renders the chat template on the leading system messages plus the tool list,
without the generation prompt: that text is the prefix every session of an agent shares. It is
tokenized once per distinct text and remembered; the generator later takes the common prefix
of a prompt with it, minus two tokens of slack for BPE merges at the boundary. No slack is
needed when the prefix ends next to an added (special) token, such as GLM's ``<|user|>``: the
tokenizer splits on those before BPE, so nothing can merge across them.

The same wrapper feeds ``segments``, which finds every template boundary the same way.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from server_patch.lineage.lookup import common_prefix_len
from server_patch.lineage.model import as_tokens

log = logging.getLogger("server_patch.lineage")

BPE_SLACK = 2
# How many trailing anchor tokens may differ and still count as "this prompt's anchor".
MATCH_TOLERANCE = 4
_MAX_TEXTS = 256


class AnchorRegistry:
    """Distinct system+tools prefixes seen, as token ids, with a short label each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: OrderedDict[str, tuple[np.ndarray, str, frozenset[int]]] = OrderedDict()

    def note(self, text: str, tokenize: Callable[[str], list[int]], label: str,
             hard_ids: frozenset[int] = frozenset()) -> None:
        """Remember one prefix; ``hard_ids`` are the tokenizer's added tokens (BPE never merges them)."""
        with self._lock:
            if text in self._texts:
                self._texts.move_to_end(text)
                return
        ids = as_tokens(tokenize(text))  # outside the lock: tokenizing may take a while
        with self._lock:
            self._texts[text] = (ids, label, frozenset(hard_ids))
            while len(self._texts) > _MAX_TEXTS:
                self._texts.popitem(last=False)

    def boundary(self, prompt: Any) -> tuple[int, str] | None:
        """(anchor length, label) for ``prompt``, or None when no known prefix starts it."""
        prompt = as_tokens(prompt)
        best: tuple[int, str] | None = None
        with self._lock:
            candidates = list(self._texts.values())
        for ids, label, hard in candidates:
            shared = common_prefix_len(prompt, ids)
            if shared < len(ids) - MATCH_TOLERANCE or shared - BPE_SLACK <= 0:
                continue
            length = shared - BPE_SLACK
            if shared == len(ids) and hard and (int(ids[-1]) in hard or (
                    prompt.shape[0] > shared and int(prompt[shared]) in hard)):
                length = shared  # the prefix ends at a special token: no merge to allow for
            if best is None or length > best[0]:
                best = (length, label)
        return best

    def __len__(self) -> int:
        return len(self._texts)


REGISTRY = AnchorRegistry()


def _leading_system(messages: list[Any]) -> list[dict]:
    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            out.append(message)
        else:
            break
    return out


def label(system: list[dict], tools: Any) -> str:
    """How an anchor is shown to operators: its system text, shortened, and its tool count."""
    text = " ".join(str(m.get("content", "")) for m in system).strip().replace("\n", " ")
    tool_note = f" [+{len(tools)} tools]" if tools else ""
    return (text[:77] + "...") if len(text) > 80 else (text + tool_note)


def _tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def note_request(apply: Callable[..., Any], processor: Any, config: Any, prompt: Any,
                 kwargs: dict[str, Any]) -> None:
    """Render and remember the system+tools prefix of one chat request (best effort)."""
    if not isinstance(prompt, list) or kwargs.get("return_messages"):
        return
    if not kwargs.get("add_generation_prompt", True):
        return
    system = _leading_system(prompt)
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
    tokenizer = _tokenizer_of(processor)
    from server_patch.integration.segments import FINDER

    REGISTRY.note(text, lambda t: tokenizer.encode(t, add_special_tokens=False), label(system, tools),
                  FINDER.hard_ids(tokenizer))


def wrap_apply_chat_template(apply: Callable[..., Any]) -> Callable[..., Any]:
    """mlx-vlm's ``apply_chat_template``, also noting each request's anchor prefix and segments."""

    @functools.wraps(apply)
    def wrapper(processor, config, prompt, *args, **kwargs):
        result = apply(processor, config, prompt, *args, **kwargs)
        if not args:
            note_request(apply, processor, config, prompt, kwargs)
            from server_patch.integration import segments

            segments.note_request(apply, processor, config, prompt, kwargs, result)
        return result

    return wrapper
