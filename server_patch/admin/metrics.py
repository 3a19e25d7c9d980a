"""Prometheus exposition of the lineage cache, through prometheus-client's collector API.

mlx-vlm's own ``/metrics`` stays JSON; ours lives at ``/admin/metrics``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.exposition import generate_latest

from server_patch.lineage import RESTORE_KINDS


class LineageCollector(Collector):
    """Reads counters and budgets at scrape time; nothing is updated on the hot path."""

    def __init__(self, runtime_getter: Callable[[], Any], traffic: Any) -> None:
        self.runtime_getter = runtime_getter
        self.traffic = traffic

    def collect(self) -> Iterable:
        idle = self.traffic.snapshot()
        in_flight = GaugeMetricFamily("apc_requests_in_flight", "Inference requests in flight")
        in_flight.add_metric([], idle["in_flight"])
        yield in_flight
        draining = GaugeMetricFamily("apc_draining", "1 while the server refuses new requests")
        draining.add_metric([], 1 if idle["draining"] else 0)
        yield draining
        runtime = self.runtime_getter()
        if runtime is None:
            return
        stats = dict(runtime.cache.stats)
        hits = CounterMetricFamily("apc_lineage_restores", "Requests by restore kind", labels=["kind"])
        for kind in (*RESTORE_KINDS, "disk"):
            hits.add_metric([kind], stats.get(f"hits_{kind}", 0))
        yield hits
        admissions = CounterMetricFamily("apc_lineage_kv_admissions",
                                         "Warm requests by how their KV reached the batch: lent (the "
                                         "entry's own buffer, no copy) or copied (one merge copy)",
                                         labels=["mode"])
        for mode in ("lent", "copied"):
            admissions.add_metric([mode], stats.get(f"kv_{mode}", 0))
        yield admissions
        for name, key, doc in (
            ("apc_lineage_reused_tokens", "reused_tokens", "Prompt tokens restored instead of computed"),
            ("apc_lineage_prefill_tokens", "prefill_tokens", "Prompt tokens computed"),
            ("apc_lineage_evictions", "evictions", "Entries evicted from RAM"),
            ("apc_lineage_disk_evictions", "disk_evictions", "Files evicted by the disk cap"),
            ("apc_lineage_disk_bytes_written", "disk_bytes_written", "Bytes written to the disk tier"),
            ("apc_lineage_absorbs", "absorbs", "Entries absorbed by their extension"),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], stats.get(key, 0))
            yield counter
        if runtime.disk is not None:
            yield from _disk_metrics(runtime.disk.health())
        budgets = runtime.cache.budgets()
        tier = GaugeMetricFamily("apc_lineage_bytes", "Bytes held by tier", labels=["tier"])
        tier.add_metric(["ram_conversations"], budgets["conversation_bytes"])
        tier.add_metric(["ram_anchors"], budgets["anchor_bytes"])
        tier.add_metric(["disk"], budgets["disk_used"])
        yield tier
        entries = GaugeMetricFamily("apc_lineage_entries", "Entries held", labels=["tier"])
        entries.add_metric(["ram"], budgets["entries"])
        entries.add_metric(["disk"], budgets["disk_files"])
        yield entries


def _disk_metrics(health: dict) -> Iterable[Any]:
    rejects = CounterMetricFamily("apc_lineage_disk_rejects", "Disk files removed because they could not "
                                  "be trusted (the request prefilled cold), by reason", labels=["reason"])
    for reason, count in sorted(health["rejects"].items()):
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


def exposition(runtime_getter: Callable[[], Any], traffic: Any) -> bytes:
    registry = CollectorRegistry()
    registry.register(LineageCollector(runtime_getter, traffic))
    return generate_latest(registry)
