"""The live oracle across restarts: the shadow index warmed from the journal at start.

The shadow index lives in memory, so after a restart every conversation's next request would
count no oracle, and what the restart lost (RAM entries that were not on disk, a file rejected
on reload) would go unseen. The journal keeps each processed sequence's block hashes
(``blocks`` lines), so a new runtime reads back those of earlier runs of the same model
(``start`` lines with its fingerprint), newest first, into the shadow's free room (never pushing
out what live traffic put there: ``ShadowIndex.add_older``), and notes each one's end as a
restore point that went with the restart (``Lost.RESTART``, as old as can be: any reason noted
since wins). It runs on its own thread; requests before it ends see a partial oracle.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from pathlib import Path
import numpy as np

from server_patch.integration.block_lines import BlockDecoder
from server_patch.lineage.misses import Lost, MissBook
from server_patch.lineage.shadow import BYTES_PER_BLOCK

log = logging.getLogger("server_patch.lineage")

_WANTED = (b'"blocks"', b'"start"')  # the only lines parsed (others never name these)


def earlier_sequences(files: list[Path], fingerprint: str, own_start: tuple[int, float],
                      max_blocks: int) -> list[tuple[str, np.ndarray, int]]:
    """(namespace, hashes, tokens) of the journaled runs with ``fingerprint`` before this one
    (its ``start`` line is ``own_start``: pid, time) in the journal's ``files`` (oldest first),
    oldest first, the newest ``max_blocks``."""
    found: deque[tuple[str, np.ndarray, int]] = deque()
    held = 0
    decoder, matching = BlockDecoder(), False
    for path in files:
        with path.open("rb") as f:
            for raw in f:
                if not any(key in raw for key in _WANTED):
                    continue
                try:
                    line = json.loads(raw)
                    if line["type"] == "start":
                        if (line.get("pid"), line.get("time")) == own_start:
                            return list(found)
                        decoder.start()
                        matching = line.get("fingerprint") == fingerprint
                        continue
                    if line["type"] != "blocks":
                        continue
                    hashes = decoder.hashes(line)  # every run's lines: a later line may name them
                except (ValueError, KeyError, TypeError):
                    continue
                if hashes is None or not matching:
                    continue
                found.append((str(line.get("namespace", "")), hashes, int(line.get("tokens", 0))))
                held += len(hashes)
                while held > max_blocks and len(found) > 1:
                    held -= len(found.popleft()[1])
    return list(found)


def warm(misses: MissBook, files: list[Path], fingerprint: str, own_start: tuple[int, float]) -> int:
    """Fill the shadow's free room from earlier runs; returns the blocks taken."""
    shadow = misses.shadow
    if not shadow.enabled:
        return 0
    before = len(shadow)
    room = max(0, shadow.budget_bytes // BYTES_PER_BLOCK)
    for namespace, hashes, tokens in reversed(earlier_sequences(files, fingerprint, own_start, 2 * room)):
        if not shadow.add_older(hashes, namespace):
            break
        misses.gone.note_hashes(namespace, hashes, [tokens - 1], Lost.RESTART, older=True)
    return len(shadow) - before


def start(misses: MissBook, files: list[Path], fingerprint: str, own_start: tuple[int, float]) -> threading.Thread:
    """``warm`` on a daemon thread; it logs what it took (a journal it cannot read only warns)."""
    def run() -> None:
        try:
            taken = warm(misses, files, fingerprint, own_start)
        except OSError as exc:
            log.warning("apc_lineage oracle: the journal could not be read back: %s", exc)
            return
        log.info("apc_lineage oracle warmed blocks=%d from the journal", taken)

    thread = threading.Thread(target=run, name="apc-oracle-warmup", daemon=True)
    thread.start()
    return thread


__all__ = ["earlier_sequences", "start", "warm"]
