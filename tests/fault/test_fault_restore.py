"""Faults around a restore: whatever state a restore cannot trust is a cold prefill.

* In-process (mlx-vlm's ResponseGenerator with the overlay, tiny model, real disk files): a
  branch whose disk file fails to load while the lineage it forked from is decoding on a lent
  buffer. The re-plan after the failed load lands on the lent entry; it must be swept (the
  loan ends, the rows come back) before anything is built, and the answer equals a cold run's.
* Real server: two tenants send the same prompt at once; each commits into its own namespace,
  each next turn restores only from its own, and every answer equals a cold prefill's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.server_harness import (PatchedServer, assert_same_output, cached_tokens, parse_lineage_lines,
                            prompt_tokens, reply_text, text)
from tests.e2e.test_e2e_conversation import _max_in_flight, _run_concurrently

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(r"""
    import json, logging, os, sys, threading, time
    from server_patch.overlay import install
    install()
    import numpy as np
    from mlx_vlm import apc as _apc
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.server.generation import GenerationArguments, ResponseGenerator
    from server_patch.integration.parts import of_server
    current = lambda: of_server().runtimes.current  # the server's open lineage runtime

    loans = []

    class Grab(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("apc_copyfree loan"):
                loans.append(message.split(": ", 1)[1])

    logging.getLogger("server_patch.lineage").addHandler(Grab())
    logging.getLogger("server_patch.lineage").setLevel(logging.INFO)

    model_dir, mode = sys.argv[1], sys.argv[2]
    warm = mode == "warm"
    rg = ResponseGenerator(model_path=model_dir, top_logprobs_k=1,
                           apc_manager=_apc.from_env(model_namespace="t") if warm else None)
    model, processor, config = rg.wait_until_ready()
    eos = sorted(int(t) for t in rg.stop_tokens)

    def text(n, seed):
        rng = np.random.RandomState(seed)
        words = "apple banana cherry delta echo fox golf hotel india juliet kilo lima".split()
        return " ".join(words[i] + str(int(j)) for i, j in zip(rng.randint(0, 12, n), rng.randint(0, 99, n)))

    def ask(messages, max_tokens=6, on_first=None):
        prompt = apply_chat_template(processor, config, messages)
        args = GenerationArguments(max_tokens=max_tokens, temperature=0.0, logprobs=True,
                                   logit_bias={t: -1000.0 for t in eos})
        ctx, it = rg.generate(prompt=prompt, args=args)
        out, tokens, logprobs = "", [], []
        for tok in it:
            if on_first is not None:
                on_first.set()
                on_first = None
            out += tok.text
            tokens.append(int(tok.token))
            logprobs.append(float(tok.logprobs))
            if tok.finish_reason:
                break
        time.sleep(0.2)  # the request leaves the batch: its deferred entry is committed
        return {"prompt": ctx.prompt_tokens, "text": out, "tokens": tokens, "logprobs": logprobs}

    def record_of(prompt_tokens):
        for r in reversed(list(current().timings.all())):
            if r.prompt_tokens == prompt_tokens:
                return {"kind": r.restore_kind, "restored": r.restored_tokens, "kv": r.kv_admission}
        return None

    def turn(messages, answer, seed):
        return messages + [{"role": "assistant", "content": answer["text"] or "ok"},
                           {"role": "user", "content": text(12, seed)}]

    out = {}
    x1 = [{"role": "system", "content": text(40, 1)}, {"role": "user", "content": text(120, 2)}]
    a1 = ask(x1)
    x2 = turn(x1, a1, 3)
    a2 = ask(x2)  # lineage X: its entry holds x2, with x1's end as a checkpoint
    y2 = turn(x1, a1, 4)
    ay = ask(y2)  # branch Y forks from X at x1's end: its own entry
    if warm:
        rt = current()
        rt.flush()
        # reply reuse: an entry holds its prompt and every generated token (no EOS here)
        branch = next(e for e in rt.cache.entries() if e.length == ay["prompt"] + len(ay["tokens"]))
        path = rt.disk.path_of(branch.id)
        rt.cache.drop(branch.id, "test: only its disk file is left")
        with open(path, "r+b") as f:  # the file fails validation at load (any format, any hash)
            f.truncate(os.path.getsize(path) // 2)
        loans.clear()
    x3 = turn(x2, a2, 5)
    decoding, long_out = threading.Event(), {}
    t = threading.Thread(target=lambda: long_out.update(ask(x3, max_tokens=30, on_first=decoding)))
    t.start()
    decoding.wait(120)
    b = ask(turn(y2, ay, 6))  # Y's next turn: its file is the best restore point, and it is bad
    t.join(300)
    out["long"], out["branch"] = long_out, b
    if warm:
        out["long_record"], out["branch_record"] = record_of(long_out["prompt"]), record_of(b["prompt"])
        # the fork: the end of a1's reply if it re-renders token for token, else x1's end
        out["checkpoints"] = [a1["prompt"] - 1, a1["prompt"] + len(a1["tokens"])]
        out["loans"] = list(loans)
        out["rejects"] = [e.detail for _, _, e in rt.events if e.kind == "disk_reject"]
        out["file_left"] = os.path.exists(path)
    print(json.dumps(out))
    rg.stop_and_join()
""")


def _run(model_dir: Path, tmp_path: Path, mode: str) -> dict:
    env = dict(os.environ, APC_ENABLED="1", APC_DISK_ENABLED="0", APC_LINEAGE_DISK="1",
               APC_LINEAGE_DISK_PATH=str(tmp_path / f"disk-{mode}"), PREFILL_STEP_SIZE="128",
               HF_HUB_OFFLINE="1", APC_STATE_DIR=str(tmp_path / f"state-{mode}"), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), mode], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_branch_whose_file_fails_while_its_origin_decodes_on_a_lent_buffer(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    warm, cold = _run(tiny_model_dir, tmp_path, "warm"), _run(tiny_model_dir, tmp_path, "cold")
    # The origin's next turn was lent its entry's buffer and was decoding meanwhile.
    assert warm["long_record"]["kv"] == "lent", warm["long_record"]
    # The branch's file was rejected (and removed) ...
    assert len(warm["rejects"]) == 1 and not warm["file_left"], warm
    # ... so its re-plan landed on the lent entry's checkpoint at the fork: the sweep ended the
    # loan first (the rows came back), and the restore from there was built from real rows.
    assert "shared" in warm["loans"], warm["loans"]
    assert warm["branch_record"]["restored"] in warm["checkpoints"], warm["branch_record"]
    assert warm["branch_record"]["kind"] != "disk"
    # Both answers are a cold run's: tokens, and their log-probabilities (the tiny model's greedy
    # text barely depends on the prompt; a restore from missing rows shows in the numbers).
    for name in ("branch", "long"):
        assert warm[name]["tokens"] == cold[name]["tokens"], name
        assert warm[name]["logprobs"] == pytest.approx(cold[name]["logprobs"], abs=1e-3), name


# ----------------------------------------------------------------------------- tenants

PARAMS = {"max_tokens": 6, "logprobs": True, "top_logprobs": 5}


def _restore_line(server: PatchedServer, before: int) -> dict[str, str]:
    lines = server.lineage_lines("restore")
    assert len(lines) == before + 1, server.log_tail()
    return lines[-1]


def _no_eos(model_dir: Path) -> dict[str, float]:
    """A ``logit_bias`` that keeps the model from stopping (it decodes all ``max_tokens``)."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id") or config["text_config"]["eos_token_id"]
    return {str(t): -100.0 for t in (eos if isinstance(eos, list) else [eos])}


def _wait_decoding(server: PatchedServer, mark: int, timeout: float = 60.0) -> None:
    """Until the server logs a first token after ``mark`` (the timeout only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not parse_lineage_lines(server.log_text()[mark:], "timing"):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)


def _conversations(server: PatchedServer, length: int) -> dict[str, str]:
    """{entry id: namespace} of the conversation entries in RAM whose prompt ended at
    ``length`` tokens: their head (no reply kept), or their newest turn's prompt end (reply
    reuse: the head sits past the reply, the prompt end is a final checkpoint)."""
    status, body = server.admin("GET", "/entries?kind=conversation&tier=ram")
    assert status == 200, body
    return {e["id"]: e["namespace"] for e in body["entries"]
            if e["length"] == length or any(c["length"] == length and c["kind"] == "final"
                                            for c in e["checkpoints"])}


@pytest.mark.server
def test_two_tenants_sending_the_same_prompt_at_once_keep_their_own_entries(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    tenants = ("tenant-a", "tenant-b")
    with PatchedServer(tiny_model_dir, env={"TOP_LOGPROBS_K": "5"}, log_dir=tmp_path) as server:
        # Each tenant's namespace, from an entry of its own (the salt is the server's business).
        own = {}
        for i, tenant in enumerate(tenants):
            probe = server.chat([{"role": "user", "content": text(80 + 20 * i, 400 + i)}], tenant=tenant,
                                max_tokens=2)
            [own[tenant]] = _conversations(server, prompt_tokens(probe) - 1).values()
        assert own["tenant-a"] != own["tenant-b"]

        messages = [{"role": "system", "content": text(300, 410)},
                    {"role": "user", "content": text(200, 411)}]
        mark = len(server.log_text())
        # A request decoding meanwhile keeps the generator busy, so the two arrive in its queue
        # together and are admitted into one prompt batch (both pending at once).
        blocker = threading.Thread(target=lambda: server.chat(
            [{"role": "user", "content": text(50, 413)}], tenant="tenant-blocker",
            **{**PARAMS, "max_tokens": 150}, logit_bias=_no_eos(tiny_model_dir)))
        blocker.start()
        _wait_decoding(server, mark)
        first = _run_concurrently([(lambda t=t: server.chat(messages, tenant=t, **PARAMS)) for t in tenants])
        blocker.join(120)
        assert _max_in_flight(server, mark) >= 3, "the requests never overlapped"
        length = prompt_tokens(first[0]) - 1
        committed = _conversations(server, length)
        assert sorted(committed.values()) == sorted(own.values()), committed  # one entry each

        cold_first = server.chat(messages, tenant="tenant-cold-1", **PARAMS)
        for answer in first:
            assert_same_output(answer, cold_first)
        for tenant, answer in zip(tenants, first):
            follow = messages + [{"role": "assistant", "content": reply_text(answer)},
                                 {"role": "user", "content": text(40, 412)}]
            before = len(server.lineage_lines("restore"))
            warm = server.chat(follow, tenant=tenant, **PARAMS)
            line = _restore_line(server, before)
            assert line["kind"] == "entry" and cached_tokens(warm) >= length, line  # past the reply
            assert committed[line["entry"]] == own[tenant], (tenant, line, committed)
            assert_same_output(warm, server.chat(follow, tenant=f"{tenant}-cold", **PARAMS))
