"""Reply reuse under speculation, fast: the real coordinator and the kilobyte model's real caches,
driven in mlx-vlm's speculative event order (test_row_machine's harness).

A ``SpeculativeGenerationBatch`` verifies ``[bonus, drafts...]`` per round and its commit keeps
``accepted + 1`` of them; the overlay reports each commit (``speculative_round``) and the rows
that finish (``speculative_rows_leaving``). Here each round feeds the row's cache exactly what
the commit keeps, and reports the round. A rejected draft never reaches the entry; when the
bookkeeping is missing or does not match the cache, the reply is not stored and the entry stays
at the prompt end (fails closed); a draft kind whose rounds are not reported is never tracked.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.fake_model import prefill, random_tokens
from tests.integration.test_row_machine import admit, light_server, prefill_and_store, to_decoding
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")


class SpeculativeBatch:
    """What the hooks read of ``SpeculativeGenerationBatch``: the rows it began with, those
    still decoding, and its caches (rows in the order of its last round)."""

    is_speculative = True

    def __init__(self, uids: list[Any], prompt_cache: list[Any]) -> None:
        self._all_uids, self.uids, self.prompt_cache = list(uids), list(uids), prompt_cache
        self.max_tokens = [64] * len(uids)

    def __len__(self) -> int:
        return len(self.uids)


def speculating(model, layout, monkeypatch, kind: str = "mtp") -> SimpleNamespace:
    s = light_server(model, layout, monkeypatch)
    s.generator.draft_model, s.generator.draft_kind = object(), kind
    return s


def prompt_end(s, uid: int, prompt: np.ndarray) -> SpeculativeBatch:
    """Admission and prefill of a lone row; its prompt batch becomes a speculative batch."""
    caches, lengths = admit(s, uid, prompt)
    prefill_and_store(s, uid, prompt, caches, lengths)
    plain = to_decoding(s, uid)
    batch = SpeculativeBatch([uid], plain.prompt_cache)
    s.generator._generation_batch = batch
    return batch


def verify(s, batch: SpeculativeBatch, block: list[int], accepted: int, *, report: bool = True) -> list[int]:
    """One round of a lone row: the cache keeps ``block[:accepted + 1]`` (the commit), reported."""
    kept = block[: accepted + 1]
    prefill(s.model, batch.prompt_cache, np.array(kept, dtype=np.int32))
    if report:
        s.coordinator.speculative_round(batch, mx.array([block]), [accepted], [0])
    return kept


def finish(s, batch: SpeculativeBatch) -> None:
    s.coordinator.speculative_rows_leaving(batch, list(batch.uids))
    batch.uids = []
    s.generator._generation_batch = None


ROUNDS = ([11, 12, 13], 1), ([21, 22, 23], 0), ([31, 32, 33], 2), ([41, 42], 0)  # (block, accepted)


def test_the_entry_moves_past_the_verified_ids_and_never_holds_a_rejected_draft(model, layout, monkeypatch):
    s = speculating(model, layout, monkeypatch)
    prompt = random_tokens(40, seed=61)
    batch = prompt_end(s, 1, prompt)
    row = s.book.by_uid(1)
    assert row.reply is not None and row.deferral is not None  # tracked and deferred, as a plain lone row
    fed = [token for block, accepted in ROUNDS for token in verify(s, batch, block, accepted)]
    assert fed == [11, 12, 21, 31, 32, 33, 41] and row.reply.fed == fed
    finish(s, batch)
    (entry,) = s.cache.entries()
    assert entry.length == len(prompt) + len(fed) and entry.prompt_end == len(prompt) - 1
    assert entry.tokens[: entry.length].tolist() == prompt.tolist() + fed  # 13, 22, 23, 42 rejected
    assert row.record.reply_tokens == len(fed)


@pytest.mark.parametrize("fault", ["no round reported", "a round missed", "rows that do not match the cache"])
def test_bookkeeping_that_does_not_match_the_cache_keeps_the_prompt_end(model, layout, monkeypatch, fault: str):
    s = speculating(model, layout, monkeypatch)
    prompt = random_tokens(40, seed=62)
    batch = prompt_end(s, 1, prompt)
    for k, (block, accepted) in enumerate(ROUNDS):
        if fault == "rows that do not match the cache" and k == 1:
            kept = block[: accepted + 1]
            prefill(s.model, batch.prompt_cache, np.array(kept, dtype=np.int32))
            s.coordinator.speculative_round(batch, mx.array([block, block]), [accepted, accepted], [0, 0])
            continue
        missed = fault == "no round reported" or (fault == "a round missed" and k == 2)
        verify(s, batch, block, accepted, report=not missed)
    finish(s, batch)
    (entry,) = s.cache.entries()
    assert entry.length == len(prompt) - 1, fault  # the deferred prompt-end entry, nothing past it


def test_a_draft_kind_whose_rounds_are_not_reported_is_never_tracked_nor_adopted(model, layout, monkeypatch):
    s = speculating(model, layout, monkeypatch, kind="eagle3")
    prompt = random_tokens(40, seed=63)
    caches, lengths = admit(s, 1, prompt)
    prefill_and_store(s, 1, prompt, caches, lengths)
    row = s.book.by_uid(1)
    assert row.reply is None and row.deferral is None  # copied at the prompt end, no reply tracked
    (entry,) = s.cache.entries()
    assert entry.length == len(prompt) - 1
