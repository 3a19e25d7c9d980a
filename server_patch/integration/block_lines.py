"""The journal's ``blocks`` lines: each processed sequence's block hashes, delta-encoded.

A conversation re-sends most of its prompt every turn, so a line names a recent line of the
same server run it shares a prefix with (``from``: that line's ``bseq``; ``keep``: how many of
its hashes) and carries only the rest (``hashes``: little-endian uint64, base64). ``bseq``
restarts with each ``start`` line, as ``seq`` does. A reader that starts reading after a base
line (a report's window) cannot rebuild the lines that need it and skips them: bases are
always among the last ``RECENT`` lines, so only a window's first few requests can be lost.
"""

from __future__ import annotations

import base64
from collections import deque
from typing import Any, Mapping

import numpy as np

from server_patch.lineage.lookup import common_prefix_len

RECENT = 32  # lines a new line may name as its base


def _pack(hashes: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(hashes, dtype="<u8").tobytes()).decode("ascii")


def _unpack(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u8")


class BlockEncoder:
    """The writer's side: turns a sequence's hashes into a line's fields. Not thread-safe:
    the journal recorder calls it from the generation thread only."""

    def __init__(self) -> None:
        self._recent: deque[tuple[int, str, np.ndarray]] = deque(maxlen=RECENT)
        self._next = 1

    def fields(self, namespace: str, hashes: np.ndarray) -> dict[str, Any]:
        hashes = np.asarray(hashes, dtype=np.uint64)
        base, keep = 0, 0
        for bseq, other_ns, other in self._recent:
            if other_ns == namespace:
                shared = common_prefix_len(hashes, other)
                if shared > keep:
                    base, keep = bseq, shared
        line = {"bseq": self._next, "hashes": _pack(hashes[keep:])}
        if keep:
            line.update({"from": base, "keep": keep})
        self._recent.append((self._next, namespace, hashes))
        self._next += 1
        return line


class BlockDecoder:
    """The reader's side: the full hashes of each line, in journal order (``start`` resets)."""

    def __init__(self) -> None:
        self._seen: dict[int, np.ndarray] = {}
        self.skipped = 0  # lines whose base came before the reader started

    def start(self) -> None:
        self._seen.clear()

    def hashes(self, line: Mapping[str, Any]) -> np.ndarray | None:
        tail = _unpack(line["hashes"])
        keep = int(line.get("keep", 0))
        if keep:
            base = self._seen.get(int(line["from"]))
            if base is None or len(base) < keep:
                self.skipped += 1
                return None
            tail = np.concatenate([base[:keep], tail])
        if "bseq" in line:
            self._seen[int(line["bseq"])] = tail
        return tail


__all__ = ["RECENT", "BlockDecoder", "BlockEncoder"]
