"""The copy-free knobs, read once from the environment (``APC_COPYFREE*``, ``APC_POOL_*``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

from server_patch.envconfig import env_values

# Environment variable of each field.
ENV = {
    "enabled": "APC_COPYFREE",
    "adopt": "APC_COPYFREE_ADOPT",
    "lend": "APC_COPYFREE_LEND",
    "join": "APC_COPYFREE_JOIN",
    "grow": "APC_COPYFREE_GROW",
    "join_wait_ms": "APC_COPYFREE_JOIN_WAIT_MS",
    "lend_headroom": "APC_COPYFREE_LEND_HEADROOM",
    "decode_reserve": "APC_COPYFREE_DECODE_RESERVE",
    "adopt_dead_fraction": "APC_COPYFREE_ADOPT_DEAD_FRACTION",
    "adopt_dead_min": "APC_COPYFREE_ADOPT_DEAD_MIN",
    "pool_clear": "APC_POOL_CLEAR",
    "pool_limit_gb": "APC_POOL_LIMIT_GB",
    "pool_idle_s": "APC_POOL_IDLE_S",
}


@dataclass(frozen=True)
class CopyFreeSettings:
    """What a warm turn may copy, and how long MLX's buffer pool is kept."""

    # Capacity-reserving batch merge and deferred adoption; 0 gives the stock merge and an
    # immediate row copy at every commit (for A/B measurements).
    enabled: bool = True
    # Adopt a lone request's own KV buffer at its end instead of copying its row at prefill end.
    adopt: bool = True
    # Lend an entry's own buffer to the lone request that extends it: the request appends in
    # place and the warm turn copies no KV at all (needs ``adopt``: only adopted buffers have
    # room past the entry).
    lend: bool = True
    # A row joining or leaving the decoding batch moves each KV row once, at its own width
    # (``copyfree.batch``); 0 (or ``enabled`` 0): mlx-vlm's ``BatchKVCache.extend``/``filter``.
    join: bool = True
    # A decoding batch outgrowing its buffer grows into one its stager made ahead, and the
    # copy is timed as ``grow`` (``copyfree.grow``; needs ``join``); 0: mlx-vlm's concatenation.
    grow: bool = True
    # A finished prompt batch waits this long at most (decode steps go on) for the joint buffers
    # the stager is still making for its join, instead of allocating them on the generation
    # thread while every decoding stream waits (``integration.joins_ahead.waits``); 0: never.
    join_wait_ms: float = 2000.0
    # Tokens of decode headroom the merge allocates past prompt end (stock regrows in 256 steps).
    decode_reserve: int = 256
    # Extra rows a lone request's merge allocates, so the next turns of its conversation fit
    # in the adopted buffer and are lent it instead of copying it.
    lend_headroom: int = 512
    # Adopt only while the rows past the entry (decode, headroom) are at most this fraction of
    # it, or this many rows; a longer reply is compacted by one copy instead.
    adopt_dead_fraction: float = 0.25
    adopt_dead_min: int = 2048
    # Stock clears MLX's pool after every prefill chunk and prompt batch; opt-in here.
    pool_clear: bool = False
    # mx.set_cache_limit: the most freed memory MLX keeps for reuse.
    pool_limit_gb: float = 16.0
    # Release the pool after this many seconds without prefill work (0: never).
    pool_idle_s: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "CopyFreeSettings":
        env = os.environ if env is None else env
        values = env_values(cls, ENV, env)
        settings = replace(cls(), **values)
        rows = (settings.decode_reserve, settings.lend_headroom, settings.adopt_dead_min)
        if min(rows) < 0 or settings.adopt_dead_fraction < 0:
            raise ValueError("copy-free reserves and adoption limits must be >= 0")
        if settings.pool_limit_gb < 0 or settings.pool_idle_s < 0:
            raise ValueError("APC_POOL_LIMIT_GB and APC_POOL_IDLE_S must be >= 0")
        if settings.join_wait_ms < 0:
            raise ValueError("APC_COPYFREE_JOIN_WAIT_MS must be >= 0")
        return settings

    @property
    def lending(self) -> bool:
        return self.enabled and self.adopt and self.lend

    def spare_allowed(self, length: int) -> int:
        """The most rows past an entry of ``length`` rows its buffer may carry: an adopted
        buffer's reply and spare room, or the reply room a prompt-end copy reserves."""
        return max(self.adopt_dead_min, int(self.adopt_dead_fraction * length))

    def adoptable(self, length: int, capacity: int) -> bool:
        """Whether a buffer of ``capacity`` rows may back an entry of ``length`` rows."""
        return max(0, capacity - length) <= self.spare_allowed(length)

