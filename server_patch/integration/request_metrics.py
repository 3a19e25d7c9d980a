"""The per-request Prometheus histograms and counters, observed by the request's timing book.

Owned by the runtime's ``TimingBook`` (``integration.timings``), which observes each finished
record once, and yielded at scrape time by ``admin.metrics.LineageCollector``. They live here,
next to the records they read, so the timing book never imports the admin HTTP surface (which
imports the integration back: issue 35's package knot). Registered in no registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Union

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from server_patch.integration.timings import RequestTiming

from server_patch.drift.causes import Cause
from server_patch.integration.waits import WORK_KINDS
from server_patch.lineage.model import COLD, LOG_KINDS

# Seconds, 1 ms to 10 min: a warm lookup is a millisecond, a cold 100k-token prefill minutes.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0)
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

    def all(self) -> list[Union[Histogram, Counter]]:
        return [*self.seconds.values(), self.reused, self.prefilled]

    def observe(self, record: RequestTiming) -> None:
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

    def observe_waits(self, record: RequestTiming) -> None:
        """One request whose row ended: what it waited for, by work."""
        for work in WORK_KINDS:
            self.waited.labels(work).observe(max(0.0, float(record.waited.get(work, 0.0))) / 1000)

    def collect(self) -> Iterable[Metric]:
        for metric in (*self.all(), self.waited, self.drift, self.drift_tokens):
            yield from metric.collect()
