"""/admin/metrics as a Prometheus scraper and the shipped Grafana dashboard see it.

The real patched server on the tiny model serves a few requests; the scrape must then hold
every metric that a panel of docs/grafana-apcctl.json queries, the per-request histograms must
have moved by exactly the number of requests (per restore kind, as /admin/requests reports
them), and docs/metrics.md must document every metric family the server exports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import PatchedServer, text
from server_patch.integration.request_metrics import REQUEST_KINDS, SECONDS_BUCKETS, STAGES, RequestMetrics
from server_patch.integration.timings import RequestTiming

DOCS = Path(__file__).resolve().parents[2] / "docs"
DASHBOARD = DOCS / "grafana-apcctl.json"
METRIC_NAME = re.compile(r"\bapc_[a-z0-9_]+")
SYSTEM = {"role": "system", "content": "You are the metrics test's assistant. " + text(40, seed=7)}


def samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(scrape: dict, name: str, **labels: str) -> float:
    """Sum of every sample called ``name`` whose labels include ``labels``."""
    return sum(value for (sample, got), value in scrape.items()
               if sample == name and set(labels.items()) <= set(got))


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found


def scrape(server: PatchedServer) -> tuple[str, dict]:
    status, body = server.admin("GET", "/metrics")
    assert status == 200, body
    return body, samples(body)


def test_request_metrics_count_each_record_once_by_kind() -> None:
    """Unit: a record lands in its kind's buckets; token counters split restored and prefilled."""
    metrics = RequestMetrics()
    record = RequestTiming(seq=1, started=0.0, prompt_tokens=100, restore_kind="anchor", restored_tokens=60,
                           lookup_ms=0.4, admission_ms=2.0, prefill_ms=30.0, ttft_ms=45.0)
    metrics.observe(record)
    metrics.observe(RequestTiming(seq=2, started=0.0, prompt_tokens=50, restore_kind="odd-kind", ttft_ms=700_000))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.collect() for s in f.samples}
    assert got[("apc_request_ttft_seconds_count", (("kind", "anchor"),))] == 1
    assert got[("apc_request_ttft_seconds_bucket", (("kind", "anchor"), ("le", "0.025")))] == 0
    assert got[("apc_request_ttft_seconds_bucket", (("kind", "anchor"), ("le", "0.05")))] == 1
    assert got[("apc_request_lookup_seconds_bucket", (("kind", "anchor"), ("le", "0.001")))] == 1
    assert got[("apc_request_reused_tokens_total", (("kind", "anchor"),))] == 60
    assert got[("apc_request_prefilled_tokens_total", (("kind", "anchor"),))] == 40
    # An unknown kind counts as cold; past 10 minutes only +Inf holds it.
    assert got[("apc_request_ttft_seconds_count", (("kind", "cold"),))] == 1
    assert got[("apc_request_ttft_seconds_bucket", (("kind", "cold"), ("le", "600.0")))] == 0
    assert got[("apc_request_ttft_seconds_bucket", (("kind", "cold"), ("le", "+Inf")))] == 1
    assert SECONDS_BUCKETS[0] == 0.001 and SECONDS_BUCKETS[-1] == 600.0
    for kind in REQUEST_KINDS:  # every kind's series exists before its first request
        assert ("apc_request_prefill_seconds_count", (("kind", kind),)) in got


@pytest.mark.server
def test_the_dashboard_queries_only_what_the_server_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = panel_exprs(dashboard)
    assert len(exprs) >= 10
    with PatchedServer(tiny_model_dir, log_dir=tmp_path) as server:
        server.chat([SYSTEM, {"role": "user", "content": "first question"}], max_tokens=3)  # the runtime starts
        _, before = scrape(server)
        messages = [SYSTEM, {"role": "user", "content": "first question"}]
        for turn in range(3):  # a conversation, then a second session on the same system prompt
            reply = server.chat(messages, max_tokens=3)
            messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "."},
                         {"role": "user", "content": f"follow-up {turn} " + text(6, seed=turn)}]
        server.chat([SYSTEM, {"role": "user", "content": "another session"}], max_tokens=3)
        exposition, after = scrape(server)
        status, body = server.admin("GET", "/requests?since=1")
        assert status == 200
        records = body["requests"]

    assert len(records) == 4
    kinds = {r["restore_kind"] for r in records}
    assert kinds - {"cold"}, records  # something restored, so the warm series moved too
    for stage, _, _ in STAGES:
        name = f"apc_request_{stage}_seconds_count"
        assert total(after, name) - total(before, name) == len(records), stage
        for kind in kinds:
            moved = total(after, name, kind=kind) - total(before, name, kind=kind)
            assert moved == sum(r["restore_kind"] == kind for r in records), (stage, kind)
        assert total(after, f"apc_request_{stage}_seconds_bucket", le="+Inf") == total(after, name)
    for kind in kinds:
        mine = [r for r in records if r["restore_kind"] == kind]
        reused = total(after, "apc_request_reused_tokens_total", kind=kind) - \
            total(before, "apc_request_reused_tokens_total", kind=kind)
        prefilled = total(after, "apc_request_prefilled_tokens_total", kind=kind) - \
            total(before, "apc_request_prefilled_tokens_total", kind=kind)
        assert reused == sum(r["restored_tokens"] for r in mine)
        assert prefilled == sum(r["prompt_tokens"] - r["restored_tokens"] for r in mine)

    exported = {name for name, _ in after}
    for title, expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, f"panel {title!r} queries no apc_ metric: {expr}"
        missing = set(names) - exported
        assert not missing, f"panel {title!r} queries {sorted(missing)}, which /admin/metrics does not export"

    documented = (DOCS / "metrics.md").read_text(encoding="utf-8")
    for family in text_string_to_metric_families(exposition):
        if family.name.endswith("_created"):  # prometheus-client's start time of every counter and histogram
            continue
        assert f"`{family.name}" in documented, f"{family.name} is not in docs/metrics.md"
