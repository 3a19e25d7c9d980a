"""Decode-aware prefill: a prefill chunk never freezes the other streams longer than a budget.

mlx-vlm 0.7.10 runs every row from one generation thread, one decode step then one prefill
chunk (``BatchGenerator._next``), and a chunk is ``prefill_step_size`` tokens (2,048): on a
slow machine seconds during which every decoding stream waits (issue 29 measured 3-6 s per
chunk on this CPU). While other rows decode, this sizes each chunk so it takes about
``APC_DECODE_STALL_MS``, from the cost the server measured on its own previous chunks (so the
budget holds on a Mac and on a CPU alike), as vLLM's and SGLang's chunked prefill
interleave prefill with decode. With no row decoding, prefill keeps mlx-vlm's full chunk, so a
lone request prefills as fast as before. The cost is throughput: more, smaller chunks
(``apcctl bench stall`` reports it).

The overlay (``overlay/patches/pacing.py``) routes the three ``prompt_step()`` calls of
``BatchGenerator._next`` through ``step`` and the chunk size of ``prompt_step`` through
``chunk``. A chunk's time is measured to the end of its compute (``mx.synchronize``: mlx-vlm
dispatches it asynchronously), only while pacing is on.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter, deque
from typing import Any

from server_patch import settings

log = logging.getLogger("server_patch.pacing")

MIN_CHUNK = 64  # tokens: the smallest chunk paced
FIRST_CHUNK = 256  # tokens of the first chunk paced before two sizes were measured
WINDOW = 6  # recent chunks the cost model is fitted to (the cost per token grows with the context)
FLOOR_SPLIT = 4  # where the budget cannot be met, a full chunk is still split at least this many ways
STALL_ENV = "APC_DECODE_STALL_MS"


class PrefillPacer:
    """A chunk's cost, fitted to the server's own recent chunks as ``fixed + per_token * n``,
    and the chunk size it allows while others decode.

    The fixed part is real and can be large (the decode step dispatched just before the chunk,
    per-chunk work over the whole context): measured on the bench preset, 64 tokens cost about
    as much as 256. So the size is the larger of what fits the budget and what keeps the fixed
    part at most half a chunk's time (but a quarter of the full chunk at most): where the budget
    cannot be met, pacing bounds its throughput cost instead of splitting into chunks that are
    all overhead, and still cuts the longest wait."""

    def __init__(self, budget_ms: float) -> None:
        self.budget_ms = float(budget_ms)
        self.samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, seconds)
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_ms > 0

    def chunk(self, full: int, decoding: int) -> int:
        """Tokens of the next chunk: ``full`` (mlx-vlm's) unless ``decoding`` rows wait for it."""
        if not self.enabled or decoding <= 0:
            return full
        with self._lock:
            model = self.cost_model()
            if model is None:  # one size measured so far: try another one to learn the slope
                last = self.samples[-1][0] if self.samples else 0
                size = FIRST_CHUNK if not last else last // 2 if last >= 2 * FIRST_CHUNK else 2 * last
            else:
                fixed, per_token = model
                fits = (self.budget_ms / 1000 - fixed) / per_token
                size = round(max(fits, min(fixed / per_token, full / FLOOR_SPLIT)))
        return max(1, min(full, max(MIN_CHUNK, size)))

    def cost_model(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) over the recent chunks, robust to a stray slow one
        (Theil-Sen: the median of the pairwise slopes, then the median intercept); None until
        two sizes were measured. Never negative: a slope at or below zero reads as a pure rate."""
        samples = list(self.samples)
        slopes = [(tj - ti) / (nj - ni) for k, (ni, ti) in enumerate(samples) for nj, tj in samples[k + 1:]
                  if nj != ni]
        if not slopes:
            return None
        slope = statistics.median(slopes)
        if slope <= 0:
            return 0.0, statistics.median(t / n for n, t in samples)
        return max(0.0, statistics.median(t - slope * n for n, t in samples)), slope

    def observe(self, tokens: int, seconds: float) -> None:
        """One chunk of ``tokens`` took ``seconds`` (to the end of its compute)."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.samples.append((tokens, seconds))


_PACER: PrefillPacer | None = None
_PACER_LOCK = threading.Lock()


def pacer() -> PrefillPacer:
    """The process's pacer, made on first use from ``APC_DECODE_STALL_MS``."""
    global _PACER
    with _PACER_LOCK:
        if _PACER is None:
            _PACER = PrefillPacer(settings.value(STALL_ENV))
        return _PACER


def chunk(prompt_batch: Any, full: int) -> int:
    """``PromptProcessingBatch.prompt_step``'s chunk size (the overlay's hook). A batch whose
    model cannot prefill in chunks (``prefill_step_size`` None) keeps its one whole step."""
    decoding = int(getattr(prompt_batch, "_apc_decoding", 0) or 0)
    if getattr(prompt_batch, "prefill_step_size", None) is None:
        return full
    size = pacer().chunk(full, decoding)
    prompt_batch._apc_chunk = size
    return size


def step(generator: Any, prompt_batch: Any) -> int:
    """One ``prompt_step`` of ``prompt_batch`` in ``BatchGenerator._next`` (the overlay's hook):
    tells it how many rows decode meanwhile, and measures the chunk's cost."""
    paced = pacer()
    decoding = len(generator._generation_batch)
    prompt_batch._apc_decoding = decoding
    if not paced.enabled:
        return prompt_batch.prompt_step()
    import mlx.core as mx

    tic = time.perf_counter()
    tokens = prompt_batch.prompt_step()
    mx.synchronize()
    seconds = time.perf_counter() - tic
    paced.observe(tokens, seconds)
    if tokens > 0:
        full = int(getattr(prompt_batch, "prefill_step_size", 0) or 0)
        split = decoding > 0 and getattr(prompt_batch, "_apc_chunk", full) < full
        paced.stats["chunks"] += 1
        paced.stats["paced_chunks"] += int(split)
        log.info("apc_pacing chunk tokens=%d decoding=%d paced=%d ms=%.1f", tokens, decoding,
                 int(split), seconds * 1000)
    return tokens


__all__ = ["MIN_CHUNK", "PrefillPacer", "chunk", "pacer", "step"]
