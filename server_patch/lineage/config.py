"""Every threshold of the lineage cache in one frozen object, read from ``APC_LINEAGE_*``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Mapping

from server_patch.disk_paths import default_disk_root, volume_usage
from server_patch.envconfig import env_values

GB = 1 << 30

class ThinClass(StrEnum):
    """What thinning groups checkpoints by (``thin_order`` names them, first dropped first)."""

    SEGMENT = "segment"
    STALE_GUARD = "stale_guard"  # every guard but the newest one
    PERIODIC = "periodic"
    TURN = "turn"  # final and divergence points: where turns and lineages part
    GUARD = "guard"  # the newest guard


DEFAULT_THIN_ORDER: tuple[str, ...] = tuple(ThinClass)


def volume_disk_cap(env: Mapping[str, str]) -> int:
    """The disk cap when ``APC_LINEAGE_DISK_MAX_BYTES`` is unset: a fixed 1 TiB warned on almost
    every machine (issue 36), so it is sized to the disk tier's volume: half its total size, at
    most 1 TiB (the class default, also used when the volume cannot be read)."""
    usage = volume_usage(default_disk_root(env))
    if usage is None:
        return LineageConfig.disk_max_bytes
    return min(LineageConfig.disk_max_bytes, int(usage[0] * DEFAULT_DISK_FRACTION))


# The default disk cap's share of its volume (``volume_disk_cap``).
DEFAULT_DISK_FRACTION = 0.5


@dataclass(frozen=True)
class LineageConfig:
    """Knobs of the lineage design; see docs/design.md for why each default is what it is."""

    enabled: bool = True
    # 0.7.10 prefills tokens [:n-1] and feeds the last prompt token to the first decode step,
    # so the natural place for an entry is n-1: it serves both the next turn and a resend.
    entry_offset: int = 1
    # The post's guard sat at n-16 because its entry sat at n. Ours sits at n-1 and is its own
    # resend point, so by default no guard is captured (a guard needs guard_tokens >
    # entry_offset); 16 brings it back. The replay showed it never saved a token.
    guard_tokens: int = 1
    guard_min_suffix: int = 256
    # The post used 256; the replay's scheduled agent (a clock 64 tokens into its system text)
    # needs less, and 64 costs +5.6 % checkpoint bytes for 1.022x -> 1.014x the oracle's prefill.
    divergence_min_gain: int = 64
    periodic_stride: int = 2048
    segment_min_gap: int = 256
    min_tokens: int = 16
    max_checkpoints: int = 4
    thin_order: tuple[str, ...] = DEFAULT_THIN_ORDER
    ram_budget_bytes: int = 48 * GB
    anchor_max_entries: int = 16
    anchor_max_bytes: int = 16 * GB
    # Used only where the volume's size cannot be read: unset, the cap is ``volume_disk_cap``'s.
    disk_max_bytes: int = 1024 * GB
    disk_low_watermark: float = 0.9
    # An entry still being extended is not worth writing: wait until it is idle this long.
    disk_write_delay_s: float = 30.0
    # On SIGTERM, unwritten entries are flushed for at most this long (apcctl's stop grace
    # follows it, so a SIGKILL never cuts the flush short).
    shutdown_flush_s: float = 60.0
    # When a request ends, its entry's head moves past the reply it generated (every token the
    # model was fed), the prompt end staying a checkpoint: a next prompt that re-renders the
    # reply verbatim prefills only what is new. 0 keeps the entry at the prompt end.
    reply_reuse: bool = True
    # The live oracle (``shadow``): prefix hashes of what each namespace processed, in blocks
    # of this many tokens, within this budget (about 8 MB per million tokens at 16; 0: off).
    shadow_budget_bytes: int = 16 << 20
    shadow_block_tokens: int = 16

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """``{field: variable}``: ``APC_LINEAGE_<FIELD>``, and ``APC_LINEAGE`` for ``enabled``
        (the settings registry lists these same names)."""
        return {f.name: "APC_LINEAGE" if f.name == "enabled" else f"APC_LINEAGE_{f.name.upper()}"
                for f in fields(cls)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "LineageConfig":
        """Build from ``APC_LINEAGE`` (on/off) and ``APC_LINEAGE_<FIELD>`` variables, then overrides."""
        env = os.environ if env is None else env
        values = env_values(cls, cls.env_names(), env) | overrides
        if "disk_max_bytes" not in values:
            values["disk_max_bytes"] = volume_disk_cap(env)
        config = replace(cls(), **values)
        config.validate()
        return config

    def validate(self) -> None:
        """Reject settings that would make the policy misbehave rather than fail loudly later."""
        for name in ("entry_offset", "guard_tokens", "guard_min_suffix", "divergence_min_gain",
                     "periodic_stride", "segment_min_gap", "min_tokens", "max_checkpoints",
                     "ram_budget_bytes", "anchor_max_entries", "anchor_max_bytes", "disk_max_bytes",
                     "shadow_budget_bytes"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"lineage config {name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.shadow_block_tokens <= 16:
            raise ValueError("lineage config shadow_block_tokens must be in 1..16")
        if self.shutdown_flush_s <= 0:
            raise ValueError("lineage config shutdown_flush_s must be > 0")
        if not 0 < self.disk_low_watermark <= 1:
            raise ValueError("lineage config disk_low_watermark must be in (0, 1]")
        unknown = set(self.thin_order) - set(DEFAULT_THIN_ORDER)
        if unknown:
            raise ValueError(f"unknown thinning classes {sorted(unknown)}; known: {[str(c) for c in ThinClass]}")

