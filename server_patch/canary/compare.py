"""Is a restored state's next-token distribution the cold prefill's? Three measures, one verdict.

A restore and a cold prefill of the same tokens compute the same function in a different
order (the cold pass ends its chunks elsewhere), so their logits agree to rounding, not bit
for bit. How much rounding depends on the dtype the model computes in:

* float32 (the tiny test model, CPU): 24-bit mantissas; chunk-order differences stay near
  1e-5 of the logit scale. Tolerance ``1e-3 + 1e-4 * scale``: the same 1e-3 the end-to-end
  tests allow on logprobs, and far below what a wrong state does (whole units).
* bfloat16 (the real glm5_next checkpoint): 8-bit mantissas, eps 2^-8 = 0.4 %, and the error
  compounds over dozens of layers; chunked and unchunked prefills of one prompt differ by
  tenths of a logit. Tolerance ``0.1 + 0.03 * scale`` (about 1 at a logit scale of 30). A
  corrupted recurrent state or a restore one token off moves logits by several units.
* float16: 11-bit mantissas, in between: ``0.05 + 0.01 * scale``.

A family whose own cold prefill depends on where the prompt is split (deepseek_v4,
``server_patch.state.splits``) differs between the restored side and the canary's chunked cold
side by that dependence, before any fault: ``SPLIT_RTOL`` adds it, measured by
``apcctl bench splits`` (the worst pairwise difference of differently split cold prefills, over
the logit scale) with a stated margin.

``scale`` is the largest absolute cold logit. ``APC_CANARY_ATOL`` / ``APC_CANARY_RTOL``
override both numbers (a family's split term included). Top-k agreement and the greedy token are judged with the same
tolerance: a token may swap places only with one tied with it (within the tolerance).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from server_patch import settings

TOP_K = 5

# dtype name -> (atol, rtol); see the module docstring for why.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 1e-4),
    "float64": (1e-3, 1e-4),
    "bfloat16": (0.1, 0.03),
    "float16": (0.05, 0.01),
}


#: family -> rtol added for its own split dependence. deepseek_v4: ``apcctl bench splits
#: --family deepseek_v4 --seeds 0-4`` measured at most 0.417 of the logit scale (1080 pairs of
#: split sets on the tiny float32 model, docs/models.md); 0.5 is that with a 1.2x margin.
SPLIT_RTOL: dict[str, float] = {"deepseek_v4": 0.5}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    dtype: str

    def at(self, scale: float) -> float:
        return self.atol + self.rtol * scale


def tolerance_for(dtype: Any, environ: Any = os.environ, family: str = "") -> Tolerance:
    """The tolerance for logits computed in ``dtype`` (an mlx/numpy dtype or its name) by a
    model of ``family`` (its split dependence added, ``SPLIT_RTOL``)."""
    name = str(dtype).rsplit(".", 1)[-1]
    atol, rtol = TOLERANCES.get(name, TOLERANCES["bfloat16"])  # unknown: the loosest float
    atol = settings.value("APC_CANARY_ATOL", environ) or atol
    rtol = settings.value("APC_CANARY_RTOL", environ) or rtol + SPLIT_RTOL.get(family, 0.0)
    return Tolerance(atol, rtol, name)


@dataclass(frozen=True)
class Comparison:
    """The measures of one check and the verdict."""

    max_abs_diff: float
    tolerance: float
    top_k: int
    top_k_agreement: float  # share of the cold top-k found in the restored top-k
    greedy_restored: int
    greedy_cold: int
    passed: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(restored: Any, cold: Any, tol: Tolerance, k: int = TOP_K) -> Comparison:
    """Compare two next-token logit vectors (any array type; last axis is the vocabulary)."""
    r = np.asarray(restored, dtype=np.float64).reshape(-1)
    c = np.asarray(cold, dtype=np.float64).reshape(-1)
    if r.shape != c.shape:
        raise ValueError(f"logit shapes differ: {r.shape} vs {c.shape}")
    k = max(1, min(k, c.size))
    finite = bool(np.isfinite(r).all() and np.isfinite(c).all())
    diff = float(np.max(np.abs(r - c))) if finite else float("inf")
    bound = tol.at(float(np.max(np.abs(c))) if finite else 0.0)
    top_r, top_c = _top(r, k), _top(c, k)
    agreement = len(set(top_r) & set(top_c)) / k
    g_r, g_c = int(top_r[0]), int(top_c[0])
    reasons = []
    if not finite:
        reasons.append("non-finite logits")
    elif diff > bound:
        reasons.append(f"max |diff| {diff:.3g} > {bound:.3g}")
    if finite and g_r != g_c and max(c[g_c] - c[g_r], r[g_r] - r[g_c]) > bound:  # not a tie on both sides
        reasons.append(f"greedy token {g_r} != cold {g_c}")
    kth = r[top_r[-1]]
    if finite and any(r[t] < kth - bound for t in top_c if t not in top_r):
        reasons.append(f"top-{k} agreement {agreement:.2f} beyond ties")
    return Comparison(diff, bound, k, agreement, g_r, g_c, not reasons, "; ".join(reasons) or "ok")


def _top(x: np.ndarray, k: int) -> list[int]:
    idx = np.argpartition(-x, k - 1)[:k]
    return [int(i) for i in idx[np.argsort(-x[idx], kind="stable")]]
