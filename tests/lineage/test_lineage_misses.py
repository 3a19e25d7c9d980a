"""Every miss explained (``server_patch.lineage.misses``) through the request flow the server and
the simulator share (``lineage.flow.Admission``): each lost-token reason forced by a cache that
must lose tokens that way, the ladder that splits a loss, the totals, and the live oracle equal
to the simulator's seen oracle on the bundled trace, request by request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from apcctl.lab.sim.policies.lineage import LineagePolicy
from apcctl.lab.sim.policies.seen import SeenOraclePolicy
from apcctl.lab.sim.sizes import load_sizes
from apcctl.lab.sim.trace import read_trace
from server_patch.lineage import DiskRecord, Entry, LineageCache, LineageConfig, SizedKV, SizedSnapshot
from server_patch.lineage.flow import Admission
from server_patch.lineage.misses import Lost, ladder
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")

TRACE = Path(__file__).resolve().parents[2] / "apcctl" / "lab" / "sim" / "traces" / "agents.jsonl"
KV_PER_TOKEN, SNAP = 100, 1000


def ids(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(10, 150_000, n).astype(np.int32)


def cache(**config: object) -> LineageCache:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    return LineageCache(LineageConfig(**config), clock=clock)


def serve(c: LineageCache, prompt: np.ndarray, namespace: str = "", *, reply: np.ndarray | None = None,
          segments: tuple[int, ...] = (), **admit: object) -> Admission:
    """One request as the simulator serves it: admit, count, captures, commit (or commit_reply)."""
    flow = Admission.admit(c, prompt, namespace, **admit)
    if flow.plan.hit:
        flow.restored()
    else:
        flow.cold()
    taken = {cap.length: (cap.kind, SizedSnapshot(SNAP)) for cap in flow.captures(segments=segments)}
    n = int(prompt.shape[0])
    if reply is not None:
        flow.commit_reply(reply, kv=SizedKV(KV_PER_TOKEN, n + int(reply.shape[0])), head=SizedSnapshot(SNAP),
                          prompt_head=SizedSnapshot(SNAP), captures=taken)
    else:
        flow.commit(kv=SizedKV(KV_PER_TOKEN, n - 1), head=SizedSnapshot(SNAP), captures=taken)
    return flow


def test_ladder_gives_each_span_to_the_nearest_point_above() -> None:
    steps = [(100, "a"), (60, "b"), (200, "c"), (60, "late tie")]
    assert ladder(20, 160, [*steps, (160, "rest")]) == {"b": 40, "a": 40, "c": 60}
    assert ladder(20, 160, [(10, "below"), (160, "rest")]) == {"rest": 140}
    assert ladder(160, 160, steps) == {} and ladder(170, 160, steps) == {}


def test_a_resend_restores_all_the_oracle_and_loses_nothing() -> None:
    c = cache()
    prompt = ids(300, 1)
    first = serve(c, prompt)
    assert first.miss.oracle == 0 and first.miss.lost == {}
    again = serve(c, prompt)
    assert again.miss.oracle == 288 and again.miss.restored == 299 and again.miss.lost == {}
    totals = c.misses.totals()
    assert totals["requests"] == 2 and totals["oracle_tokens"] == 288 and totals["ratio"] == 1.0


def test_ram_budget() -> None:
    c = cache(ram_budget_bytes=KV_PER_TOKEN * 400)  # room for one conversation
    a, b = ids(300, 1), ids(300, 2)
    serve(c, a)
    serve(c, b)  # pushes a out (no disk tier)
    flow = serve(c, a)
    assert flow.miss.restored == 0 and flow.miss.lost == {Lost.RAM_BUDGET: 288}
    totals = c.misses.totals()
    assert totals["lost_tokens"][Lost.RAM_BUDGET] == 288 and totals["ratio"] == 0.0
    assert totals["windows"]["5m"]["lost_tokens"][Lost.RAM_BUDGET] == 288


def test_operator_evict() -> None:
    c = cache()
    a = ids(300, 1)
    serve(c, a)
    (entry,) = c.entries()
    c.evict(entry.id)
    assert serve(c, a).miss.lost == {Lost.OPERATOR: 288}


def test_thinned_checkpoint_then_no_restore_point() -> None:
    c = cache(max_checkpoints=1)
    base = ids(900, 1)
    for n in (300, 600, 900):  # three turns: the first turn's end is thinned at the third
        serve(c, base[:n])
    (entry,) = c.entries()
    assert [cp.length for cp in entry.checkpoints] == [599] and c.stats["thinned"] == 1
    diverged = np.concatenate([base[:350], ids(250, 2)])
    flow = serve(c, diverged)
    assert flow.miss.restored == 0
    assert flow.miss.oracle == 336
    assert flow.miss.lost == {Lost.THINNED: 288, Lost.NO_POINT: 48}  # the point at 299, then 299..336


class _Disk:
    """A disk tier that writes at once and reads back a file that fails validation."""

    def __init__(self) -> None:
        self.files: dict[str, DiskRecord] = {}

    def records(self) -> list[DiskRecord]:
        return list(self.files.values())

    def write(self, entry: Entry, done) -> None:
        record = DiskRecord(entry.id, entry.tokens.copy(), entry.namespace,
                            tuple((cp.length, cp.kind) for cp in entry.checkpoints), entry.nbytes, 0.0)
        self.files[record.id] = record
        done(entry, record)

    def delete(self, record_id: str) -> None:
        self.files.pop(record_id, None)

    def load_checked(self, record: DiskRecord) -> tuple[Entry | None, str]:
        return None, "weights hash mismatch"


def test_disk_file_rejected_says_why_and_a_refused_disk_tier_is_the_canary() -> None:
    disk = _Disk()
    c = LineageCache(LineageConfig(ram_budget_bytes=KV_PER_TOKEN * 400), disk=disk)
    a, b = ids(300, 1), ids(300, 2)
    serve(c, a)
    serve(c, b)  # a is written and leaves RAM
    refused = serve(c, a, disk=disk, disk_refused=lambda: True)
    assert refused.miss.lost == {Lost.CANARY: 288}  # a's resend committed: b left RAM for disk
    flow = serve(c, b, disk=disk)
    assert flow.miss.lost == {Lost.DISK_REJECTED: 288} and flow.miss.detail == "weights hash mismatch"
    assert flow.miss.restored == 0


def test_refused_restores_count_for_their_reason() -> None:
    c = cache()
    a = ids(300, 1)
    serve(c, a)
    flow = Admission.admit(c, a)
    flow.refuse(Lost.LOAN)
    flow.cold()
    assert flow.miss.lost == {Lost.LOAN: 288}
    flow = Admission.admit(c, a)
    flow.refuse(Lost.CANARY)
    flow.refuse()  # a second refusal (the build that never ran) adds nothing
    flow.cold()
    assert flow.miss.lost == {Lost.CANARY: 288}


def test_a_prompt_that_diverges_inside_the_kept_reply() -> None:
    c = cache()
    prompt, reply = ids(200, 1), ids(100, 2)
    serve(c, prompt, reply=reply)
    edited = np.concatenate([prompt, reply[:60], ids(40, 3)])  # the template re-rendered 60 of 100
    flow = serve(c, edited)
    assert flow.miss.restored == 199  # the protected prompt end
    assert flow.miss.oracle == 256 and flow.miss.lost == {Lost.REPLY: 57}


def test_other_namespaces_are_counted_never_matched() -> None:
    c = cache()
    a = ids(300, 1)
    serve(c, a, "tenant-a")
    flow = serve(c, a, "tenant-b")
    assert flow.miss.oracle == 0 and flow.miss.elsewhere
    assert c.misses.totals()["elsewhere_requests"] == 1


def test_off_counts_nothing() -> None:
    c = cache(shadow_budget_bytes=0)
    a = ids(300, 1)
    serve(c, a)
    assert serve(c, a).miss.oracle == 0
    assert c.misses.totals()["requests"] == 0 and not c.misses.totals()["enabled"]


def test_the_live_oracle_is_the_simulators_seen_oracle_on_the_bundled_trace() -> None:
    """Request by request, the flow's oracle is the seen oracle's reuse rounded down to the block."""
    requests = read_trace(TRACE).in_time_order()
    lineage, seen = LineagePolicy(load_sizes("tiny")), SeenOraclePolicy()
    block = lineage.cache.config.shadow_block_tokens
    compared = 0
    for req in requests:
        before = lineage.cache.misses.totals()["oracle_tokens"]
        lineage.serve(req)
        live = lineage.cache.misses.totals()["oracle_tokens"] - before
        assert live == seen.serve(req).reused // block * block, f"request {req.index}"
        compared += live > 0
    assert compared > len(requests) // 2  # most requests share something: the test compares real work
    totals = lineage.cache.misses.totals()
    assert totals["requests"] == len(requests) and 0 < totals["ratio"] <= 1
    lost = sum(totals["lost_tokens"].values())
    assert lost == totals["oracle_tokens"] - totals["restored_tokens"]


def test_the_totals_in_words() -> None:
    from server_patch.lineage.misses import describe, summarize

    counts = {"requests": 10, "oracle_tokens": 1000, "restored_tokens": 970,
              "lost:ram budget": 20, "lost:thinning": 10, "elsewhere_requests": 2}
    assert describe({"enabled": True, **summarize(counts)}) == (
        "restores 0.97 of what an unbounded cache would; lost: 2 % ram budget, 1 % thinning; "
        "2 requests shared more with another namespace")
    assert describe({"enabled": True, **summarize({"requests": 3})}) == "no repeated prefix yet (3 requests)"
    assert describe({"enabled": False}).startswith("off")


def test_the_journal_report_sums_the_request_lines() -> None:
    from apcctl.journal_report import summarize as report

    lines = [{"type": "start", "time": 1.0},
             {"type": "request", "time": 2.0, "seq": 1, "prompt_tokens": 300, "restored_tokens": 0, "oracle": 0,
              "lost": {}},
             {"type": "request", "time": 3.0, "seq": 2, "prompt_tokens": 300, "restored_tokens": 299, "oracle": 288,
              "lost": {}},
             {"type": "request", "time": 4.0, "seq": 3, "prompt_tokens": 300, "restored_tokens": 0, "oracle": 288,
              "lost": {"operator": 288}},
             {"type": "request", "time": 5.0, "seq": 4, "prompt_tokens": 300, "restored_tokens": 0}]  # an older server
    oracle = report(lines, since=0.0, until=10.0)["oracle"]
    assert oracle["requests"] == 3 and oracle["oracle_tokens"] == 576 and oracle["restored_tokens"] == 288
    assert oracle["ratio"] == 0.5 and oracle["lost_tokens"]["operator"] == 288


def test_the_dashboards_live_counters_carry_the_oracle_line() -> None:
    from rich.console import Console

    from server_patch.admin.schema import ServerInfo, Status
    from server_patch.lineage.misses import summarize
    from tui.panes.live import counters
    from tui.state import DashboardState

    def shown(status: Status) -> str:
        console = Console(width=200, record=True)
        console.print(counters(DashboardState(status=status), 0.0))
        return console.export_text()

    server = ServerInfo(model="m", pid=1, create_time=0.0, uptime_s=1.0, started=0.0, mlx_vlm_version="0.7.10",
                        patch_version="x", fingerprint=None)
    totals = {"enabled": True, **summarize({"requests": 2, "oracle_tokens": 100, "restored_tokens": 90,
                                            "lost:thinning": 10})}
    (line,) = [line for line in shown(Status(server=server, oracle=totals)).splitlines() if line.startswith("oracle")]
    assert line.split(None, 1)[1].strip() == "0.90 of unbounded · lost thinned 10%"  # the LOST column's names
    assert "oracle" not in shown(Status(server=server))  # a server before issue 26


def test_an_entry_dropped_because_its_loan_lost_its_rows_counts_as_a_loan_in_the_way():
    from server_patch.lineage.misses import lost_reason
    from server_patch.lineage.model import Reason

    assert lost_reason(Reason.LENT_ROWS_LOST) == Lost.LOAN
    assert lost_reason("something new") == Lost.OTHER
