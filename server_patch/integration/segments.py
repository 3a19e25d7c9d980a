"""The server's side of boundary finding: one finder, fed by mlx-vlm's ``apply_chat_template``.

A recurrent state cannot be rewound, so a prompt that diverges from everything stored can only
restore at a checkpoint at or before the divergence. Agent prompts diverge at the chat
template's seams (after the tools block, a system message, at a message start); the pure
package ``server_patch.boundaries`` finds them, and the coordinator asks the policy to capture a
checkpoint at each one in the prompt's uncached region (docs/segments.md).

The finder (and its anchor registry) is one of the server's parts (``integration.parts``),
built from ``APC_SEGMENTS_*`` with mlx-vlm's server runtime (so a bad value stops the start).
This module holds no instance, only the two entry points, each handed the finder: the wrapper,
which notes each rendered chat request, and ``boundaries``, which prefill planning calls.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping

from server_patch.boundaries import SegmentFinder, SegmentInfo

log = logging.getLogger("server_patch.lineage")


def wrap_apply_chat_template(apply: Callable[..., Any], finder: SegmentFinder) -> Callable[..., Any]:
    """mlx-vlm's ``apply_chat_template``, also noting each request's anchor prefix and segments
    in ``finder`` (the server's: its settings were read and checked when it was built)."""

    @functools.wraps(apply)
    def wrapper(processor: object, config: object, prompt: object, *args: object, **kwargs: object) -> object:
        result = apply(processor, config, prompt, *args, **kwargs)
        if not args:
            note_request(finder, apply, processor, config, prompt, kwargs, result)
        return result

    return wrapper


def note_request(found: SegmentFinder, apply: Callable[..., Any], processor: Any, config: Any, prompt: Any,
                 kwargs: Mapping[str, Any], rendered: Any) -> None:
    """Note one rendered chat request: its system+tools prefix, then its segments (best effort)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    found.registry.note_request(apply, processor, config, prompt, kwargs, found.hard_ids(tokenizer))
    found.template.note(apply, processor, config, kwargs)
    if not kwargs.get("add_generation_prompt", True):
        return
    try:
        found.note(apply, processor, config, prompt, kwargs, rendered)
    except Exception as exc:
        log.debug("segment note failed: %s", exc)


def boundaries(prompt_token_ids: Any, finder: SegmentFinder) -> SegmentInfo:
    """The coordinator's entry point (``LineageRuntime.boundaries``): anchor and segment
    boundaries of one prompt, by the runtime's ``finder``; never raises."""
    try:
        return finder.boundaries(prompt_token_ids)
    except Exception as exc:  # never break prefill over a hint
        log.warning("apc_lineage segment boundaries failed: %s", exc)
        return finder.anchor_only(prompt_token_ids, [])
