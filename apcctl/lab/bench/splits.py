"""How much a model's own cold prefill depends on where the prompt is split into forward calls.

A lineage restore at L computes what a cold prefill split at L computes (the restored state *is*
the state after the call that ended at L). Most families are split-invariant up to float
rounding, so the canary's restored-versus-cold comparison only needs a dtype tolerance. A
family that is not (deepseek_v4: its ratio-4 compressor restarts its overlap window at every
call) differs between two split sets by the model's own amount, before any restore; the canary
must allow that much, and no more. This measures it: for random prompts, logits after one
call, after a few random cuts, and after the canary's own cuts (every ``chunk`` tokens plus a
probe stop), the largest difference between any two, absolute and relative to the logit scale
(the largest absolute logit, as the canary's tolerance reads it). As a control it also
measures what a wrong state does (the same prompt with one token changed just before the
end), which the tolerance must stay below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class SplitMeasure:
    """The worst split dependence over ``trials`` comparisons, and the wrong-state control."""

    trials: int
    max_abs: float  # largest |logit difference| between two split sets of one prompt
    max_rel: float  # the same, divided by that prompt's logit scale
    scale: float  # the largest logit scale seen
    wrong_min_abs: float  # smallest |difference| a one-token-wrong prefix made

    def as_dict(self) -> dict[str, float]:
        return {"trials": self.trials, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "scale": self.scale, "wrong_min_abs": self.wrong_min_abs}


def _prefill(forward: Callable[[Any, np.ndarray, list], Any], model: Any, tokens: np.ndarray,
             cuts: Sequence[int]) -> np.ndarray:
    import mlx.core as mx

    cache, start, out = model.make_cache(), 0, None
    for stop in [*sorted(set(cuts)), len(tokens)]:
        if start < stop <= len(tokens):
            out = forward(model, tokens[start:stop], cache)
            start = stop
    mx.eval(out)
    return np.array(out, dtype=np.float64).reshape(-1)


def measure(model: Any, *, vocab: int, prompts: int = 6, splits: int = 4, chunk: int = 128,
            lengths: tuple[int, int] = (150, 400), seed: int = 0,
            forward: Callable[[Any, np.ndarray, list], Any] | None = None) -> SplitMeasure:
    """``prompts`` random prompts, each prefilled in one call and ``splits`` times with random cuts
    and with the canary's cuts; the worst pairwise difference of the last-position logits."""
    if forward is None:
        from apcctl.lab.tinymodel.families import forward
    rng = np.random.default_rng(seed)
    max_abs = max_rel = scale_seen = 0.0
    wrong = np.inf
    trials = 0
    for _ in range(prompts):
        n = int(rng.integers(*lengths))
        tokens = rng.integers(1, vocab, n).astype(np.int32)
        runs = [_prefill(forward, model, tokens, [])]
        for _ in range(splits):
            cuts = rng.choice(np.arange(1, n), size=int(rng.integers(1, 4)), replace=False).tolist()
            canary = [*range(chunk, n, chunk), int(rng.integers(1, n))]
            runs += [_prefill(forward, model, tokens, cuts), _prefill(forward, model, tokens, canary)]
        scale = float(np.max(np.abs(runs[0])))
        scale_seen = max(scale_seen, scale)
        for i in range(len(runs)):
            for j in range(i + 1, len(runs)):
                diff = float(np.max(np.abs(runs[i] - runs[j])))
                max_abs, max_rel, trials = max(max_abs, diff), max(max_rel, diff / scale), trials + 1
        changed = tokens.copy()
        changed[-2] = (changed[-2] % (vocab - 1)) + 1  # one wrong token just before the end
        wrong = min(wrong, float(np.max(np.abs(_prefill(forward, model, changed, []) - runs[0]))))
    return SplitMeasure(trials, max_abs, max_rel, scale_seen, wrong)


def measure_tiny(family: str, seeds: Sequence[int] = (0, 1, 2), **kwargs: Any) -> list[SplitMeasure]:
    """``measure`` on the tiny random model of ``family`` (``apcctl.lab.tinymodel``), one per seed."""
    from apcctl.lab.tinymodel.families import build_language_model

    out = []
    for seed in seeds:
        model = build_language_model(family, seed=seed)
        out.append(measure(model, vocab=int(model.args.vocab_size), seed=seed, **kwargs))
    return out


__all__ = ["SplitMeasure", "measure", "measure_tiny"]
