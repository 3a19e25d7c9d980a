"""Families whose own cold prefill depends on where a prompt is split, served as they are.

A lineage restore at L equals a cold prefill split at L: the restored state is the state after
a forward call that ended at L. For almost every family that is also the unsplit prefill, up
to float rounding. deepseek_v4 is the exception: its ratio-4 compressed layers restart their
overlap window at every forward call, so mlx-vlm's own chunked cold prefill already depends
on where the prompt is split (``apcctl bench splits`` measures how much). The lineage cache
serves it anyway, with the lineage on; the server says so once at start, and the canary
allows this family's measured split dependence (``server_patch.canary.compare.SPLIT_RTOL``).

No mlx or mlx-vlm import: ``server_patch.launch`` reads the model's ``config.json`` before
the overlay is installed.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

#: family (mlx-vlm model package) -> why its cold prefill depends on the split.
SPLIT_DEPENDENT: dict[str, str] = {
    "deepseek_v4": (
        "its ratio-4 compressed attention layers restart their overlap window at every forward "
        "call, so mlx-vlm's own chunked cold prefill depends on where a prompt is split"),
}

# The families warned about: the process's log says it once per family, whichever runtime
# loads it again (a model switch), on purpose; no runtime's state.
_WARNED: set[str] = set()
_LOCK = threading.Lock()


def family_of(model: Any) -> str:
    """The mlx-vlm model package a (language) model class comes from (``mlx_vlm.models.<family>``)."""
    parts = type(model).__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["mlx_vlm", "models"] else ""


def model_type_of(model_dir: str | Path | None) -> str:
    """``model_type`` of a local model directory's ``config.json`` ("" when unreadable)."""
    if model_dir is None:
        return ""
    try:
        config = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def warning(family: str) -> str | None:
    """The start-up warning for ``family``, or None for a split-invariant one."""
    reason = SPLIT_DEPENDENT.get(family)
    if reason is None:
        return None
    return (f"{family} is served with the lineage cache on, as it is: {reason} (up to a few tenths "
            "of a logit). A lineage restore equals a cold prefill split at the restore point, "
            "not an unsplit one; the canary allows this family's measured split dependence "
            "(docs/models.md). APC_LINEAGE=0 serves it with stock mlx-vlm's cache")


def warn_once(family: str, emit: Callable[[str], None]) -> bool:
    """``emit`` the warning the first time this process sees ``family``; True if it did."""
    text = warning(family)
    with _LOCK:
        if text is None or family in _WARNED:
            return False
        _WARNED.add(family)
    emit(text)
    return True


__all__ = ["SPLIT_DEPENDENT", "family_of", "model_type_of", "warn_once", "warning"]
