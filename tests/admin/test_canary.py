"""The live correctness canary: restores checked against a cold prefill, on the real server.

Units: the comparison (tolerances by dtype, ties, non-finite logits), the choice of restore
points, and a check over real mlx handles of the in-process tiny model (pass, a corrupted
recurrent state caught, a window check, a skip, an abandoned check that is retried).

Through the real server (tiny model): every restore kind of a healthy cache passes, disk
files included (loaded, not promoted); a request that arrives during a check is served while
the check yields (the log shows the check abandoned before the request is restored); with the
test-only fault hook that corrupts ``final`` checkpoints the check fails, ``apcctl verify``
exits 1, the metrics count it, and with ``APC_CANARY_ON_FAIL=cold`` that kind is then served
cold, equal to a cold prefill, until ``apcctl verify --clear``.
"""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from tests.fake_model import prefill, random_tokens
from tests.server_harness import ADMIN_TOKEN, PatchedServer, assert_same_output, text
from server_patch.canary import check as C
from server_patch.canary import points as P
from server_patch.canary.compare import compare, tolerance_for
from server_patch.lineage import CacheError, LineageCache, LineageConfig, SizedKV, SizedSnapshot
from tests.e2e.test_e2e_correctness import SCENARIOS, _send

# ---------------------------------------------------------------------------- the comparison

F32 = tolerance_for("float32", {})
BF16 = tolerance_for("bfloat16", {})


def _logits(seed: int = 0, n: int = 64) -> np.ndarray:
    return np.random.RandomState(seed).normal(0, 5, n)


def test_identical_and_rounding_level_logits_pass() -> None:
    cold = _logits()
    assert compare(cold, cold, F32).passed and compare(cold, cold, F32).max_abs_diff == 0
    noisy = cold + np.random.RandomState(1).normal(0, 1e-5, cold.shape)
    result = compare(noisy, cold, F32)
    assert result.passed and result.top_k_agreement == 1.0 and result.greedy_cold == result.greedy_restored


def test_a_shift_beyond_the_tolerance_fails_and_says_why() -> None:
    cold = _logits()
    result = compare(cold + np.where(np.arange(cold.size) == 3, 0.01, 0), cold, F32)
    assert not result.passed and "max |diff|" in result.reason


def test_bf16_is_looser_than_float32_and_env_overrides() -> None:
    cold = _logits()
    shifted = cold + 0.05
    assert not compare(shifted, cold, F32).passed
    assert compare(shifted, cold, BF16).passed
    assert tolerance_for("float32", {"APC_CANARY_ATOL": "1"}).atol == 1.0
    assert tolerance_for(mx.float16, {}).dtype == "float16"


def test_greedy_may_swap_only_with_a_tied_token() -> None:
    cold = np.zeros(16)
    cold[2], cold[5] = 10.0, 10.0 - 1e-6  # tied within the tolerance
    swapped = cold.copy()
    swapped[5] = 10.0 + 1e-6
    assert compare(swapped, cold, F32).passed
    far = cold.copy()
    far[5] = 11.0
    result = compare(far, cold, F32)
    assert not result.passed and "greedy" in result.reason


def test_non_finite_logits_fail() -> None:
    cold = _logits()
    broken = cold.copy()
    broken[0] = np.nan
    assert not compare(broken, cold, BF16).passed


# ---------------------------------------------------------------------------- choosing points

def _policy() -> tuple[LineageCache, Any, Any]:
    cache = LineageCache(LineageConfig())
    tokens = np.arange(1, 301, dtype=np.int32)
    one = cache.commit(np.append(tokens[:200], 7), kv=SizedKV(10, 200), head=SizedSnapshot(10),
                       captures={100: ("periodic", SizedSnapshot(10))})
    two = cache.commit(np.append(tokens + 1000, 7), kv=SizedKV(10, 300), head=SizedSnapshot(10),
                       captures={64: ("anchor", SizedSnapshot(10))})
    return cache, one, two


def test_points_of_an_entry_recent_and_every_kind() -> None:
    cache, one, two = _policy()
    assert [(p.length, p.kind) for p in P.of_entry(cache, one.id)] == [(200, "entry"), (100, "periodic")]
    with pytest.raises(CacheError):
        P.of_entry(cache, "no-such-entry")
    assert {p.entry_id for p in P.recent(cache, 1)} == {cache.entries()[0].id}
    kinds = {p.kind for p in P.every_kind(cache)}
    assert kinds == {"entry", "periodic", "anchor"}
    sampled = {P.sample(cache, random.Random(seed)).kind for seed in range(40)}
    assert sampled == kinds  # a kind at random first: every kind comes up
    groups = P.grouped(P.of_entry(cache, one.id) * 2)
    assert [len(g) for g in groups.values()] == [2]  # duplicates collapse, one group per entry


# ---------------------------------------------------------------------------- a check, in-process

@pytest.fixture(scope="module")
def stored(model, layout):
    """An entry of 299 tokens with a ``final`` checkpoint at 100, over real mlx handles."""
    tokens = random_tokens(300)
    live = model.make_cache()
    prefill(model, live, tokens[:100], step=50)
    checkpoint = layout.split(live, 100)[1]
    prefill(model, live, tokens[100:299], step=64)
    kv, head = layout.split(live, 299)
    cache = LineageCache(LineageConfig())
    entry = cache.commit(tokens, kv=kv, head=head, captures={100: ("final", checkpoint)})
    return cache, entry


def _run(model, layout, entry, points, never=lambda: False, **settings):
    return C.check_entry(model, layout, entry, points, F32, C.Settings(chunk=64, **settings), never)


def test_restores_of_a_healthy_entry_pass(model, layout, stored) -> None:
    cache, entry = stored
    results = _run(model, layout, entry, P.of_entry(cache, entry.id))
    assert [(r.point.kind, r.result, r.checked_tokens, r.base) for r in results] == [
        ("final", "pass", 101, 0), ("entry", "pass", 300, 0)]


def test_long_points_use_a_window_from_an_earlier_restore_point_or_skip(model, layout, stored) -> None:
    cache, entry = stored
    windowed = _run(model, layout, entry, P.of_entry(cache, entry.id), max_tokens=250)
    assert [(r.result, r.base, r.checked_tokens) for r in windowed] == [("pass", 0, 101), ("pass", 100, 200)]
    skipped = _run(model, layout, entry, P.of_entry(cache, entry.id), max_tokens=100)
    assert [r.result for r in skipped] == ["skip", "skip"] and "APC_CANARY_MAX_TOKENS" in skipped[0].reason


def test_a_check_abandoned_at_a_chunk_boundary_changes_nothing(model, layout, stored) -> None:
    cache, entry = stored
    asked = []

    def after_three() -> bool:
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(C.Abandoned):
        _run(model, layout, entry, P.of_entry(cache, entry.id), never=after_three)
    assert all(r.result == "pass" for r in _run(model, layout, entry, P.of_entry(cache, entry.id)))


def test_a_corrupted_recurrent_state_is_caught(model, layout) -> None:
    tokens = random_tokens(200, seed=5)
    live = model.make_cache()
    prefill(model, live, tokens[:80], step=40)
    checkpoint = layout.split(live, 80)[1]
    prefill(model, live, tokens[80:199], step=60)
    kv, head = layout.split(live, 199)
    cache = LineageCache(LineageConfig())
    entry = cache.commit(tokens, kv=kv, head=head, captures={80: ("final", checkpoint)})
    recurrent = [i for i, layer in enumerate(layout.layers) if layer.codecs[0].name == "arrays"][0]
    state = checkpoint.layers[recurrent][0]
    state["s1"] = state["s1"] + 1.0
    by_kind = {r.point.kind: r for r in _run(model, layout, entry, P.of_entry(cache, entry.id))}
    assert by_kind["entry"].result == "pass"
    assert by_kind["final"].result == "fail" and by_kind["final"].comparison.max_abs_diff > F32.at(0)


# ---------------------------------------------------------------------------- the real server

def _env(log_dir: Path, **extra: str) -> dict[str, str]:
    return {"TOP_LOGPROBS_K": "5", "APC_CANARY_IDLE_S": "0.2", "APC_TEST_FAULTS": "1",
            "APC_TEST_FAULT_CANARY_PAUSE_FILE": str(log_dir / "pause"), **extra}


@pytest.fixture(scope="module")
def healthy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("canary-healthy")
    # test_e2e_correctness's "periodic" configuration: every kind of restore point appears.
    env = _env(log_dir, APC_LINEAGE_PERIODIC_STRIDE="256", APC_LINEAGE_GUARD_TOKENS="16")
    with PatchedServer(tiny_model_dir, env=env, log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def faulty(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("canary-faulty")
    env = _env(log_dir, APC_TEST_FAULT_CORRUPT_STATE="final", APC_CANARY_ON_FAIL="cold")
    with PatchedServer(tiny_model_dir, env=env, log_dir=log_dir) as server:
        yield server


def _verify(server: PatchedServer, body: dict[str, Any] | None = None) -> dict[str, Any]:
    status, answer = server.admin("POST", "/verify", body or {})
    assert status == 200, answer
    return answer


def _cli(server: PatchedServer, *args: str):
    from apcctl.cli import main

    return CliRunner().invoke(main, ["verify", "--server", server.base_url, "--token", ADMIN_TOKEN, *args])


def _metric(server: PatchedServer, line_start: str) -> float:
    _, text = server.admin("GET", "/metrics")
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])


@pytest.mark.server
def test_every_restore_kind_of_a_healthy_cache_passes(healthy: PatchedServer) -> None:
    servers = {"default": healthy, "periodic": healthy}
    for kind, scenario in SCENARIOS.items():
        scenario(servers, f"canary-{kind}")  # warms the cache: every kind of restore point
    status, flushed = healthy.admin("POST", "/flush", {"timeout": 60})
    assert status == 200 and flushed["complete"], flushed  # files: disk points

    answer = _verify(healthy)  # no body: one point of every restore kind held
    kinds = {r["kind"] for r in answer["results"]}
    assert {"entry", "final", "anchor", "divergence", "periodic", "guard", "disk"} <= kinds, kinds
    failed = [r for r in answer["results"] if r["result"] != "pass"]
    assert answer["complete"] and not failed, failed
    assert all(r["mode"] == "cold" and r["checked_tokens"] == r["length"] + 1 for r in answer["results"])
    disk = [r for r in answer["results"] if r["tier"] == "disk"]
    ids_in_ram = {e["id"] for e in healthy.admin("GET", "/entries?tier=ram")[1]["entries"]}
    assert disk and {r["entry_id"] for r in disk} <= ids_in_ram  # loaded for the check, RAM unchanged
    assert _metric(healthy, 'apc_lineage_canary_total{result="pass"}') >= len(answer["results"])

    # A short conversation of its own is now the most recently used entry: the CLI checks its
    # few points instead of a 700-token entry's again.
    _send(healthy, [{"role": "user", "content": text(20, 271)}], "canary-recent")
    result = _cli(healthy, "--recent", "1")  # every point of the most recent entry, as a table
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output and "pass" in result.output
    _assert_reported(healthy, at_least=len(answer["results"]))


def _assert_reported(server: PatchedServer, at_least: int) -> None:
    """The checks are in ``apcctl status`` and, from the journal, in ``apcctl report``."""
    import json

    from apcctl.cli import main

    status = CliRunner().invoke(main, ["status", "--server", server.base_url, "--token", ADMIN_TOKEN, "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["canary"]["counts"]["pass"] >= at_least
    journal = Path(server.env["APC_STATE_DIR"]) / "journal"
    report = CliRunner().invoke(main, ["report", "--journal", str(journal), "--json"])
    assert report.exit_code == 0, report.output
    canary = json.loads(report.output)["canary"]
    assert canary["by_result"].get("pass", 0) >= at_least and canary["max_abs_diff"] is not None, canary


@pytest.mark.server
def test_bad_verify_requests_are_4xx_with_a_message(healthy: PatchedServer) -> None:
    assert healthy.request("POST", "/admin/verify", {})[0] == 401
    status, body = healthy.admin("POST", "/verify", {"entry": "nosuchentry"})
    assert status == 404 and "nosuchentry" in body["detail"]
    assert healthy.admin("POST", "/verify", {"entry": "x", "recent": 2})[0] == 422
    assert healthy.admin("POST", "/verify", {"recent": 0})[0] == 422
    assert healthy.admin("POST", "/verify/clear", {"kind": "bogus"})[0] == 422
    assert _cli(healthy, "--entry", "x", "--recent", "2").exit_code == 2
    assert _cli(healthy, "--entry", "nosuchentry").exit_code == 5


@pytest.mark.server
def test_a_request_during_a_check_is_served_while_the_check_yields(healthy: PatchedServer) -> None:
    messages = [{"role": "user", "content": " ".join(["model token cache"] * 60)}]
    _send(healthy, messages, "canary-yield")
    entry_id = healthy.admin("GET", "/entries?tier=ram")[1]["entries"][0]["id"]
    pause = Path(healthy.env["APC_TEST_FAULT_CANARY_PAUSE_FILE"])
    pause.write_text("120")  # each chunk of the check waits (watching the queue) while this exists
    answers: dict[str, Any] = {}
    verifier = threading.Thread(target=lambda: answers.update(_verify(healthy, {"entry": entry_id})))
    offset = len(healthy.log_text())
    try:
        verifier.start()
        _wait_for_log(healthy, "apc_canary starting check", offset)
        answer, line = _send(healthy, messages + [{"role": "assistant", "content": "yes"},
                                                   {"role": "user", "content": "and then"}], "canary-yield")
        # "yes" is not the stored reply: the follow-up restores at the prompt end's checkpoint.
        assert line["kind"] == "final" and answer["choices"]
        assert verifier.is_alive()  # served while the check is still pending (it yielded)
    finally:
        pause.unlink()
        verifier.join(120)
    log = healthy.log_text()[offset:]
    abandoned = log.find("apc_canary abandoned")
    restored = re.search(rf"apc_lineage restore .*entry={line['entry']}", log)
    assert restored is not None and 0 <= abandoned < restored.start(), "restored before the check yielded"
    assert answers["abandoned"] >= 1 and answers["complete"] and answers["fail"] == 0, answers
    assert log.find("apc_canary resuming check") > restored.start()  # retried once idle again


def _wait_for_log(server: PatchedServer, needle: str, offset: int = 0, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in server.log_text()[offset:]:
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} never logged:\n{server.log_tail()}")
        time.sleep(0.05)


@pytest.mark.server
def test_a_corrupted_checkpoint_is_caught_and_its_kind_served_cold(faulty: PatchedServer) -> None:
    tenant = "canary-fault"
    _, messages, _ = SCENARIOS["final"]({"default": faulty}, tenant)  # leaves a final checkpoint
    entry = next(e for e in faulty.admin("GET", "/entries?tier=ram")[1]["entries"]
                 if any(c["kind"] == "final" for c in e["checkpoints"]))

    result = _cli(faulty, "--entry", entry["id"], "--json")
    assert result.exit_code == 1, result.output  # a failed check
    answer = _verify(faulty, {"entry": entry["id"]})
    by_kind = {r["kind"]: r for r in answer["results"]}
    assert by_kind["final"]["result"] == "fail" and by_kind["final"]["max_abs_diff"] > by_kind["final"]["tolerance"]
    assert by_kind["entry"]["result"] == "pass"
    assert answer["suspects"] == ["final"] and answer["on_fail"] == "cold"
    assert "apc_canary suspect kind=final" in faulty.log_text()
    assert _metric(faulty, 'apc_lineage_canary_total{result="fail"}') >= 1
    assert _metric(faulty, 'apc_lineage_canary_suspect{kind="final"}') == 1

    # The restore the final checkpoint would serve is now a cold prefill, equal to a cold one.
    warm, line = _send(faulty, messages, tenant)
    assert line["kind"] == "cold", line
    cold, cold_line = _send(faulty, messages, f"cold-{uuid.uuid4().hex[:8]}")
    assert cold_line["kind"] == "cold"
    assert_same_output(warm, cold)

    cleared = _cli(faulty, "--clear")
    assert cleared.exit_code == 0 and "final" in cleared.output, cleared.output
    assert faulty.admin("GET", "/verify")[1]["suspects"] == {}
    # Another reply to the first turn: back to the turn boundary, where only the final checkpoint is.
    other = messages[:2] + [{"role": "assistant", "content": "cache prefix"}, {"role": "user", "content": "more"}]
    _, line = _send(faulty, other, tenant)
    assert line["kind"] == "final", line  # the operator cleared it: the kind is restored again


@pytest.mark.server
def test_the_schedule_checks_a_sampled_point_while_idle(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = _env(tmp_path, APC_CANARY_INTERVAL_S="0.5")
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        _send(server, [{"role": "user", "content": " ".join(["index pool"] * 80)}], "canary-schedule")
        deadline = time.monotonic() + 60
        while server.admin("GET", "/verify")[1]["counts"]["pass"] < 2:  # one point per interval
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        state = server.admin("GET", "/verify")[1]
        assert state["interval_s"] == 0.5 and state["counts"]["fail"] == 0
        assert "source=schedule" in server.log_text()
        _assert_reported(server, at_least=2)


def test_points_with_media_placeholders_are_skipped(model, layout, stored) -> None:
    cache, entry = stored
    media = frozenset({int(entry.tokens[50])})  # as if token 50 were an image placeholder
    results = C.check_entry(model, layout, entry, P.of_entry(cache, entry.id), F32, C.Settings(chunk=64),
                            lambda: False, media=media)
    assert [r.result for r in results] == ["skip", "skip"] and "placeholders" in results[0].reason


# ---------------------------------------------------------------------------- the book, the report

def _result(kind: str, result: str) -> C.Result:
    comparison = compare(_logits(), _logits() + (0 if result == "pass" else 1), F32)
    return C.Result(P.Point("e1", 10, kind, "ram", kind), result, comparison.reason, 11, 0, comparison)


def test_a_failure_marks_its_kind_suspect_until_cleared() -> None:
    from server_patch.canary.book import Book, on_fail_from_env

    logged, cold = Book("log"), Book("cold")
    for book in (logged, cold):
        book.record(_result("entry", "pass"), runtime=None)
        book.record(_result("final", "fail"), runtime=None)
    assert set(cold.suspects) == {"final"} and cold.refuses("final") and not cold.refuses("entry")
    assert set(logged.suspects) == {"final"} and not logged.refuses("final")  # log only: still restored
    assert cold.summary()["counts"]["fail"] == 1 and cold.summary()["last"]["kind"] == "final"
    assert cold.clear("entry") == [] and cold.clear() == ["final"] and not cold.refuses("final")
    assert on_fail_from_env({"APC_CANARY_ON_FAIL": "Cold"}) == "cold"
    assert on_fail_from_env({"APC_CANARY_ON_FAIL": "bogus"}) == "cold"  # unknown: the protective choice
    assert on_fail_from_env({}) == "log"


def test_report_counts_canary_events_from_the_journal(tmp_path: Path) -> None:
    from apcctl.commands.report import canary_report
    from server_patch.canary.book import _detail
    from server_patch.integration.journal import Journal

    journal = Journal(tmp_path)
    for seq, (kind, result) in enumerate([("entry", "pass"), ("final", "fail"), ("disk", "skip")]):
        view = _result(kind, result).as_dict()
        journal.append({"seq": seq, "time": time.time(), "type": "cache", "event": "canary", "entry_id": "e1",
                        "length": 10, "bytes": 0, "detail": _detail(view)})
    journal.append({"time": time.time(), "type": "cache", "event": "store", "detail": ""})
    journal.close()
    summary = canary_report(tmp_path, 0.0, time.time() + 1)
    assert summary["checks"] == 3 and summary["by_result"] == {"pass": 1, "fail": 1, "skip": 1}
    assert summary["by_kind"]["final"] == {"fail": 1} and summary["max_abs_diff"] == pytest.approx(1.0, rel=1e-2)
    assert [f["kind"] for f in summary["failures"]] == ["final"]


def test_a_window_may_start_from_another_entrys_restore_point(model, layout, stored) -> None:
    cache, entry = stored
    live = model.make_cache()
    prefill(model, live, np.asarray(entry.tokens[:150]), step=75)  # as an anchor of 150 tokens would hold
    bases = {150: layout.split(live, 150)}
    head = [p for p in P.of_entry(cache, entry.id) if p.kind == "entry"]
    results = C.check_entry(model, layout, entry, head, F32, C.Settings(chunk=64, max_tokens=160),
                            lambda: False, bases=bases)
    assert [(r.result, r.base, r.checked_tokens) for r in results] == [("pass", 150, 150)]
