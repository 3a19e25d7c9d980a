"""Prometheus exposition of the lineage cache, through prometheus-client's collector API.

mlx-vlm's own ``/metrics`` stays JSON; ours lives at ``/admin/metrics``. Counters and gauges
are read from the cache at scrape time; the per-request histograms (``RequestMetrics``) are
observed once per finished timing record and owned by the runtime's ``TimingBook``, so a new
runtime (a reloaded model) starts them again and nothing lives in module-global state.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.exposition import generate_latest

from server_patch.canary.metrics import families as canary_families
from server_patch.drift.causes import Cause
from server_patch.disk.integrity import FINGERPRINT, FORMAT_REASON, HASH, HEADER, IO, TRUNCATED
from server_patch.integration.waits import WORK_KINDS
from server_patch.lineage.model import COLD, DISK, LOG_KINDS, RAM, RESTORE_KINDS, KVAdmission
from server_patch.lineage.summary import disk_by_point, hits_by_kind, kv_by_mode

if TYPE_CHECKING:
    from server_patch.integration.parts import Parts

# Seconds, 1 ms to 10 min: a warm lookup is a millisecond, a cold 100k-token prefill minutes.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0)
REJECT_REASONS = (TRUNCATED, HEADER, FORMAT_REASON, HASH, FINGERPRINT, IO)  # each exported from 0
REQUEST_KINDS = LOG_KINDS  # the restore kinds a timing record can carry
# (metric stage, record field, help): where a request's time to first token went.
STAGES = (
    ("ttft", "ttft_ms", "Time to first token"),
    ("lookup", "lookup_ms", "Lineage lookup and restore planning (part of admission)"),
    ("admission", "admission_ms", "Admission: lookup plus the KV merge into the batch"),
    ("prefill", "prefill_ms", "Prefill of the prompt tokens not restored"),
)


class RequestMetrics:
    """Histograms and token counters of finished requests, labelled by restore kind.

    Registered in no registry: ``LineageCollector`` yields them at scrape time. Every kind's
    series exists from the start (at 0), so ``rate()`` and dashboards see them before traffic.
    """

    def __init__(self) -> None:
        self.seconds = {stage: Histogram(f"apc_request_{stage}_seconds", f"{doc}, by restore kind", ["kind"],
                                         registry=None, buckets=SECONDS_BUCKETS)
                        for stage, _, doc in STAGES}
        self.reused = Counter("apc_request_reused_tokens", "Prompt tokens restored from the cache, "
                              "by restore kind of the request", ["kind"], registry=None)
        self.prefilled = Counter("apc_request_prefilled_tokens", "Prompt tokens prefilled (not "
                                 "restored), by restore kind of the request", ["kind"], registry=None)
        for kind in REQUEST_KINDS:
            for metric in self.all():
                metric.labels(kind)
        # Per request, once its row ended: how long it waited for other requests' work on the
        # generation thread, by what that work was (``integration.waits.Work``; 0 observed too).
        self.waited = Histogram("apc_request_waited_seconds", "Time a request waited for other requests' "
                                "work on the generation thread (prefill chunks, restores, commits, disk "
                                "loads), by work", ["work"], registry=None, buckets=SECONDS_BUCKETS)
        for work in WORK_KINDS:
            self.waited.labels(work)
        # What clients changed in their prompts (``server_patch.drift``), by cause (each from 0).
        self.drift = Counter("apc_client_drift", "Requests whose prompt parted from the nearest earlier one "
                             "of their namespace by a client change, by cause", ["cause"], registry=None)
        self.drift_tokens = Counter("apc_client_drift_tokens", "Tokens of the earlier prompt past each such "
                                    "divergence (what the change put out of reach), by cause", ["cause"],
                                    registry=None)
        for cause in Cause:
            self.drift.labels(str(cause))
            self.drift_tokens.labels(str(cause))

    def all(self) -> list[Any]:
        return [*self.seconds.values(), self.reused, self.prefilled]

    def observe(self, record: Any) -> None:
        """One finished ``RequestTiming``: its stage times and tokens."""
        kind = record.restore_kind if record.restore_kind in REQUEST_KINDS else COLD
        for stage, field, _ in STAGES:
            self.seconds[stage].labels(kind).observe(max(0.0, float(getattr(record, field))) / 1000)
        restored = max(0, int(record.restored_tokens))
        self.reused.labels(kind).inc(restored)
        self.prefilled.labels(kind).inc(max(0, int(record.prompt_tokens) - restored))
        if (drift := getattr(record, "drift", None)) and drift.get("cause") in Cause._value2member_map_:
            self.drift.labels(drift["cause"]).inc()
            self.drift_tokens.labels(drift["cause"]).inc(max(0, int(drift.get("tokens", 0))))

    def observe_waits(self, record: Any) -> None:
        """One request whose row ended: what it waited for, by work."""
        for work in WORK_KINDS:
            self.waited.labels(work).observe(max(0.0, float(record.waited.get(work, 0.0))) / 1000)

    def collect(self) -> Iterable[Any]:
        for metric in (*self.all(), self.waited, self.drift, self.drift_tokens):
            yield from metric.collect()


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
