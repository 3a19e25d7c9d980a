"""Segment checkpoints in the replay: what they buy, what they hold, and policy what-ifs.

``python -m apcctl.sim.segments_whatif [TRACE ...]`` replays each trace (default: the bundled
agent trace and the bundled first-sight trace) through ``lineage``, ``lineage-nosegments`` and
the oracle, plus the what-if variants below, and prints per variant: prefill tokens against the
oracle, checkpoint bytes held at the end and at their peak (against ``lineage-nosegments``,
the post's event-driven design on this storage), and the largest number of captures a single
prefill asked for. ``--gaps`` lists the requests where lineage reuses fewer tokens than the
oracle.

What-ifs (prototypes of policy changes; the policy itself lives in ``server_patch/lineage``):

* ``exact-anchor``: the trace's anchors moved to the system end (+2): the server now puts the
  anchor right before GLM's ``<|user|>`` (a special token) without BPE slack. For traces made
  before that change (the bundled agent trace).
* ``anchor-spread``: a pinned anchor thins its segment checkpoints by the smallest gap to the
  restore point before it, and never its last segment (the tools/system end), instead of
  latest-first. Latest-first is right for a conversation (its early boundaries are what other
  sessions share) and wrong for an anchor, whose restore points serve siblings diverging
  anywhere inside it.
* ``capture-cap``: ``plan_captures`` keeps at most ``max_checkpoints`` segment captures past
  the anchor per prompt, earliest first. A conversation's thinning keeps only its earliest
  segments anyway, so the rest are snapshots held during prefill for nothing (a cold 50-turn
  conversation asks for ~50). Segments inside the anchor's prefix are not capped: the anchor
  adopts and thins them.
* ``gain64``: ``divergence_min_gain=64`` (a config field, no code change).
* ``backward-gap``: a segment needs the minimum gap only from restore points before it.
* ``periodic-yields``: a periodic capture does not count against a segment's gap.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from apcctl.sim.policies.lineage import LineagePolicy
from apcctl.sim.policies.oracle import OraclePolicy
from apcctl.sim.sizes import StateSizes, load_sizes
from apcctl.sim.trace import Request, bundled_trace_path, read_trace
from server_patch.lineage import SEGMENT, LineageCache, LineageConfig
from server_patch.lineage.model import Checkpoint, Entry

GiB = float(1 << 30)


class SpreadAnchorCache(LineageCache):
    """Anchors thin segments by smallest gap to their predecessor, keeping their last segment."""

    def _thin_victim(self, entry: Entry) -> Checkpoint | None:
        if entry.is_anchor:
            segments = sorted((c for c in entry.checkpoints if c.kind == SEGMENT), key=lambda c: c.length)
            if len(segments) > 1:
                points = sorted(c.length for c in entry.checkpoints)
                def gap(cp: Checkpoint) -> int:
                    before = [p for p in points if p < cp.length]
                    return cp.length - (before[-1] if before else 0)
                return min(segments[:-1], key=lambda c: (gap(c), c.length))
        return super()._thin_victim(entry)


class CappedCapturesCache(LineageCache):
    """``plan_captures`` asks for at most ``max_checkpoints`` segments past the anchor (the
    earliest); those inside the anchor's prefix go to the anchor, which thins them itself."""

    def plan_captures(self, tokens, plan, *, namespace="", anchor_len=None, segments=()):
        caps = super().plan_captures(tokens, plan, namespace=namespace, anchor_len=anchor_len, segments=segments)
        kept, seen = [], 0
        for cap in caps:
            if cap.kind == SEGMENT and (anchor_len is None or cap.length >= anchor_len):
                seen += 1
                if seen > self.config.max_checkpoints:
                    continue
            kept.append(cap)
        return kept


class SpreadCappedCache(SpreadAnchorCache, CappedCapturesCache):
    """Both changes."""


def _segment_picks(cache: LineageCache, tokens, plan, caps, segments, *, ignore: tuple[str, ...] = (),
                   backward_only: bool = False):
    """The policy's segment loop over ``caps`` (the other captures), with two knobs."""
    from server_patch.lineage.model import Capture

    cfg = cache.config
    end = len(tokens) - cfg.entry_offset
    start = plan.length
    picks = {c.length: c.kind for c in caps}
    taken = sorted({start, *(n for n, k in picks.items() if k not in ignore)}
                   | (set() if backward_only else {end}))
    for seg in sorted(set(int(x) for x in segments)):
        if not start < seg < end or seg in picks:
            continue
        if all(abs(seg - other) >= cfg.segment_min_gap for other in taken
               if not backward_only or other < seg):
            picks[seg] = SEGMENT
            taken = sorted({*taken, seg})
    return [Capture(n, k) for n, k in sorted(picks.items()) if n >= cfg.min_tokens]


class BackwardGapCache(LineageCache):
    """A segment needs ``segment_min_gap`` only from the restore points *before* it.

    The rule's purpose is that a checkpoint saves enough over the one a prompt would otherwise
    restore at, and that one is the restore point before it. A later point (the entry at n-1,
    an anchor) is no substitute for a prompt that diverges before it: the start of the last
    message is a few dozen tokens before the entry, and an edit of that message needs exactly it.
    """

    def plan_captures(self, tokens, plan, *, namespace="", anchor_len=None, segments=()):
        caps = super().plan_captures(tokens, plan, namespace=namespace, anchor_len=anchor_len, segments=())
        return _segment_picks(self, tokens, plan, caps, segments, backward_only=True)


class PeriodicYieldsCache(LineageCache):
    """A periodic capture does not count against a segment's gap (both are captured).

    The periodic checkpoint is the fallback for structure the server does not know; a template
    boundary 184 tokens after it (the tiny model's tools end after 2048) is the better restore
    point, and thinning drops the periodic one before turn boundaries anyway.
    """

    def plan_captures(self, tokens, plan, *, namespace="", anchor_len=None, segments=()):
        caps = super().plan_captures(tokens, plan, namespace=namespace, anchor_len=anchor_len, segments=())
        return _segment_picks(self, tokens, plan, caps, segments, ignore=("periodic",))


class SpreadYieldsCache(SpreadAnchorCache, PeriodicYieldsCache):
    """Anchor spread thinning and periodic captures that do not block segments."""


class SpreadBackwardCache(SpreadAnchorCache, BackwardGapCache):
    """Anchor spread thinning and the backward-only gap."""


@dataclass
class Outcome:
    name: str
    prefill: int
    reused: list[int]
    checkpoint_end: int
    checkpoint_peak: int
    max_captures: int
    sources: dict[str, int]


def _lineage(sizes: StateSizes, *, segments: bool = True, cache_class: type[LineageCache] = LineageCache,
             config: LineageConfig | None = None) -> LineagePolicy:
    policy = LineagePolicy(sizes, segments=segments, config=config)
    if cache_class is not LineageCache:
        policy.cache = cache_class(policy.cache.config, disk=policy.disk, clock=lambda: policy.now,
                                   on_event=policy._on_event)
    return policy


def _exact_anchor(requests: list[Request]) -> list[Request]:
    return [replace(r, anchor_len=None if r.anchor_len is None else r.anchor_len + 2) for r in requests]


VARIANTS: dict[str, tuple[Callable[[StateSizes], object], Callable[[list[Request]], list[Request]] | None]] = {
    "lineage": (lambda s: _lineage(s), None),
    "lineage-nosegments": (lambda s: _lineage(s, segments=False), None),
    "exact-anchor": (lambda s: _lineage(s), _exact_anchor),  # only for traces with slack anchors
    "anchor-spread": (lambda s: _lineage(s, cache_class=SpreadAnchorCache), None),
    "capture-cap": (lambda s: _lineage(s, cache_class=CappedCapturesCache), None),
    "spread+cap": (lambda s: _lineage(s, cache_class=SpreadCappedCache), None),
    "gain64": (lambda s: _lineage(s, config=LineageConfig(divergence_min_gain=64)), None),
    "backward-gap": (lambda s: _lineage(s, cache_class=BackwardGapCache), None),
    "periodic-yields": (lambda s: _lineage(s, cache_class=PeriodicYieldsCache), None),
    "spread+yields+gain64": (lambda s: _lineage(s, cache_class=SpreadYieldsCache,
                                                config=LineageConfig(divergence_min_gain=64)), None),
    "spread+backward": (lambda s: _lineage(s, cache_class=SpreadBackwardCache), None),
    "spread+backward+gain64": (lambda s: _lineage(s, cache_class=SpreadBackwardCache,
                                                  config=LineageConfig(divergence_min_gain=64)), None),
    "spread+gain64": (lambda s: _lineage(s, cache_class=SpreadAnchorCache,
                                         config=LineageConfig(divergence_min_gain=64)), None),
}


def run(requests: list[Request], name: str, make: Callable[[StateSizes], object], sizes: StateSizes,
        transform: Callable[[list[Request]], list[Request]] | None = None) -> Outcome:
    policy = make(sizes)
    reqs = transform(requests) if transform else requests
    reused, peak, sources = [], 0, {}
    cache = getattr(policy, "cache", None)
    original = cache.plan_captures if cache is not None else None
    counted = [0]
    if cache is not None:
        def counting(*args, **kwargs):
            caps = original(*args, **kwargs)
            counted[0] = max(counted[0], len(caps))
            return caps
        cache.plan_captures = counting  # instance attribute: counts what each prefill asks for
    for req in reqs:
        served = policy.serve(req)
        reused.append(served.reused)
        sources[served.source] = sources.get(served.source, 0) + 1
        peak = max(peak, policy.checkpoint_bytes())
    policy.finish(reqs[-1].t if reqs else 0.0)
    end = policy.checkpoint_bytes()
    prefill = sum(r.n - u for r, u in zip(reqs, reused))
    return Outcome(name, prefill, reused, end, max(peak, end), counted[0], dict(sorted(sources.items())))


def measure(requests: list[Request], sizes: StateSizes, names: Iterable[str] = tuple(VARIANTS)) -> dict[str, Outcome]:
    out = {"oracle": run(requests, "oracle", lambda s: OraclePolicy(), sizes)}
    for name in names:
        make, transform = VARIANTS[name]
        out[name] = run(requests, name, make, sizes, transform)
    return out


def report(trace_name: str, results: dict[str, Outcome], gaps: bool = False,
           requests: list[Request] | None = None) -> str:
    oracle = results["oracle"]
    base = results.get("lineage-nosegments")
    lines = [f"{trace_name}: oracle prefill {oracle.prefill:,} tokens",
             f"  {'variant':<20} {'prefill':>9} {'x oracle':>9} {'ckpt end':>10} {'ckpt peak':>10} "
             f"{'end x noseg':>11} {'peak x noseg':>12} {'max caps':>8}"]
    for name, o in results.items():
        if name == "oracle":
            continue
        ratio_end = o.checkpoint_end / base.checkpoint_end if base and base.checkpoint_end else float("nan")
        ratio_peak = o.checkpoint_peak / base.checkpoint_peak if base and base.checkpoint_peak else float("nan")
        lines.append(f"  {name:<20} {o.prefill:>9,} {o.prefill / oracle.prefill:>9.4f} "
                     f"{o.checkpoint_end / GiB:>8.2f}Gi {o.checkpoint_peak / GiB:>8.2f}Gi "
                     f"{ratio_end:>11.3f} {ratio_peak:>12.3f} {o.max_captures:>8}")
    if gaps and requests is not None:
        lineage = results["lineage"]
        for req, mine, best in zip(requests, lineage.reused, oracle.reused):
            if best - mine > 3:
                lines.append(f"    #{req.index} {req.conv} {req.kind} n={req.n} lineage={mine} oracle={best} "
                             f"gap={best - mine}")
    return "\n".join(lines)


def bundled_firstsight_path(tool_boundaries: bool = False) -> Path:
    name = "firstsight-tools.jsonl" if tool_boundaries else "firstsight.jsonl"
    return bundled_trace_path().with_name(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apcctl.sim.segments_whatif", description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--model-config", default="full")
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--gaps", action="store_true", help="list requests where lineage reuses less than the oracle")
    args = parser.parse_args(argv)
    sizes = load_sizes(args.model_config)
    traces = args.traces or [bundled_trace_path(), bundled_firstsight_path(), bundled_firstsight_path(True)]
    for path in traces:
        loaded = read_trace(path)
        requests = loaded.in_time_order()
        names = args.variant or tuple(VARIANTS)
        if loaded.meta.get("anchor_slack") != 2:  # anchors already exact: nothing to move
            names = tuple(n for n in names if n != "exact-anchor")
        results = measure(requests, sizes, names)
        print(report(path.name, results, args.gaps, requests))


if __name__ == "__main__":
    main()
