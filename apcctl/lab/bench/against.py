"""``--against REF`` of ``bench ttft`` and ``bench stall``: the same bench run on the server of
another revision of this repository, interleaved with the current tree's ``patched`` mode.

The revision is checked out with ``git worktree add --detach`` in the bench's workdir (removed
afterwards); its server starts from that tree (``cwd`` and ``PYTHONPATH``) with the same venv, as
mode ``patched@REF``. Both servers run side by side and the bench alternates between them turn by
turn (ttft) or scenario by scenario (stall), so the box's load falls on both alike: the ratio of
their medians is what counts, its spread over the paired turns is its noise.
"""

from __future__ import annotations

import statistics
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

BASE = "patched"  # the current tree's mode every ``patched@REF`` is compared with


class AgainstError(RuntimeError):
    """The revision is unknown, or the working directory is not in a git repository."""


@dataclass(frozen=True)
class Against:
    """The other revision: as asked, the commit it names and its worktree."""

    ref: str
    commit: str
    tree: Path

    @property
    def mode(self) -> str:
        return f"{BASE}@{self.ref}"


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise AgainstError(done.stderr.strip() or f"git {' '.join(args)} failed")
    return done.stdout.strip()


def resolve(ref: str) -> tuple[Path, str]:
    """The top of the repository holding the working directory, and the commit ``ref`` names."""
    try:
        top = Path(_git(Path.cwd(), "rev-parse", "--show-toplevel"))
    except AgainstError:
        raise AgainstError(f"needs a git repository: {Path.cwd()} is not in one") from None
    try:
        return top, _git(top, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except AgainstError:
        raise AgainstError(f"unknown revision {ref!r} in {top}") from None


@contextmanager
def worktree(ref: str, workdir: Path) -> Iterator[Against]:
    """A detached worktree of ``ref`` under ``workdir``, removed on the way out."""
    top, commit = resolve(ref)
    tree = workdir / f"tree-{commit[:12]}"
    _git(top, "worktree", "add", "--detach", str(tree), commit)
    try:
        yield Against(ref, commit, tree)
    finally:
        _git(top, "worktree", "remove", "--force", str(tree))


def base_mode(mode: str) -> str:
    """The mode whose settings ``mode`` runs with: ``patched`` for ``patched@REF``."""
    return mode.partition("@")[0]


def groups(modes: list[str]) -> list[list[str]]:
    """``modes`` in order, each ``patched@REF`` joined to the group of ``patched`` (run interleaved)."""
    out: list[list[str]] = []
    for mode in modes:
        group = next((g for g in out if "@" in mode and g[0] == base_mode(mode)), None)
        if group is None:
            out.append([mode])
        else:
            group.append(mode)
    return out


def ratio(other: float | None, base: float | None) -> float | None:
    return round(other / base, 2) if other and base else None


def _spread(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """The ratio of the medians, and the least and greatest ratio of one pair (the noise)."""
    ratios = [o / b for o, b in pairs if b]
    return {"ratio": ratio(statistics.median(o for o, _ in pairs), statistics.median(b for _, b in pairs))
            if pairs else None, "pairs": len(ratios),
            "min": round(min(ratios), 2) if ratios else None, "max": round(max(ratios), 2) if ratios else None}


def compare_ttft(result: dict[str, Any], mode: str) -> dict[str, Any]:
    """``mode`` against ``patched``: the warm turns' client and server TTFT, paired turn by turn."""
    mine, base = result["turns"][mode], result["turns"][BASE]
    warm = [(o, b) for o, b in zip(mine[1:], base[1:]) if o["restored_tokens"] > 0 and b["restored_tokens"] > 0]
    server = [(o["server"]["ttft_ms"], b["server"]["ttft_ms"]) for o, b in warm
              if "ttft_ms" in o["server"] and "ttft_ms" in b["server"]]
    return {"mode": mode, "base": BASE, "ttft_ms": _spread([(o["ttft_ms"], b["ttft_ms"]) for o, b in warm]),
            "server_ttft_ms": _spread(server)}


def compare_stall(result: dict[str, Any], mode: str) -> dict[str, Any]:
    """``mode`` against ``patched``, per scenario: the victim's gaps with the event (p50, p99, max),
    the event's time, the server's worst gap and its parts (where both servers split it)."""
    rows = {(r["scenario"], r["mode"]): r for r in result["rows"]}
    out: dict[str, Any] = {"mode": mode, "base": BASE, "scenarios": {}}
    for scenario in result["scenarios"]:
        o, b = rows.get((scenario, mode)), rows.get((scenario, BASE))
        if o is None or b is None:
            continue
        if scenario == "canary-load":
            out["scenarios"][scenario] = {"ttft_with": ratio(o.get("ttft_with_median"), b.get("ttft_with_median")),
                                          "ttft_alone": ratio(o.get("ttft_alone_median"), b.get("ttft_alone_median"))}
            continue
        cmp = {f"gap_{k}": ratio(o["with_event"][k], b["with_event"][k]) for k in ("p50", "p99", "max")}
        cmp["alone_max"] = ratio(o["alone"]["max"], b["alone"]["max"])
        cmp["event_ms"] = ratio(o["event_ms"], b["event_ms"])
        worst_o = (o.get("server_gaps") or {}).get("worst_gap") or {}
        worst_b = (b.get("server_gaps") or {}).get("worst_gap") or {}
        cmp["worst_gap_ms"] = ratio(worst_o.get("ms"), worst_b.get("ms"))
        parts_o, parts_b = worst_o.get("parts") or {}, worst_b.get("parts") or {}
        cmp["parts_ms"] = {p: [round(parts_o.get(p, 0.0)), round(parts_b.get(p, 0.0))]  # both split it, or none
                           for p in sorted(set(parts_o) | set(parts_b))} if parts_o and parts_b else {}
        cmp["split_by"] = [m for m, parts in ((mode, parts_o), (BASE, parts_b)) if parts]
        out["scenarios"][scenario] = cmp
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ttft_lines(cmp: dict[str, Any]) -> list[str]:
    lines = [f"{cmp['mode']} ({cmp.get('commit', '')[:12]}) / {cmp['base']} (warm turns interleaved; "
             f"median over median, and the least and greatest ratio of one turn's pair):"]
    for key, label in (("ttft_ms", "TTFT, client"), ("server_ttft_ms", "TTFT, server")):
        s = cmp[key]
        lines.append(f"  {label}: {_x(s['ratio'])} ({s['pairs']} pairs: {_x(s['min'])} - {_x(s['max'])})")
    return lines


def stall_lines(cmp: dict[str, Any]) -> list[str]:
    lines = [f"{cmp['mode']} ({cmp.get('commit', '')[:12]}) / {cmp['base']} per scenario (scenarios interleaved):"]
    for scenario, c in cmp["scenarios"].items():
        if scenario == "canary-load":
            lines.append(f"  {scenario:<18} TTFT with the canary loading {_x(c['ttft_with'])}, "
                         f"alone {_x(c['ttft_alone'])}")
            continue
        parts = ", ".join(f"{p} {a}/{b}" for p, (a, b) in c["parts_ms"].items() if a or b)
        lines.append(f"  {scenario:<18} gap with event p50 {_x(c['gap_p50'])} p99 {_x(c['gap_p99'])} "
                     f"max {_x(c['gap_max'])} (alone max {_x(c['alone_max'])}); event {_x(c['event_ms'])}; "
                     f"server's worst gap {_x(c['worst_gap_ms'])}" + (f" (ms, {cmp['mode']}/{cmp['base']}: "
                                                                      f"{parts})" if parts else "")
                     + ("" if parts or len(c["split_by"]) != 1 else f" (split by {c['split_by'][0]} only)"))
    return lines
