"""The drafter's context on a warm turn equals a cold prefill's, in process (issue 39).

mlx-vlm 0.7.10 builds a speculative batch from the prompt batch's last forward: the chunked
prefill (``PromptProcessingBatch.prompt_step``) stops while one prompt token is left, cold or
warm, and ``generate`` runs that token and hands the drafter ``prompt_tokens`` = that one token
and the target's hidden state there (``SpeculativePrefill`` accumulates chunks only for dflash and
eagle3). The MTP drafter (``glm5_next_mtp``) is reset per batch, prefilled from those alone at its
own position 0, and ignores the target's shared KV (``set_shared_kv``). So what it holds after a
restore that skipped most of the prompt is what it holds after a cold prefill, as long as the
target's hidden state at the last prompt token is (the restore's own promise).

Measured here, not assumed: the tiny model with its built drafter, one prompt prefilled cold and
restored warm (its first 70 tokens in a cache of their own, the rest prefilled on top: what an
entry restore hands ``PromptProcessingBatch`` as ``warm_cache``). The drafter's inputs and its
whole state after its prefill (KV, index and pooling caches, seed token, seed hidden, position)
are compared within float tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

PREFIX, PROMPT = 70, 96


@pytest.fixture(scope="module")
def pair(spec_model_dir: Path, spec_drafter_dir: Path) -> tuple[Any, Any]:
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters import load_drafter

    model, _ = load(str(spec_model_dir))
    drafter, kind = load_drafter(str(spec_drafter_dir), kind="mtp")
    assert kind == "mtp"
    return model, drafter  # the server's batches run model.language_model on model's embeddings


def _prompt_batch(model: Any, drafter: Any, ids: list[int], warm_cache: Any = None) -> Any:
    from mlx_vlm.generate.ar import PromptProcessingBatch

    embeds = model.get_input_embeddings(mx.array([ids])).inputs_embeds
    return PromptProcessingBatch(model=model.language_model, uids=[0], input_ids=[ids], max_tokens=[8], inputs_embeds=embeds,
                                 prompt_kwargs={}, warm_cache=warm_cache, draft_model=drafter,
                                 draft_kind="mtp", greedy_sampling=True)


def _generation(model: Any, drafter: Any, ids: list[int], warm_cache: Any = None) -> Any:
    """mlx-vlm's own prefill: chunks while more than one token is left, then ``generate``."""
    from mlx_vlm.sample_utils import make_sampler

    batch = _prompt_batch(model, drafter, ids, warm_cache)
    while batch.needs_processing():
        batch.prompt_step()
    return batch.generate(make_sampler(temp=0.0), lambda token: False, compute_logprobs=False)


def _drafter_after_prefill(model: Any, drafter: Any, monkeypatch: pytest.MonkeyPatch, ids: list[int],
                           warm_cache: Any = None) -> dict[str, Any]:
    """What the drafter was handed and what it holds right after its prefill."""
    seen: dict[str, Any] = {}
    prefill = type(drafter).prefill_from_target_hidden

    def recorded(self: Any, input_ids: mx.array, hidden: mx.array, bonus: Any, *args: Any, **kwargs: Any) -> None:
        prefill(self, input_ids, hidden, bonus, *args, **kwargs)
        seen["input_ids"] = np.array(input_ids)
        seen["hidden"] = np.array(hidden.astype(mx.float32))
        seen["bonus"] = np.array(bonus)
        seen["seed_token"] = np.array(self._seed_token)
        seen["seed_hidden"] = np.array(self._seed_hidden.astype(mx.float32))
        seen["position"] = np.array(self._next_position)
        seen["caches"] = [np.array(a.astype(mx.float32)) for c in self._cache for child in c.caches
                          for a in (child.state if isinstance(child.state, (list, tuple)) else [child.state])
                          if isinstance(a, mx.array)]

    monkeypatch.setattr(type(drafter), "prefill_from_target_hidden", recorded)
    batch = _generation(model, drafter, ids, warm_cache)
    batch.next()  # the first token (sampled by the prompt batch)
    batch.next()  # the first round: the drafter is reset and prefilled, then drafts
    monkeypatch.undo()
    assert seen, "the drafter was never prefilled"
    return seen


def test_the_mtp_drafter_holds_the_same_after_a_warm_restore_as_after_a_cold_prefill(pair, monkeypatch) -> None:
    model, drafter = pair
    ids = [int(t) for t in np.random.RandomState(5).randint(20, 1500, PROMPT)]
    cold = _drafter_after_prefill(model, drafter, monkeypatch, ids)
    restored = _generation(model, drafter, ids[:PREFIX]).prompt_cache  # the prefix's state, as restored
    warm = _drafter_after_prefill(model, drafter, monkeypatch, ids[PREFIX:], warm_cache=restored)
    # Cold or warm, the drafter is handed the last prompt token only, at its own position 0.
    assert cold["input_ids"].tolist() == warm["input_ids"].tolist() == [[ids[-1]]]
    assert cold["hidden"].shape == warm["hidden"].shape == (1, 1, cold["hidden"].shape[-1])
    assert cold["bonus"].tolist() == warm["bonus"].tolist()
    np.testing.assert_allclose(warm["hidden"], cold["hidden"], rtol=1e-3, atol=1e-3)
    assert cold["seed_token"].tolist() == warm["seed_token"].tolist()
    assert cold["position"].tolist() == warm["position"].tolist()
    np.testing.assert_allclose(warm["seed_hidden"], cold["seed_hidden"], rtol=1e-3, atol=1e-3)
    assert cold["caches"] and len(cold["caches"]) == len(warm["caches"])
    for c, w in zip(cold["caches"], warm["caches"]):
        assert c.shape == w.shape
        np.testing.assert_allclose(w, c, rtol=1e-3, atol=1e-3)
