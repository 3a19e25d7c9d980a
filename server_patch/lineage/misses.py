"""Every miss explained: a request's oracle, why each token it lost was lost, and the totals.

The oracle of a request is the shadow index's answer (``shadow``): what an unbounded cache
would have restored on the same traffic. What it restored less than that is *lost*, and each
lost token gets one reason, from the policy's own records:

* where restore points went (``GoneLog``): the policy tells it each time state leaves (an
  entry evicted for the RAM budget or by an operator, a checkpoint thinned, a file deleted
  for the disk cap or rejected), keyed by the prefix hash of the point's last full block;
* what the admission itself met (``Admission``): a disk file rejected while it settled, a disk
  tier it could not use, a restore refused (a canary-suspect kind, a loan in the way);
* what is left: the cache holds the tokens but no restore point there (``no restore point``:
  below the capture gap, not a boundary), or the prompt diverged inside a reply its entry
  kept (``reply not re-rendered``: the template renders it otherwise), or ``other``.

``ladder`` gives each lost span to the nearest point above it that could have served it.
Plain Python + numpy, no mlx: the server and the simulator (``apcctl/lab/sim``) share it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from server_patch.lineage.model import DiskRecord, Entry, Reason
from server_patch.lineage.shadow import BLOCK_TOKENS, Match, ShadowIndex, block_hashes


class Lost(StrEnum):
    """Why tokens the oracle had were not restored (the ``reason`` label of the totals)."""

    RAM_BUDGET = "ram budget"  # its entry left RAM for the budget, unwritten (or no disk tier)
    ANCHOR_CAP = "anchor cap"
    DISK_CAP = "disk cap"  # its file was deleted for the disk budget
    OPERATOR = "operator"  # an admin evict, or a cache reset
    THINNED = "thinning"  # its checkpoint was thinned (max_checkpoints)
    NO_POINT = "no restore point"  # the tokens are held, but no state at the divergence
    DISK_REJECTED = "disk rejected"  # its file failed validation (the request says why)
    DISK_UNUSED = "disk not used"  # no disk tier asked, no room to promote, its write not landed, or its load too slow
    CANARY = "canary"  # a canary-suspect kind refused
    LOAN = "loan"  # the entry was lent to a running request
    REPLY = "reply not re-rendered"  # the prompt diverged inside the reply its entry kept
    RESTART = "restart"  # processed before the server restarted, and not on disk
    OTHER = "other"


# The policy's removal reasons (``Reason``, an event's detail) as lost reasons.
_FROM_POLICY: dict[str, Lost] = {
    Reason.RAM_BUDGET: Lost.RAM_BUDGET, f"{Reason.RAM_BUDGET}, {Reason.UNWRITTEN}": Lost.RAM_BUDGET,
    Reason.ANCHOR_CAP: Lost.ANCHOR_CAP, Reason.DISK_CAP: Lost.DISK_CAP, Reason.OPERATOR: Lost.OPERATOR,
    Reason.RESET: Lost.OPERATOR, Reason.RESTART_PROBE: Lost.OPERATOR, Reason.FAILED_VALIDATION: Lost.DISK_REJECTED,
    Reason.LENT_ROWS_LOST: Lost.LOAN,
}


def lost_reason(reason: str) -> Lost:
    """A policy reason, or a ``Lost`` value, as a ``Lost`` (unknown ones are ``other``)."""
    if reason in Lost._value2member_map_:
        return Lost(reason)
    return _FROM_POLICY.get(reason, Lost.OTHER)


def ladder(restored: int, oracle: int, steps: Iterable[tuple[int, str]]) -> dict[str, int]:
    """``{reason: tokens}`` summing to ``oracle - restored`` (0 when it restored as much):
    each span goes to the shortest step above it; ``steps`` are (length, reason), earlier
    ones winning ties; what no step reaches is the last step's (give one at ``oracle``)."""
    lost: Counter[str] = Counter()
    at = restored
    capped = [(min(int(length), oracle), order, str(reason)) for order, (length, reason) in enumerate(steps)]
    for top, _, reason in sorted(capped):
        if top > at:
            lost[reason] += top - at
            at = top
    return dict(lost)


class GoneLog:
    """Where restore points went: (namespace, prefix hash of the point's last full block) ->
    reason, the newest record winning; bounded, oldest first."""

    def __init__(self, block: int, max_points: int) -> None:
        self.block = block
        self.max_points = max(0, max_points)
        self._points: OrderedDict[tuple[str, int], Lost] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._points)

    def note(self, namespace: str, tokens: np.ndarray, lengths: Iterable[int], reason: Lost) -> None:
        if self.max_points:
            self.note_hashes(namespace, block_hashes(tokens, self.block), lengths, reason)

    def note_hashes(self, namespace: str, hashes: np.ndarray, lengths: Iterable[int], reason: Lost, *,
                    older: bool = False) -> None:
        """``note`` from the hashes; ``older``: before everything noted (the journal, read at
        start), so it is the first to go and never replaces a reason noted since."""
        with self._lock:
            for length in sorted(set(int(n) for n in lengths)):
                blocks = min(length // self.block, len(hashes))
                if not blocks:
                    continue
                key = (namespace, int(hashes[blocks - 1]))
                if older and key in self._points:
                    continue
                self._points[key] = reason
                self._points.move_to_end(key, last=not older)
            while len(self._points) > self.max_points:
                self._points.popitem(last=False)

    def steps(self, hashes: np.ndarray, namespace: str, upto: int, above: int) -> list[tuple[int, str]]:
        """(length, reason) of every gone point of this prompt in (``above``, ``upto``]."""
        first, last = above // self.block + 1, upto // self.block
        with self._lock:
            if not self._points:
                return []
            found: list[tuple[int, str]] = []
            for blocks in range(first, min(last, len(hashes)) + 1):
                reason = self._points.get((namespace, int(hashes[blocks - 1])))
                if reason is not None:
                    found.append((blocks * self.block, reason))
            return found


def _points(held: Entry | DiskRecord) -> list[int]:
    if isinstance(held, Entry):
        return [held.length, *(c.length for c in held.checkpoints)]
    return [length for length, _ in held.restore_points()]


@dataclass
class Miss:
    """One request against the oracle (``MissBook.explain``)."""

    oracle: int = 0
    restored: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    elsewhere: bool = False  # another namespace processed a longer prefix
    detail: str = ""  # why a disk file was rejected, when that is a reason


PROMPT, REPLY = "prompt", "reply"  # what a processed sequence was (``MissBook.listeners``)
WINDOWS_S: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
_BUCKET_S = 60.0


class MissBook:
    """The shadow index, the gone log and the running totals of one cache. Thread-safe."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS,
                 clock: Callable[[], float] | None = None) -> None:
        self.shadow = ShadowIndex(budget_bytes, block)
        # The gone log shares the budget: an eighth of it (a point costs about two blocks).
        self.gone = GoneLog(block, budget_bytes // 8 // 256)
        self.clock = clock
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self._buckets: OrderedDict[int, Counter[str]] = OrderedDict()
        # Told each processed sequence: (namespace, block hashes, tokens, PROMPT or REPLY); the
        # journal keeps them for ``apcctl report --what-if``. An observer never breaks a request.
        self.listeners: list[Callable[[str, np.ndarray, int, str], None]] = []
        # Told each processed sequence's tokens: (namespace, tokens, PROMPT or REPLY), the oracle
        # on or off (``server_patch.drift`` holds replies, to tell a re-rendered one).
        self.sequence_listeners: list[Callable[[str, np.ndarray, str], None]] = []

    @classmethod
    def from_config(cls, config: Any, clock: Callable[[], float] | None = None) -> "MissBook":
        return cls(config.shadow_budget_bytes, config.shadow_block_tokens, clock)

    @property
    def enabled(self) -> bool:
        return self.shadow.enabled

    # ------------------------------------------------------------------ the policy's records

    def went(self, held: Entry | DiskRecord, reason: str | None, lengths: Iterable[int] | None = None) -> None:
        """State left the cache (``held``'s restore points, or only ``lengths`` of them)."""
        if reason is None or not self.enabled:
            return
        self.gone.note(held.namespace, held.tokens, _points(held) if lengths is None else lengths,
                       lost_reason(reason))

    # ------------------------------------------------------------------ a request

    def hashes(self, tokens: np.ndarray) -> np.ndarray:
        return self.shadow.hashes(tokens) if self.enabled else np.zeros(0, dtype=np.uint64)

    def match(self, hashes: np.ndarray, namespace: str, prompt_len: int) -> Match:
        return self.shadow.match(hashes, namespace, prompt_len) if self.enabled else Match(0)

    def processed(self, tokens: np.ndarray, namespace: str, hashes: np.ndarray | None = None,
                  kind: str = "prompt") -> None:
        """``namespace`` processed ``tokens``: a prompt (``PROMPT``), or a prompt and the reply
        fed after it (``REPLY``)."""
        for told in list(self.sequence_listeners):
            try:
                told(namespace, tokens, kind)
            except Exception:  # noqa: BLE001 - an observer must never fail a request
                pass
        if not self.enabled:
            return
        hashes = self.hashes(tokens) if hashes is None else hashes
        self.shadow.add(hashes, namespace)
        for listener in list(self.listeners):
            try:
                listener(namespace, hashes, int(tokens.shape[0]), kind)
            except Exception:  # noqa: BLE001 - the journal must never fail a request
                pass

    def explain(self, match: Match, restored: int, hashes: np.ndarray, namespace: str,
                steps: Iterable[tuple[int, str]], residual: Lost, detail: str = "") -> Miss:
        """The request's miss: its own ``steps`` (what its admission met) first, then the gone
        points, then ``residual`` for what neither reaches; counted into the totals."""
        oracle = match.oracle
        lost: dict[str, int] = {}
        if oracle > restored:
            gone = self.gone.steps(hashes, namespace, oracle, restored)
            lost = ladder(restored, oracle, [*steps, *gone, (oracle, residual)])
        miss = Miss(oracle, restored, lost, match.elsewhere,
                    detail if Lost.DISK_REJECTED in lost else "")
        if self.enabled:
            self._count(miss)
        return miss

    def _count(self, miss: Miss) -> None:
        counts = Counter({"requests": 1, "oracle_tokens": miss.oracle,
                          "restored_tokens": min(miss.restored, miss.oracle),
                          "elsewhere_requests": int(miss.elsewhere)})
        counts.update({f"lost:{reason}": n for reason, n in miss.lost.items()})
        with self._lock:
            self._totals.update(counts)
            if self.clock is not None:
                bucket = int(self.clock() // _BUCKET_S)
                self._buckets.setdefault(bucket, Counter()).update(counts)
                horizon = bucket - int(max(WINDOWS_S.values()) // _BUCKET_S)
                while self._buckets and next(iter(self._buckets)) < horizon:
                    self._buckets.popitem(last=False)

    # ------------------------------------------------------------------ totals

    def totals(self) -> dict[str, Any]:
        """Since start and over each window: restored / oracle and the lost tokens by reason,
        plus the shadow's own size (``/admin/status``'s ``oracle``)."""
        with self._lock:
            since = summarize(self._totals)
            windows = {}
            now = self.clock() if self.clock is not None else None
            for name, span in WINDOWS_S.items():
                window: Counter[str] = Counter()
                if now is not None:
                    first = int((now - span) // _BUCKET_S) + 1
                    for bucket, counts in self._buckets.items():
                        if bucket >= first:
                            window.update(counts)
                windows[name] = summarize(window)
        return {"enabled": self.enabled, **since, "windows": windows,
                "shadow": {"blocks": len(self.shadow), "bytes": self.shadow.nbytes,
                           "budget_bytes": self.shadow.budget_bytes, "block_tokens": self.shadow.block,
                           "evicted_blocks": self.shadow.evicted_blocks, "gone_points": len(self.gone)}}


def summarize(counts: Mapping[str, int]) -> dict[str, Any]:
    """Counters as the totals' shape: the ratio restored / oracle (None before any oracle
    token) and the lost tokens by reason, every reason listed."""
    oracle = int(counts.get("oracle_tokens", 0))
    restored = int(counts.get("restored_tokens", 0))
    return {"requests": int(counts.get("requests", 0)), "oracle_tokens": oracle, "restored_tokens": restored,
            "ratio": restored / oracle if oracle else None,
            "lost_tokens": {str(reason): int(counts.get(f"lost:{reason}", 0)) for reason in Lost},
            "elsewhere_requests": int(counts.get("elsewhere_requests", 0))}


def describe(totals: Mapping[str, Any]) -> str:
    """One line for people: "restores 0.97 of what an unbounded cache would; lost: 2 % ram
    budget, 1 % thinning" (``apcctl status``, ``apcctl report``, the dashboard)."""
    if totals.get("enabled") is False:
        return "off (APC_LINEAGE_SHADOW_BUDGET_BYTES=0)"
    oracle = int(totals.get("oracle_tokens") or 0)
    if not oracle:
        return f"no repeated prefix yet ({int(totals.get('requests') or 0)} requests)"
    line = f"restores {totals['restored_tokens'] / oracle:.2f} of what an unbounded cache would"
    lost = sorted(((n, reason) for reason, n in (totals.get("lost_tokens") or {}).items() if n), reverse=True)
    if lost:
        line += "; lost: " + ", ".join(f"{_share(n, oracle)} {reason}" for n, reason in lost)
    if totals.get("elsewhere_requests"):
        line += f"; {totals['elsewhere_requests']} requests shared more with another namespace"
    return line


def _share(part: int, whole: int) -> str:
    share = 100 * part / whole
    return f"{share:.0f} %" if share >= 1 else "<1 %"


__all__ = ["PROMPT", "REPLY", "GoneLog", "Lost", "Miss", "MissBook", "WINDOWS_S", "describe", "ladder", "lost_reason",
           "summarize"]
