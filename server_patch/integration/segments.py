"""The server's side of boundary finding: one finder, fed by mlx-vlm's ``apply_chat_template``.

A recurrent state cannot be rewound, so a prompt that diverges from everything stored can only
restore at a checkpoint at or before the divergence. Agent prompts diverge at the chat
template's seams (after the tools block, a system message, at a message start); the pure
package ``server_patch.boundaries`` finds them, and the coordinator asks the policy to capture a
checkpoint at each one in the prompt's uncached region (docs/segments.md).

This module owns the instances: the finder (and its anchor registry), built from
``APC_SEGMENTS_*`` when the overlay wraps ``apply_chat_template`` at server start (so a bad
value stops the start), and the two entry points: the wrapper, which notes each rendered chat
request, and ``boundaries``, which the coordinator calls when prefill is planned.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Mapping

from server_patch.boundaries import SegmentFinder, SegmentInfo, SegmentSettings

log = logging.getLogger("server_patch.lineage")

# The server's finder; None until first used. Tests swap in their own.
FINDER: SegmentFinder | None = None
_BUILDING = threading.Lock()


def finder() -> SegmentFinder:
    """The server's finder, built from the environment on first use."""
    global FINDER
    current = FINDER
    if current is not None:
        return current
    with _BUILDING:
        if FINDER is None:
            FINDER = SegmentFinder(SegmentSettings.from_env())
        return FINDER


def wrap_apply_chat_template(apply: Callable[..., Any]) -> Callable[..., Any]:
    """mlx-vlm's ``apply_chat_template``, also noting each request's anchor prefix and segments."""
    finder()  # settings are read (and checked) when the server wraps the template, not mid-request

    @functools.wraps(apply)
    def wrapper(processor, config, prompt, *args, **kwargs):
        result = apply(processor, config, prompt, *args, **kwargs)
        if not args:
            note_request(apply, processor, config, prompt, kwargs, result)
        return result

    return wrapper


def note_request(apply: Callable[..., Any], processor: Any, config: Any, prompt: Any,
                 kwargs: Mapping[str, Any], rendered: Any) -> None:
    """Note one rendered chat request: its system+tools prefix, then its segments (best effort)."""
    found = finder()
    tokenizer = getattr(processor, "tokenizer", processor)
    found.registry.note_request(apply, processor, config, prompt, kwargs, found.hard_ids(tokenizer))
    if not kwargs.get("add_generation_prompt", True):
        return
    try:
        found.note(apply, processor, config, prompt, kwargs, rendered)
    except Exception as exc:
        log.debug("segment note failed: %s", exc)


def boundaries(prompt_token_ids: Any) -> SegmentInfo:
    """The coordinator's entry point: anchor and segment boundaries of one prompt."""
    found = finder()
    try:
        return found.boundaries(prompt_token_ids)
    except Exception as exc:  # never break prefill over a hint
        log.warning("apc_lineage segment boundaries failed: %s", exc)
        return found.anchor_only(prompt_token_ids, [])
