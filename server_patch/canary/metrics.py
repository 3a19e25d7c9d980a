"""The canary's Prometheus families, read at scrape time from its book."""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server_patch.canary.book import Book


def families(book: Book) -> Iterable[Any]:
    """``apc_lineage_canary_total{result}``, the last max |difference| and its tolerance, and
    ``apc_lineage_canary_suspect{kind}`` (1 per restore kind a failed check marked)."""
    summary = book.summary()
    total = CounterMetricFamily("apc_lineage_canary", "Canary checks (restore vs cold prefill) by result",
                                labels=["result"])
    for result, count in summary["counts"].items():
        total.add_metric([result], count)
    yield total
    last = summary["last"] or {}
    diff = GaugeMetricFamily("apc_lineage_canary_last_max_abs_diff",
                             "Max |restored - cold| next-token logit of the last compared check")
    diff.add_metric([], float(last.get("max_abs_diff", 0.0)))
    yield diff
    tol = GaugeMetricFamily("apc_lineage_canary_last_tolerance", "Tolerance the last compared check used")
    tol.add_metric([], float(last.get("tolerance", 0.0)))
    yield tol
    suspect = GaugeMetricFamily("apc_lineage_canary_suspect",
                                "1 while a failed check marks this restore kind suspect", labels=["kind"])
    for kind in sorted(summary["suspects"]):
        suspect.add_metric([kind], 1)
    yield suspect
