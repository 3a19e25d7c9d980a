"""The shapes of the random ``glm5_next`` models: ``tiny`` for tests, ``bench`` for benches.

Each has a speculative twin, ``tiny-spec`` and ``bench-spec``: the same shapes with a dominant
path (``weights.add_dominant_path``) an MTP drafter can follow, so drafts get accepted (issue 39).
The path makes the target follow its last token most of the time, which weakens warm == cold
text comparisons; so only the speculative tests and ``apcctl bench spec`` use the twins, and
``tiny`` and ``bench`` (``path_gain`` 0) keep builder 2's context-driven weights exactly.

* ``tiny``: six layers ``llalls`` (KDA, KDA, attention with its own indexer, KDA, KDA,
  attention sharing that indexer), hidden 64, ``index_topk`` 64 with ``index_kpool`` 16 so
  top-k selection really prunes once a prompt passes 64 tokens. Loads in a fraction of a
  second; meant for tests.
* ``bench``: eight layers ``llasllas`` (4 KDA, 2 full-indexer and 2 shared-indexer
  attention layers) with the tiny widths except ``kv_lora_rank`` 2048 and ``index_topk``
  512. Sized so the caches a snapshot copies weigh what they weigh on the real model
  (GLM-5-Next keeps ~11 attention layers x 1 KiB latent per token in bf16); see
  :func:`apcctl.lab.tinymodel.config.cache_bytes`. Compute stays small because the MLX CPU matmul
  is slow here (~6 GFLOP/s): measured ~470 tok/s prefill (16k tokens in ~35 s) and ~14 tok/s
  decode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Preset:
    """Shape of a random model. ``layers``: l = KDA linear, a = sparse attention with its
    own indexer, s = sparse attention reusing the previous indexer's top-k."""

    layers: str
    hidden: int
    intermediate: int
    moe_intermediate: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    linear_heads: int
    linear_head_dim: int
    routed_experts: int
    experts_per_tok: int
    # lm_head gain on the dominant path's vote (weights.add_dominant_path); 0: no path at all.
    # With it the target follows the path on ~70% of greedy corpus tokens. Bench's wide latent
    # makes its final hidden state ~12x the tiny one's before the final norm, so its vote needs
    # ~12x the gain.
    path_gain: float = 0.0


_TINY = Preset(
    layers="llalls", hidden=64, intermediate=128, moe_intermediate=32, heads=2,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=64, index_kpool=16,
    linear_heads=2, linear_head_dim=32, routed_experts=4, experts_per_tok=2,
)
_BENCH = Preset(
    layers="llasllas", hidden=64, intermediate=128, moe_intermediate=32, heads=2,
    q_lora_rank=32, kv_lora_rank=2048, qk_nope_head_dim=16, v_head_dim=16,
    index_n_heads=2, index_head_dim=32, index_topk=512, index_kpool=16,
    linear_heads=2, linear_head_dim=32, routed_experts=8, experts_per_tok=2,
)

PRESETS: dict[str, Preset] = {
    "tiny": _TINY,
    "bench": _BENCH,
    "tiny-spec": replace(_TINY, path_gain=0.4),
    "bench-spec": replace(_BENCH, path_gain=5.0),
}
SPEC_PRESETS = tuple(name for name, preset in PRESETS.items() if preset.path_gain)
"""The presets with a dominant path: the ones an MTP drafter can be constructed for."""
