"""What the segment finder and the drift detector need from the chat template: a decoder, and
the generation prompt. The finder holds one (``SegmentFinder.template``), so it lives beside it;
it sat in ``drift`` until issue 35, which made ``boundaries`` and ``drift`` import each other.

The server renders each chat request with mlx-vlm's ``apply_chat_template``
(``integration.segments`` wraps it); ``TemplateFacts.note`` is told each one. It keeps the
tokenizer (to decode a short diff) and the token ids of each distinct generation prompt, found
once per template option set by rendering a one-message probe with and without it (two renders,
cached). A prompt that ends with one of them has its generation prompt start there: where a
retry that drops the reply parts from it, and where ``lineage.policy`` places a restore point.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping

import numpy as np

log = logging.getLogger("server_patch.lineage")

_PROBE = [{"role": "user", "content": "A"}]
_TEMPLATE_ONLY = ("add_generation_prompt", "num_images", "num_audios", "return_messages")
MAX_VARIANTS = 8  # generation prompts held (one per template option set: thinking on or off...)


class TemplateFacts:
    """The last tokenizer seen and the generation prompts of its template. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokenizer: Any = None
        self._variants: OrderedDict[str, np.ndarray | None] = OrderedDict()  # option set -> ids
        self._texts: dict[str, str] = {}  # option set -> the generation prompt's text

    def note(self, apply: Callable[..., Any], processor: Any, config: Any, kwargs: Mapping[str, Any]) -> None:
        """A chat request was rendered with ``kwargs``: learn its generation prompt (once)."""
        tokenizer = getattr(processor, "tokenizer", processor)
        options = {k: v for k, v in kwargs.items() if k not in _TEMPLATE_ONLY}
        key = _key(processor, options)
        with self._lock:
            if tokenizer is not self.tokenizer:
                self.tokenizer = tokenizer
                self._variants.clear()
                self._texts.clear()
            if key in self._variants:
                self._variants.move_to_end(key)
                return
            self._variants[key] = None  # one try per option set, even if it fails
            while len(self._variants) > MAX_VARIANTS:
                self._texts.pop(self._variants.popitem(last=False)[0], None)
        try:
            with_gen = apply(processor, config, _PROBE, add_generation_prompt=True, **options)
            without = apply(processor, config, _PROBE, add_generation_prompt=False, **options)
            if isinstance(with_gen, str) and isinstance(without, str) and with_gen.startswith(without) \
                    and len(with_gen) > len(without):
                text = with_gen[len(without):]
                ids = np.asarray(tokenizer.encode(text, add_special_tokens=False))
                with self._lock:
                    if key in self._variants:
                        self._variants[key], self._texts[key] = ids, text
        except Exception as exc:  # a hint only: no generation prompt known
            log.debug("generation prompt probe failed: %s", exc)

    def generation_text(self, processor: Any, kwargs: Mapping[str, Any]) -> str | None:
        """The generation prompt's text of ``processor``'s template with these options (None:
        not learnt): what a rendered request ends with after its last message."""
        options = {k: v for k, v in kwargs.items() if k not in _TEMPLATE_ONLY}
        with self._lock:
            return self._texts.get(_key(processor, options))

    def gen_start(self, prompt: np.ndarray) -> int | None:
        """Where ``prompt``'s generation prompt starts (the longest known one it ends with)."""
        with self._lock:
            variants = [ids for ids in self._variants.values() if ids is not None and len(ids)]
        n = int(prompt.shape[0])
        best = None
        for ids in variants:
            k = int(ids.shape[0])
            if k < n and np.array_equal(prompt[n - k:], ids) and (best is None or n - k < best):
                best = n - k
        return best

    def decoder(self) -> Callable[[np.ndarray], str] | None:
        tokenizer = self.tokenizer
        if tokenizer is None or not hasattr(tokenizer, "decode"):
            return None
        return lambda ids: tokenizer.decode([int(i) for i in ids])


def _key(processor: Any, options: Mapping[str, Any]) -> str:
    return f"{id(processor)}:{sorted(options.items(), key=lambda kv: kv[0])!r}"


__all__ = ["TemplateFacts"]
