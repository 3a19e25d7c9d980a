"""Decode-aware prefill: a prefill chunk never freezes the other streams longer than a budget.

mlx-vlm 0.7.10 runs every row from one generation thread, one decode step then one prefill
chunk (``BatchGenerator._next``), and a chunk is ``prefill_step_size`` tokens (2,048): on a
slow machine seconds during which every decoding stream waits (issue 29 measured 3-6 s per
chunk on this CPU). While other rows decode, this sizes each chunk so it takes about
``APC_DECODE_STALL_MS``, steered by the times the server measured of its own previous chunks
(so the budget means the same on a Mac and on a CPU), as vLLM's and SGLang's chunked prefill
interleave prefill with decode. With no row decoding, prefill keeps mlx-vlm's full chunk, so a
lone request prefills as fast as before. The cost is throughput: more, smaller chunks
(``apcctl bench stall`` reports it).

The overlay (``overlay/patches/pacing.py``) gives ``PromptProcessingBatch.prompt_step`` a
``max_tokens`` argument and routes the three ``prompt_step()`` calls of ``BatchGenerator._next``
through the door (``integration.hooks.prefill_step``), which hands them to ``step`` with the
runtime's pacer (``LineageRuntime.pacer``: one per served model, none for a stock coordinator,
whose prefill keeps mlx-vlm's chunks) and the number of rows decoding. A chunk's time is
measured to the end of its compute (``mx.synchronize``: mlx-vlm dispatches it asynchronously),
only while pacing is on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from server_patch import settings

log = logging.getLogger("server_patch.pacing")

MIN_CHUNK = 64  # tokens: the smallest chunk paced
FIRST_CHUNK = 256  # tokens of the first paced chunk, before any was measured
MAX_COST = 2.0  # a paced chunk may cost at most this many times a large one per token
SMOOTHING = 0.5  # weight of the newest large chunk in the reference rate
STALL_ENV = "APC_DECODE_STALL_MS"


class PrefillPacer:
    """The paced chunk size, steered by the server's own chunk times.

    After each paced chunk the next size moves toward the budget (``size * budget / time``, at
    most doubling), unless the chunk was mostly overhead: a chunk whose tokens per second fall
    below ``1 / MAX_COST`` of large chunks' (``FIRST_CHUNK`` or more) doubles instead, and the
    size never again goes that low (until an unpaced chunk measures that rate anew). Per-token
    cost is not constant in the chunk size: measured on the bench preset on a loaded CPU, a
    64-token chunk took 2 s and a 2,048-token one 5.7 s (the decode step dispatched before it,
    per-chunk work over the whole context, a slower attention path for short chunks). So where
    the budget cannot be met, pacing bounds its throughput cost and still cuts the longest wait,
    instead of splitting into chunks that are all overhead."""

    def __init__(self, budget_ms: float) -> None:
        self.budget_ms = float(budget_ms)
        self.size: int | None = None  # the next paced chunk's tokens (None: FIRST_CHUNK)
        self.full_rate: float | None = None  # tokens per second of chunks of FIRST_CHUNK or more
        self.floor = MIN_CHUNK  # the smallest size not found mostly overhead (since full_rate moved)
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
            size = FIRST_CHUNK if self.size is None else self.size
        return max(1, min(full, size))

    def observe(self, tokens: int, seconds: float, *, chosen: int, paced: bool) -> None:
        """A chunk of ``tokens`` (``chosen`` was the size asked for; fewer: cut at a checkpoint
        or the prompt's end) took ``seconds`` to the end of its compute."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            if paced and tokens >= chosen:  # not cut short (a checkpoint, the prompt's end)
                if self.full_rate is not None and rate * MAX_COST < self.full_rate:
                    self.floor = max(self.floor, 2 * tokens)  # mostly overhead: never this small again
                    target = 2.0 * tokens
                else:
                    target = tokens * min(2.0, self.budget_ms / 1000 / seconds)
                self.size = max(self.floor, round(target))
            if tokens >= FIRST_CHUNK:  # the reference rate: a short chunk says little about it
                self.full_rate = rate if self.full_rate is None else \
                    SMOOTHING * rate + (1 - SMOOTHING) * self.full_rate
                if not paced:
                    self.floor = MIN_CHUNK  # measured anew: sizes are judged afresh


def from_env() -> PrefillPacer:
    """A runtime's pacer, from ``APC_DECODE_STALL_MS``."""
    return PrefillPacer(settings.value(STALL_ENV))


def step(pacer: PrefillPacer, prompt_batch: Any, decoding: int) -> int:
    """One ``prompt_step`` of ``prompt_batch`` (``BatchGenerator._next``, through the door), at
    most the paced chunk while ``decoding`` rows wait for it, and the chunk's cost measured. A
    batch whose model cannot prefill in chunks (``prefill_step_size`` None) keeps its one step."""
    full = int(getattr(prompt_batch, "prefill_step_size", 0) or 0)
    if not pacer.enabled or not full:
        return prompt_batch.prompt_step()
    import mlx.core as mx

    chosen = pacer.chunk(full, decoding)
    tic = time.perf_counter()
    tokens = prompt_batch.prompt_step(chosen)
    mx.synchronize()
    seconds = time.perf_counter() - tic
    pacer.observe(tokens, seconds, chosen=chosen, paced=decoding > 0)
    if tokens > 0:
        split = decoding > 0 and chosen < full
        pacer.stats["chunks"] += 1
        pacer.stats["paced_chunks"] += int(split)
        log.info("apc_pacing chunk tokens=%d decoding=%d paced=%d ms=%.1f", tokens, decoding,
                 int(split), seconds * 1000)
    return tokens


__all__ = ["FIRST_CHUNK", "MIN_CHUNK", "PrefillPacer", "from_env", "step"]
