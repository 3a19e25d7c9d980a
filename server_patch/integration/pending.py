"""Prompts between lookup and commit (a row's ``pending``, ``integration.rowlife``), keyed by
namespace *and* tokens.

Two requests with identical token ids may belong to different namespaces (tenants, or images
behind the same placeholder tokens): each must commit into its own. ``lookup`` and
``store_checkpoint`` receive the namespace (``extra_hash``); ``checkpoint_lengths`` does not
(mlx-vlm 0.7.10 passes only the token ids and the media token ids), so it plans the captures
of every pending prompt with those tokens and returns the union: a row stops at a length it
does not need only to find that its own pending prompt wants nothing there. The snapshots
themselves go only to the pending prompts of the namespace ``store_checkpoint`` names.

A prompt that skipped lookup (the single-sequence path's own prompt cache) has no namespace
until its first store names one; it takes the namespace whose state it is fed, so it never
holds another namespace's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from server_patch.lineage import RestorePlan

RequestKey = tuple[str, int, int]  # (namespace, prompt length, hash of the token bytes)


def prompt_key(tokens: np.ndarray) -> tuple[int, int]:
    return int(tokens.shape[0]), hash(tokens.tobytes())


def request_key(namespace: str, tokens: np.ndarray) -> RequestKey:
    """What names one request everywhere (pending prompts, loans, timing records)."""
    return (namespace, *prompt_key(tokens))


def namespace_of(extra_hash: Any) -> str:
    return str(int(extra_hash or 0))


@dataclass
class Pending:
    """A prompt between lookup and commit: its plan, captures asked for, captures taken.
    ``namespace`` is None until a store names it (a prompt that skipped lookup)."""

    tokens: np.ndarray
    namespace: Optional[str]
    plan: RestorePlan
    final: int = 0
    wanted: dict[int, str] = field(default_factory=dict)
    taken: dict[int, tuple[str, Any]] = field(default_factory=dict)
    anchor_label: str = ""
    last_start: int = 0  # where its last message starts (``Admission.last_start``), for the commit
    drift_points: tuple[int, ...] = ()  # ``Admission.drift_points``, for the commit

    @property
    def key(self) -> tuple[Optional[str], int, int]:
        return (self.namespace, *prompt_key(self.tokens))


__all__ = ["Pending", "RequestKey", "namespace_of", "prompt_key", "request_key"]
