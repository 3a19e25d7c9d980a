"""End to end, real HTTP on the tiny model: every miss explained (issue 26).

The real patched server keeps a shadow index of what each namespace processed; each request's
record carries its ``oracle`` (what an unbounded cache would have restored) and ``lost``
(``{reason: tokens}``), in ``/admin/requests`` and the journal; ``/admin/status`` and
``/admin/metrics`` carry the totals. Each reason here is forced by traffic that must lose
tokens that way: an operator evict, a RAM budget with room for one conversation (disk tier
off), a reply the client sends back otherwise than it was generated. Another tenant's prompt
is counted, never matched; a request that needs the entry lent to a running one loses nothing
(the lookup ends the loan).
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import ADMIN_TOKEN, HOST, PatchedServer, text, wait_for

pytestmark = pytest.mark.server
# Decoding is most of a small request's time on the tiny model: a reply is 8 tokens where only
# its presence matters (a next turn's history, an entry's reply), 32 where a test reads it.
SHORT_REPLY, LONG_REPLY = 8, 32
BLOCK = 16
RECORDED_SEEDS = (61, 71)  # the conversations the what-if journal holds


def conversation(seed: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are the oracle test's assistant. " + text(60, seed=seed)},
            {"role": "user", "content": text(80, seed=seed + 1)}]


def last_record(server: PatchedServer) -> dict[str, Any]:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return max(body["requests"], key=lambda r: r["seq"])


def ask(server: PatchedServer, messages: list[dict[str, Any]], max_tokens: int = SHORT_REPLY,
        **headers: str) -> tuple[dict, dict]:
    answer = server.chat(messages, max_tokens=max_tokens, **headers)
    return answer, last_record(server)


def resend_oracle(record: dict[str, Any]) -> int:
    """A resend's oracle: the whole prompt but the last token, rounded down to the block."""
    return (record["prompt_tokens"] - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("oracle")) as running:
        yield running


def test_a_resend_loses_nothing_and_an_operator_evict_is_the_reason(server: PatchedServer) -> None:
    messages = conversation(seed=1)
    _, first = ask(server, messages)
    assert first["oracle"] == 0 and first["lost"] == {}
    _, again = ask(server, messages)
    assert again["oracle"] == resend_oracle(again) > 0
    assert again["restored_tokens"] >= again["oracle"] and again["lost"] == {}

    status, body = server.admin("DELETE", f"/entries/{again['entry_id']}")
    assert status == 200, body
    _, evicted = ask(server, messages)  # its system prompt's anchor is still pinned: it restores that
    assert evicted["oracle"] == resend_oracle(evicted) > evicted["restored_tokens"]
    assert evicted["lost"] == {"operator": evicted["oracle"] - evicted["restored_tokens"]}

    status, body = server.admin("GET", "/status")
    assert status == 200, body
    totals = body["oracle"]
    assert totals["enabled"] and totals["requests"] >= 3
    assert totals["lost_tokens"]["operator"] >= evicted["lost"]["operator"]
    assert totals["shadow"]["blocks"] > 0 and totals["shadow"]["bytes"] <= totals["shadow"]["budget_bytes"]

    status, exposition = server.admin("GET", "/metrics")
    assert status == 200, exposition
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(exposition) for s in family.samples}
    assert samples[("apc_lineage_oracle_tokens_total", ())] >= again["oracle"] + evicted["oracle"]
    assert samples[("apc_lineage_lost_tokens_total", (("reason", "operator"),))] >= evicted["lost"]["operator"]
    assert ("apc_lineage_lost_tokens_total", (("reason", "thinning"),)) in samples  # every reason from 0

    journal = Path(server.env["APC_STATE_DIR"]) / "journal" / "journal.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    journaled = {line["seq"]: line for line in lines if line["type"] == "request"}
    assert journaled[evicted["seq"]]["lost"] == evicted["lost"]
    assert journaled[again["seq"]]["oracle"] == again["oracle"]


def test_apcctl_status_and_report_say_it_in_words(server: PatchedServer, cli_env: Path) -> None:
    from click.testing import CliRunner

    from apcctl.cli import main

    messages = conversation(seed=51)
    ask(server, messages)
    _, again = ask(server, messages)
    server.admin("DELETE", f"/entries/{again['entry_id']}")
    ask(server, messages)
    shown = CliRunner().invoke(main, ["status", "--server", server.base_url, "--token", ADMIN_TOKEN])
    assert shown.exit_code == 0, shown.output
    assert "restores" in shown.output and "of what an unbounded cache would" in shown.output
    assert "operator" in shown.output
    journal = Path(server.env["APC_STATE_DIR"]) / "journal"
    made = CliRunner().invoke(main, ["report", "--journal", str(journal), "--json"])
    assert made.exit_code == 0, made.output
    totals = json.loads(made.stdout)["oracle"]
    live = server.admin("GET", "/status")[1]["oracle"]
    assert totals["oracle_tokens"] == live["oracle_tokens"] and totals["lost_tokens"] == live["lost_tokens"]
    worded = CliRunner().invoke(main, ["report", "--journal", str(journal)])
    assert worded.exit_code == 0 and "oracle: restores" in worded.output, worded.output


def test_another_tenant_is_counted_never_matched(server: PatchedServer) -> None:
    messages = conversation(seed=11)
    ask(server, messages)
    before = server.admin("GET", "/status")[1]["oracle"]["elsewhere_requests"]
    _, other = ask(server, messages, tenant="someone-else")
    assert other["oracle"] == 0 and other["lost"] == {}
    assert server.admin("GET", "/status")[1]["oracle"]["elsewhere_requests"] == before + 1


def test_an_entry_lent_to_a_running_request_is_never_a_loan_in_the_way(server: PatchedServer) -> None:
    """A second request that needs the entry lent to a request still decoding: the lookup ends
    the loan and the rows go back to the entry (``loan … ended: shared``), so it restores all
    the oracle had and loses nothing. (``loan`` stays a reason for a restore a loan still
    blocks; this flow never leaves one.)"""
    first = conversation(seed=151)
    answer, _ = ask(server, first, LONG_REPLY)  # the history that makes the next reply 1,316 tokens
    second = first + [answer["choices"][0]["message"], {"role": "user", "content": text(30, seed=152)}]
    answer, _ = ask(server, second, LONG_REPLY)  # copied once into a buffer with room: the next turn is lent it
    history = second + [answer["choices"][0]["message"]]
    # Greedy, this turn's reply is 1,316 tokens long: the branch is looked up long before it ends.
    payload = {"model": str(server.model_dir), "messages": history + [{"role": "user", "content": text(20, seed=166)}],
               "temperature": 0.0, "stream": True, "max_tokens": 2000}
    conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        for _ in range(4):  # decoding: its row writes the lent buffer now
            stream.readline()
        _, branch = ask(server, history + [{"role": "user", "content": text(20, seed=154)}])
    finally:
        conn.close()  # the client goes away: the rest of that reply is not waited for
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    borrower = next(r for r in body["requests"] if r["seq"] == branch["seq"] - 1)
    assert borrower["kv_admission"] == "lent", borrower
    assert f"loan of entry {borrower['entry_id']} ended: shared" in server.log_text()
    assert branch["entry_id"] == borrower["entry_id"] and branch["restored_tokens"] >= branch["oracle"] > 0, branch
    assert branch["lost"] == {}, branch


def test_a_reply_sent_back_otherwise_is_the_reply_reason(server: PatchedServer) -> None:
    messages = conversation(seed=21)
    answer, _ = ask(server, messages, LONG_REPLY)
    reply = answer["choices"][0]["message"]["content"]
    words = reply.split(" ")
    assert len(words) >= 8, reply
    # The client keeps the reply's first words and rewrites the rest (a template that drops part of it).
    edited = " ".join(words[: len(words) * 3 // 4]) + " " + text(12, seed=22)
    follow = messages + [{"role": "assistant", "content": edited},
                         {"role": "user", "content": text(20, seed=23)}]
    _, record = ask(server, follow)
    assert record["oracle"] > record["restored_tokens"] > 0, record
    assert set(record["lost"]) == {"reply not re-rendered"}, record
    assert sum(record["lost"].values()) == record["oracle"] - record["restored_tokens"]


@pytest.fixture(scope="module")
def one_conversation(server: PatchedServer) -> int:
    """Bytes of RAM a RAM budget needs for one conversation of this test's size: measured on
    ``server`` (what one such conversation, its entry and its system prompt's anchor, adds)."""
    def ram_used() -> int:
        lineage = server.admin("GET", "/status")[1]["lineage"]
        return lineage["budgets"]["ram_used"] if lineage else 0  # no cache yet: nothing held

    before = ram_used()
    ask(server, conversation(seed=31))
    budget = int((ram_used() - before) * 1.3)
    assert budget > 0
    return budget


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, one_conversation: int):
    """A server whose RAM budget holds one conversation of this test's size, disk tier off."""
    env = {"APC_LINEAGE_DISK": "0", "APC_LINEAGE_RAM_BUDGET_BYTES": str(one_conversation)}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path_factory.mktemp("oracle-small")) as running:
        yield running


def test_the_ram_budget_is_the_reason(small: PatchedServer) -> None:
    first, second = conversation(seed=31), conversation(seed=41)
    ask(small, first)
    ask(small, second)  # pushes the first out: no room for two, no disk tier
    _, again = ask(small, first)
    assert again["oracle"] == resend_oracle(again) > again["restored_tokens"]
    assert again["lost"] == {"ram budget": again["oracle"] - again["restored_tokens"]}
    totals = small.admin("GET", "/status")[1]["oracle"]
    assert totals["lost_tokens"]["ram budget"] == again["lost"]["ram budget"]
    assert totals["ratio"] < 1


@pytest.fixture(scope="module")
def recorded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server that saw two conversations of three turns and a resend, and its journal (a
    second conversation is what the replay's budgets and namespaces have to keep apart; a third,
    as this once had, only added requests of the same kinds)."""
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("oracle-whatif")) as running:
        for seed in RECORDED_SEEDS:
            messages = conversation(seed)
            for turn in range(3):
                answer, _ = ask(running, messages)
                messages = messages + [answer["choices"][0]["message"],
                                       {"role": "user", "content": text(30, seed=seed + 10 + turn)}]
            ask(running, messages[:-2])  # a resend of the last prompt
        status, body = running.admin("GET", "/requests")
        assert status == 200, body
        records = sorted(body["requests"], key=lambda r: r["seq"])
        yield running, records, Path(running.env["APC_STATE_DIR"]) / "journal"


def test_what_if_with_the_current_settings_reproduces_the_servers_restores(recorded) -> None:
    from apcctl.journal_report import read_journal
    from apcctl.lab.sim.sizes import load_sizes
    from apcctl.lab.sim.whatif import what_if

    _, records, journal = recorded
    result = what_if(read_journal(journal), load_sizes("tiny"), {})
    current = result["runs"][0]
    assert result["requests"] == len(records) == 4 * len(RECORDED_SEEDS)
    assert result["journal_restored_tokens"] == sum(r["restored_tokens"] for r in records)
    restored = [r["restored_tokens"] for r in records]
    # Warm turns and resends (3 a conversation, one may miss): the replay compares real restores.
    assert sum(1 for n in restored if n) >= 3 * len(RECORDED_SEEDS) - 1
    for server_side, replayed, record in zip(restored, current["reused"], records):
        # Replayed in blocks: at most a block less (where a restore point fell inside a block),
        # at most one token more (a prompt whose length is a multiple of the block).
        assert server_side - BLOCK < replayed <= server_side + 1, (record["seq"], server_side, replayed)
    assert result["runs"][1] == {**current, "name": "proposed"}  # no override: the same replay


def test_apcctl_report_what_if_side_by_side(recorded, cli_env: Path) -> None:
    from click.testing import CliRunner

    from apcctl.cli import main

    _, _, journal = recorded
    made = CliRunner().invoke(main, ["report", "--journal", str(journal), "--what-if",
                                     "ram_budget=64K,max_checkpoints=6", "--sizes", "tiny", "--json"])
    assert made.exit_code == 0, made.output
    current, proposed = json.loads(made.stdout)["runs"]
    assert (proposed["ram_budget_bytes"], proposed["max_checkpoints"]) == (64 << 10, 6)
    assert proposed["prefill_tokens"] > current["prefill_tokens"]  # 64K holds nothing of these prompts
    # Nothing fits in RAM: every file it writes is loaded and pushed out again (no room to promote).
    assert proposed["lost_tokens"]["disk not used"] > sum(current["lost_tokens"].values())
    shown = CliRunner().invoke(main, ["report", "--journal", str(journal), "--what-if", "max_checkpoints=6",
                                      "--sizes", "tiny"])
    assert shown.exit_code == 0 and "PROPOSED (max_checkpoints=6)" in shown.output, shown.output
    bad = CliRunner().invoke(main, ["report", "--journal", str(journal), "--what-if", "no_such=1"])
    assert bad.exit_code == 2 and "no_such" in bad.output and "Traceback" not in bad.output


def test_a_rejected_disk_file_is_the_reason(tiny_model_dir: Path, tmp_path: Path, one_conversation: int) -> None:
    from tests.e2e.test_e2e_disk import _files
    from tests.fault.test_fault_disk import _flip_tensor_byte

    disk = tmp_path / "lineage-disk"
    env = {"APC_LINEAGE_DISK_PATH": str(disk), "APC_LINEAGE_RAM_BUDGET_BYTES": str(one_conversation),
           "APC_LINEAGE_DISK_WRITE_DELAY_S": "0"}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "server") as running:
        first = conversation(seed=91)
        _, record = ask(running, first)
        # Its file is written at once (no delay); an entry whose write is in flight is not
        # evictable, so the next commit would push the newcomer out instead: wait for the file.
        wait_for(lambda: any(record["entry_id"] in p.name for p in _files(disk)), "the first conversation's write",
                 running)
        ask(running, conversation(seed=92))  # pushes the first out of RAM

        def written() -> list[Path]:
            on_disk = {e["id"] for e in running.admin("GET", "/entries?kind=conversation&tier=disk")[1]["entries"]}
            return [p for p in _files(disk) if any(entry_id in p.name for entry_id in on_disk)]

        wait_for(lambda: written(), "the first conversation's file", running)
        for path in written():
            _flip_tensor_byte(path)  # bit rot: found when a request loads the file
        _, again = ask(running, first)
    assert again["oracle"] == resend_oracle(again) > again["restored_tokens"]
    assert again["lost"] == {"disk rejected": again["oracle"] - again["restored_tokens"]}, again
    assert again["lost_why"] == "hash"  # the integrity check that rejected the file
    assert "rejected" in running.log_text()


def test_a_suspect_kind_refused_by_the_canary_is_the_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"APC_TEST_FAULTS": "1", "APC_TEST_FAULT_CORRUPT_STATE": "final", "APC_CANARY_ON_FAIL": "cold",
           "APC_CANARY_IDLE_S": "0.2"}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "server") as running:
        messages = conversation(seed=101)
        ask(running, messages)  # its entry keeps the prompt end as a final checkpoint (reply reuse)
        (entry,) = running.admin("GET", "/entries?kind=conversation&tier=ram")[1]["entries"]
        status, answer = running.admin("POST", "/verify", {"entry": entry["id"]})
        assert status == 200 and answer["suspects"] == ["final"], answer
        _, again = ask(running, messages)  # a resend restores at the final checkpoint: refused
    assert again["restored_tokens"] == 0 and again["oracle"] == resend_oracle(again) > 0
    assert again["lost"] == {"canary": again["oracle"]}, again


@pytest.fixture(scope="module")
def restarted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One server's two lives (the two tests below started three servers of their own): at most
    one checkpoint an entry, the disk tier off (nothing survives the restart but the journal). The
    first life thins a conversation's points and branches it, and sees the conversation that the
    second life, once it has read the journal back, is asked again."""
    env = {"APC_LINEAGE_MAX_CHECKPOINTS": "1", "APC_LINEAGE_DISK": "0"}
    log_dir = tmp_path_factory.mktemp("oracle-restart")
    out: dict[str, Any] = {}
    with PatchedServer(tiny_model_dir, env=env, log_dir=log_dir) as before:
        first = conversation(seed=111)
        answer, _ = ask(before, first)
        messages = first
        for turn in range(3):  # later turns thin the first turn's points
            messages = messages + [answer["choices"][0]["message"],
                                   {"role": "user", "content": text(30, seed=120 + turn)}]
            answer, _ = ask(before, messages)
        out["thinned"] = before.admin("GET", "/status")[1]["lineage"]["stats"]["thinned"]
        branch = first + [{"role": "assistant", "content": "."}, {"role": "user", "content": text(30, seed=130)}]
        _, out["branch"] = ask(before, branch)  # another reply to the first turn: its points are gone
        ask(before, conversation(seed=141))
    with PatchedServer(tiny_model_dir, env=env, log_dir=log_dir) as after:
        ask(after, conversation(seed=142))  # the runtime starts, and reads the journal back
        wait_for(lambda: "apc_lineage oracle warmed blocks=" in after.log_text(), "the warm-up", after)
        _, out["again"] = ask(after, conversation(seed=141))
    return out


def test_a_thinned_checkpoint_is_the_reason(restarted: dict[str, Any]) -> None:
    assert restarted["thinned"] > 0
    record = restarted["branch"]
    assert "thinning" in record["lost"], record
    assert sum(record["lost"].values()) == record["oracle"] - record["restored_tokens"]


def test_after_a_restart_the_oracle_remembers_and_the_restart_is_the_reason(restarted: dict[str, Any]) -> None:
    again = restarted["again"]
    assert again["oracle"] == resend_oracle(again) > again["restored_tokens"]
    assert again["lost"] == {"restart": again["oracle"] - again["restored_tokens"]}, again
