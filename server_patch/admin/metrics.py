"""Prometheus exposition of the lineage cache, through prometheus-client's collector API.

mlx-vlm's own ``/metrics`` stays JSON; ours lives at ``/admin/metrics``. Counters and gauges
are read from the cache at scrape time; the per-request histograms
(``integration.request_metrics.RequestMetrics``) are observed once per finished timing record
and owned by the runtime's ``TimingBook``, so a new runtime (a reloaded model) starts them again
and nothing lives in module-global state; this collector yields them at scrape time.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.exposition import generate_latest

from server_patch.canary.metrics import families as canary_families
from server_patch.disk.integrity import FINGERPRINT, FORMAT_REASON, HASH, HEADER, IO, TRUNCATED
from server_patch.lineage.model import COLD, DISK, LOG_KINDS, RAM, RESTORE_KINDS, KVAdmission
from server_patch.lineage.summary import disk_by_point, hits_by_kind, kv_by_mode

if TYPE_CHECKING:
    from server_patch.integration.parts import Parts

REJECT_REASONS = (TRUNCATED, HEADER, FORMAT_REASON, HASH, FINGERPRINT, IO)  # each exported from 0


class LineageCollector(Collector):
    """Reads counters and budgets at scrape time; nothing is updated on the hot path."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def collect(self) -> Iterable:
        idle = self.parts.traffic.snapshot()
        in_flight = GaugeMetricFamily("apc_requests_in_flight", "Inference requests in flight")
        in_flight.add_metric([], idle["in_flight"])
        yield in_flight
        draining = GaugeMetricFamily("apc_draining", "1 while the server refuses new requests")
        draining.add_metric([], 1 if idle["draining"] else 0)
        yield draining
        runtime = self.parts.runtimes.current
        if runtime is None:
            return
        stats = dict(runtime.cache.stats)
        hits = CounterMetricFamily("apc_lineage_restores", "Requests by restore kind", labels=["kind"])
        by_kind = hits_by_kind(stats, known=LOG_KINDS)
        for kind in LOG_KINDS:
            hits.add_metric([kind], by_kind[kind])
        yield hits
        points = CounterMetricFamily("apc_lineage_disk_restores", "Restores from the disk tier (the "
                                     "kind=\"disk\" requests of apc_lineage_restores), by the kind of "
                                     "point their plan restored", labels=["point"])
        by_point = disk_by_point(stats)
        for point in (*(k for k in RESTORE_KINDS if k != COLD), *(p for p in by_point if p not in RESTORE_KINDS)):
            points.add_metric([point], by_point.get(point, 0))
        yield points
        admissions = CounterMetricFamily("apc_lineage_kv_admissions",
                                         "Warm requests by how their KV reached the batch: lent (the "
                                         "entry's own buffer, no copy), copied (one merge copy) or staged "
                                         "(one copy, made off the generation thread while it queued)",
                                         labels=["mode"])
        by_mode = kv_by_mode(stats)
        for mode in KVAdmission:
            admissions.add_metric([mode], by_mode[mode])
        yield admissions
        for name, key, doc in (
            ("apc_lineage_reused_tokens", "reused_tokens", "Prompt tokens restored instead of computed"),
            ("apc_lineage_prefill_tokens", "prefill_tokens", "Prompt tokens computed"),
            ("apc_lineage_evictions", "evictions", "Entries evicted from RAM"),
            ("apc_lineage_evicted_unwritten", "evicted_unwritten", "Entries that left RAM unwritten: "
             "no room in the disk writer's queue, and a commit never waits for the writer"),
            ("apc_lineage_disk_evictions", "disk_evictions", "Files evicted by the disk cap"),
            ("apc_lineage_prefetched", "prefetched", "Disk loads and staged copies of queued requests started "
             "while the batch admitted nothing (full, or a prefill running)"),
            ("apc_lineage_disk_bytes_written", "disk_bytes_written", "Bytes written to the disk tier"),
            ("apc_lineage_absorbs", "absorbs", "Entries absorbed by their extension"),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], stats.get(key, 0))
            yield counter
        yield from _oracle_metrics(runtime.cache.misses.totals())
        yield from runtime.timings.metrics.collect()
        yield from canary_families(self.parts.canary.book)
        if runtime.disk is not None:
            yield from _disk_metrics(runtime.disk.health())
        budgets = runtime.cache.budgets()
        tier = GaugeMetricFamily("apc_lineage_bytes", "Bytes held by tier", labels=["tier"])
        tier.add_metric(["ram_conversations"], budgets["conversation_bytes"])
        tier.add_metric(["ram_anchors"], budgets["anchor_bytes"])
        tier.add_metric([DISK], budgets["disk_used"])
        yield tier
        entries = GaugeMetricFamily("apc_lineage_entries", "Entries held", labels=["tier"])
        entries.add_metric([RAM], budgets["entries"])
        entries.add_metric([DISK], budgets["disk_files"])
        yield entries
        pinned = GaugeMetricFamily("apc_lineage_anchors_pinned", "Pinned anchors, by where they are held "
                                   "(ram: also on disk or not; disk: only their file, until a request "
                                   "restores them)", labels=["tier"])
        pinned.add_metric([RAM], budgets["anchor_count"])
        pinned.add_metric([DISK], budgets.get("pinned_on_disk", 0))
        yield pinned


def _oracle_metrics(totals: dict) -> Iterable[Any]:
    """The live oracle (``lineage.misses``): what an unbounded cache would have restored, and
    why each token it had was not restored (every reason exported from 0)."""
    oracle = CounterMetricFamily("apc_lineage_oracle_tokens", "Prompt tokens an unbounded cache would have "
                                 "restored on the same traffic (the live oracle, block-rounded)")
    oracle.add_metric([], totals["oracle_tokens"])
    yield oracle
    lost = CounterMetricFamily("apc_lineage_lost_tokens", "Oracle tokens not restored, by reason",
                               labels=["reason"])
    for reason, tokens in totals["lost_tokens"].items():
        lost.add_metric([reason], tokens)
    yield lost


def _disk_metrics(health: dict) -> Iterable[Any]:
    rejects = CounterMetricFamily("apc_lineage_disk_rejects", "Disk files removed because they could not "
                                  "be trusted (the request prefilled cold), by reason", labels=["reason"])
    counts = {reason: 0 for reason in REJECT_REASONS}
    counts.update(health["rejects"])
    for reason, count in sorted(counts.items()):
        rejects.add_metric([reason], count)
    yield rejects
    failures = CounterMetricFamily("apc_lineage_disk_write_failures", "Disk writes that failed or were "
                                   "refused (backoff, free-space floor)")
    failures.add_metric([], health["writes"].get("failures", 0) + health["writes"].get("deferred", 0))
    yield failures
    backoff = GaugeMetricFamily("apc_lineage_disk_backoff_seconds", "Current pause between disk write "
                                "attempts after a failure (0: none)")
    backoff.add_metric([], health["backoff_s"])
    yield backoff
    free = GaugeMetricFamily("apc_lineage_disk_free_bytes", "Free bytes on the disk tier's volume")
    free.add_metric([], health["free_bytes"])
    yield free


def exposition(parts: Parts) -> bytes:
    registry = CollectorRegistry()
    registry.register(LineageCollector(parts))
    return generate_latest(registry)
