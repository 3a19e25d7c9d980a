"""Fault injection into the disk tier of a real server on the tiny model (issue 12).

Real processes, real files, real HTTP, a real ``kill -9``. Every answer after a fault is
compared with a cold prefill of the same server (a tenant of its own shares no cache entry, and
its restore line says ``kind=cold``): the promise is that a restore which cannot be validated is a
cold prefill, never garbage.

* bit rot (one byte flipped in a tensor's data, header and sizes untouched) and header damage (a
  checkpoint length edited, size kept) are caught, the files removed and the rejects logged;
* a server killed by SIGKILL while its writer is stalled between the temp file and the rename
  leaves a temp file that the next start removes, and nothing of it is restored;
* a second server on the same disk directory exits at start naming the directory and the
  holder's PID; the first keeps serving;
* a disk that fails every write (simulated ENOSPC) costs nothing but the disk tier: answers stay
  cold-equal, failures are counted, and the writer backs off (1 s, 2 s, 4 s) instead of
  retrying at every tick.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
from pathlib import Path

import pytest

from tests.server_harness import PatchedServer, ServerError, assert_same_output, reply_text, text, wait_for
from server_patch.disk import integrity
from tests.e2e.test_e2e_disk import _cold, _env, _files, _send, _stop_gracefully

FAULTS = {"APC_TEST_FAULTS": "1"}


def _turn(messages: list[dict], answer: dict, seed: int) -> list[dict]:
    return messages + [{"role": "assistant", "content": reply_text(answer)},
                       {"role": "user", "content": text(40, seed)}]


def _flip_tensor_byte(path: Path) -> None:
    """One bit of the largest tensor's data, in place: header and size unchanged."""
    header = integrity.read_header(path)
    victim = max(header.tensors, key=lambda t: t.nbytes)
    with path.open("r+b") as f:
        f.seek(header.data_start + victim.begin + victim.nbytes // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def _edit_header_digit(path: Path, key: str) -> None:
    """Change one digit of a number in ``key``'s metadata value (a checkpoint or an entry
    length) with the same number of characters, the digests left as they were."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + size])["__metadata__"]
    old = json.dumps(meta[key])[1:-1].encode()  # as it appears inside the header JSON
    at = data.index(old, 8)
    digit = at + re.search(rb"\d", old).start()
    data[digit] = ord("1") if data[digit] != ord("1") else ord("2")
    assert len(data) == path.stat().st_size
    path.write_bytes(bytes(data))


def _rejected(server: PatchedServer) -> dict[str, str]:
    """{file name: reason} of the server's ``rejected ... reason=...`` log lines."""
    return dict(re.findall(r"lineage disk: rejected (\S+) reason=(\w+)", server.log_text()))


@pytest.mark.server
def test_bit_rot_and_header_damage_restore_nothing_and_answer_as_cold(tiny_model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "lineage-disk"
    system_a = {"role": "system", "content": text(300, 901)}
    system_b = {"role": "system", "content": text(300, 902)}
    a0 = [system_a, {"role": "user", "content": text(80, 903)}]
    b0 = [system_b, {"role": "user", "content": text(80, 904)}]

    first = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=tmp_path / "one")
    try:
        first.start()
        a1 = _turn(a0, _send(first, a0, tenant="a")[0], 905)
        _send(first, a1, tenant="a")  # an entry with a checkpoint, and the anchor of system A
        status, flushed = first.admin("POST", "/flush", {"timeout": 60})
        assert status == 200 and flushed["complete"], flushed
        files_a = set(_files(disk))
        b1 = _turn(b0, _send(first, b0, tenant="b")[0], 906)
        _send(first, b1, tenant="b")
    finally:
        _stop_gracefully(first)  # the shutdown flush writes B's entry
    files_b = set(_files(disk)) - files_a
    assert len(files_a) == 2 and len(files_b) == 2, (files_a, files_b)

    for path in files_a:  # bit rot in A's anchor and entry
        _flip_tensor_byte(path)
    for path in files_b:  # header damage: B's entry checkpoint length, B's anchor length
        contents = integrity.contents(integrity.read_header(path))
        _edit_header_digit(path, "checkpoints" if contents.checkpoints else "length")

    second = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=tmp_path / "two")
    try:
        second.start()
        requests = [
            ("a", _turn(a1, {"choices": [{"message": {"content": "."}}]}, 907)),  # the same conversation
            ("a", [system_a, {"role": "user", "content": text(80, 908)}]),  # a new session, same system
            ("a", a1),  # a resend
            ("b", _turn(b1, {"choices": [{"message": {"content": "."}}]}, 909)),
            ("b", [system_b, {"role": "user", "content": text(80, 910)}]),
        ]
        for i, (tenant, messages) in enumerate(requests):
            warm, line = _send(second, messages, tenant=tenant)
            if i == 0:  # header damage is found when the index is rebuilt (the first request)
                rejected = _rejected(second)
                assert all(rejected.get(p.name) == "hash" for p in files_b), second.log_tail()
                assert not any(p.exists() for p in files_b)
            assert line["kind"] != "disk", line  # nothing restores from a damaged file
            assert_same_output(warm, _cold(second, messages))
        # Bit rot is found when a request loads the file: removed, counted, logged as "hash".
        assert _rejected(second) == {p.name: "hash" for p in files_a | files_b}, second.log_tail()
        assert not any(p.exists() for p in files_a)
        status, body = second.admin("GET", "/status")
        assert status == 200 and body["lineage"]["stats"]["disk_rejects"] == len(files_a), body
        # Operators see every removed file by reason, in /admin/status and in the metrics.
        assert body["lineage"]["disk"]["rejects"] == {"hash": len(files_a | files_b)}, body["lineage"]["disk"]
        status, metrics = second.admin("GET", "/metrics")
        assert status == 200
        assert f'apc_lineage_disk_rejects_total{{reason="hash"}} {float(len(files_a | files_b))}' in metrics, metrics
    finally:
        second.stop()


@pytest.mark.server
def test_kill_9_mid_write_a_second_server_and_a_full_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "lineage-disk"
    system = {"role": "system", "content": text(300, 921)}
    turn0 = [system, {"role": "user", "content": text(80, 922)}]

    stalled = PatchedServer(tiny_model_dir, log_dir=tmp_path / "stalled",
                            env=_env(disk, **FAULTS, APC_TEST_FAULT_DISK_STALL_S="300"))
    stalled.start()
    try:
        _send(stalled, turn0)  # its anchor is written at once: the writer stalls before the rename

        def temp_files() -> list[Path]:
            return [p for p in disk.rglob("*.safetensors") if integrity.is_temp(p)]

        wait_for(lambda: bool(temp_files()), "a stalled temp file", stalled)

        # A second server on the same directory exits at start, naming it and the holder.
        second = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=tmp_path / "second")
        with pytest.raises(ServerError):
            second.start()
        assert second.process is not None and second.process.returncode not in (0, None)
        assert f"lineage disk directory {disk} is in use by process {stalled.pid}" in second.log_text(), \
            second.log_tail()
        again, line = _send(stalled, turn0)  # the first one keeps serving
        # An identical resend restores at its prompt end, n - 1: the entry's head (rewound there
        # when its buffer is lent) or the checkpoint the entry keeps there past its reply.
        assert line["kind"] in ("entry", "final"), line
        assert int(line["restored"]) == again["usage"]["prompt_tokens"] - 1, line

        os.kill(stalled.pid, signal.SIGKILL)
        assert stalled.process.wait(timeout=30) == -signal.SIGKILL
    finally:
        stalled.stop()
    leftovers = temp_files()
    assert leftovers and _files(disk) == [], (leftovers, _files(disk))

    full = PatchedServer(tiny_model_dir, log_dir=tmp_path / "full",
                         env=_env(disk, **FAULTS, APC_TEST_FAULT_DISK_ENOSPC="1",
                                  APC_LINEAGE_DISK_WRITE_DELAY_S="0.5"))
    try:
        full.start()
        assert temp_files() == [], "the temp file of the killed server survived the restart"
        assert "temp file left by an interrupted write" in full.log_text()
        answer, line = _send(full, turn0)
        assert line["kind"] == "cold", line  # nothing of the killed write is restored
        assert_same_output(answer, again)

        # Every write fails with ENOSPC: the attempts back off 1 s, 2 s, 4 s ...
        def delays() -> list[float]:
            return [float(d) for d in re.findall(r"No space left on device.*next attempt in ([\d.]+) s",
                                                 full.log_text())]

        turn1 = _turn(turn0, answer, 923)
        warm, line = _send(full, turn1)
        assert line["kind"] == "entry", line
        assert_same_output(warm, _cold(full, turn1))
        wait_for(lambda: len(delays()) >= 3, "three backed-off write attempts", full)
        assert delays()[:3] == [1, 2, 4], full.log_tail()
        status, body = full.admin("GET", "/status")
        assert status == 200
        failures = body["lineage"]["stats"]["disk_write_failures"]
        # The idle ticks asked to write more often than the writer tried: the rest were refused
        # at once while backing off.
        assert failures > len(delays()), (failures, delays())
        assert list(disk.rglob("*.safetensors")) == []  # no file, no temp file left behind
        warm, line = _send(full, _turn(turn1, warm, 924))
        assert line["kind"] == "entry", line  # RAM still serves
    finally:
        full.stop()
