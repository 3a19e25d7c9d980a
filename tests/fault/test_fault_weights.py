"""Weights changed in place between two runs of a real server on one disk directory.

The attack: scale rows in the middle of a tensor of the tiny model's safetensors (same size,
same inode, the first and last 2,048 values of every tensor unchanged: the old fingerprint's
sample), restart on the same disk directory. Before the fix the fingerprint held, the old
weights' state came back from disk, and the warm answer differed from a cold one. Now every
byte of the weight files is in the fingerprint: the old files are never restored, and the warm
answer is the cold answer of the new weights.
"""

from __future__ import annotations

import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import PatchedServer, assert_same_output, first_top_logprobs, text
from tests.disk.test_weights_hash import head_tail_samples, scale_middle_rows

PARAMS = {"max_tokens": 6, "logprobs": True, "top_logprobs": 5}
TENANT = "weights-suite"


def _env(disk: Path, state: Path) -> dict[str, str]:
    # One state dir for both runs: the second reads the first's cached digests and must see
    # that the file changed.
    return {"APC_LINEAGE_DISK": "1", "APC_LINEAGE_DISK_PATH": str(disk), "APC_STATE_DIR": str(state),
            "TOP_LOGPROBS_K": "5"}


def _send(server: PatchedServer, messages: list[dict], tenant: str) -> tuple[dict[str, Any], dict[str, str]]:
    return server.chat_restore(messages, tenant=tenant, **PARAMS)


def _fingerprint(server: PatchedServer) -> str:
    """The model fingerprint of a server whose disk tier is on (in its own directory)."""
    status, body = server.admin("GET", "/status")
    assert status == 200, body
    fingerprint = body["server"]["fingerprint"]
    assert body["lineage"]["disk_path"].endswith(fingerprint[:16]), body["lineage"]
    return fingerprint


@pytest.mark.server
def test_weights_rewritten_in_place_restore_nothing_and_answer_as_cold(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    disk, state = tmp_path / "lineage-disk", tmp_path / "state"
    conversation = [{"role": "system", "content": text(300, 401)}, {"role": "user", "content": text(120, 402)}]

    first = PatchedServer(model, env=_env(disk, state), log_dir=tmp_path / "one")
    try:
        first.start()
        old_answer, _ = _send(first, conversation, TENANT)
        old_fingerprint = _fingerprint(first)
    finally:
        code = first.stop(timeout=60)  # SIGTERM: the shutdown flush writes the conversation
    assert code in (0, -signal.SIGTERM), first.log_tail()
    old_files = sorted(disk.rglob("*.safetensors"))
    assert old_files, "the first run wrote nothing to disk"

    weights = model / "model.safetensors"
    samples = head_tail_samples(weights)
    assert scale_middle_rows(weights)
    assert head_tail_samples(weights) == samples  # the old fingerprint could not see this

    second = PatchedServer(model, env=_env(disk, state), log_dir=tmp_path / "two")
    try:
        second.start()
        warm, line = _send(second, conversation, TENANT)
        assert line["kind"] == "cold", line  # nothing of the old weights' state is restored
        assert _fingerprint(second) != old_fingerprint
        cold, cold_line = _send(second, conversation, f"cold-{uuid.uuid4().hex[:8]}")
        assert cold_line["kind"] == "cold", cold_line
        assert_same_output(warm, cold)
        # The weights did change what the model computes: the old run's answer is not the new one's.
        assert first_top_logprobs(old_answer) != first_top_logprobs(cold)
        assert all(p.exists() for p in old_files)  # another model's files: left, never read
    finally:
        second.stop()
