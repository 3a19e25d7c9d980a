"""Prompts between lookup and commit (a row's ``pending``, ``integration.session``), keyed by
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
from typing import TYPE_CHECKING, Optional

import numpy as np

from server_patch.lineage import RestorePlan
from server_patch.lineage.flow import Admission
from server_patch.state.layout import MlxSnapshot

if TYPE_CHECKING:
    from server_patch.lineage.policy import LineageCache

RequestKey = tuple[str, int, int]  # (namespace, prompt length, hash of the token bytes)
PromptKey = tuple[Optional[str], int, int]  # a ``Pending``'s key: no namespace until a store names it


def prompt_key(tokens: np.ndarray) -> tuple[int, int]:
    return int(tokens.shape[0]), hash(tokens.tobytes())


def request_key(namespace: str, tokens: np.ndarray) -> RequestKey:
    """What names one request everywhere (pending prompts, loans, timing records)."""
    return (namespace, *prompt_key(tokens))


def namespace_of(extra_hash: Optional[int]) -> str:
    return str(int(extra_hash or 0))


@dataclass
class Pending:
    """A prompt between lookup and commit: its plan, captures asked for, captures taken, and
    its one ``admission`` (the request flow: built once, by its lookup, or at its first use
    where it had none; its captures, prompt-end and reply commits all go through it).
    ``namespace`` is None until a store names it (a prompt that skipped lookup)."""

    tokens: np.ndarray
    namespace: Optional[str]
    plan: RestorePlan
    final: int = 0
    wanted: dict[int, str] = field(default_factory=dict)
    taken: dict[int, tuple[str, MlxSnapshot]] = field(default_factory=dict)  # length -> (kind, state)
    anchor_label: str = ""
    admission: Optional[Admission] = None  # the request flow (``flow``), kept from the lookup on

    @property
    def key(self) -> PromptKey:
        return (self.namespace, *prompt_key(self.tokens))

    def flow(self, cache: LineageCache) -> Admission:
        """Its one admission: the lookup's, or (a prompt planned without a lookup) one built
        here, once, at its plan in ``cache``."""
        if self.admission is None:
            self.admission = Admission(cache, self.tokens, self.namespace or "", self.plan)
        return self.admission

    def named(self, namespace: str) -> None:
        """A prompt that skipped lookup is named by its first store (its admission too)."""
        self.namespace = namespace
        if self.admission is not None:
            self.admission.namespace = namespace


__all__ = ["Pending", "PromptKey", "RequestKey", "namespace_of", "prompt_key", "request_key"]
