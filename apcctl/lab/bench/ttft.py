"""Warm turns on a long conversation, one server per mode, each turn's split read as JSON.

Each mode starts its own server (``python -m server_patch.launch --copy-counter=FILE``: the
launcher installs the copy counter), grows one conversation to ``context`` tokens with a cold first
turn, then asks short questions, re-sending every reply verbatim. Per turn it records the
time to first token at the client (streaming) and what the server says of the request:

* patched modes: the request's record from ``GET /admin/requests`` (lookup, admission,
  prefill, commit and first-token ms, restored tokens, how the KV was admitted, and the bytes
  every cache copy moved between lookup and first token, ``copies``);
* stock (``APC_LINEAGE=0``, no ``/admin``): mlx-vlm's own ``GET /metrics`` envelope of the
  latest request (``ttft_s``; ``prompt_eval_time_s``, its prompt batch's time) and the usage's
  ``prompt_tokens_details.cached_tokens``. Stock offers no lookup/admission/commit split, so
  those stay empty; no log line is read.

Both: the counter's running totals (its JSON file) before and after the
turn, which also count what happens after the first token (a deferred commit, stock's store
clone). Modes: ``stock``, ``patched`` (reply reuse on) and ``patched-reuse-off``
(``APC_LINEAGE_REPLY_REUSE=0``). Nothing here asserts a time.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import free_port
from apcctl.core.manage import file_tail, terminate
from apcctl.lab.bench.against import base_mode, groups
from server_patch.observe import ledger

QUESTION = "Which word follows item {n}?"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MODES: dict[str, dict[str, str | None]] = {
    "stock": {"APC_LINEAGE": "0", "APC_LINEAGE_REPLY_REUSE": None},
    "patched": {"APC_LINEAGE": None, "APC_LINEAGE_REPLY_REUSE": "1"},
    "patched-reuse-off": {"APC_LINEAGE": None, "APC_LINEAGE_REPLY_REUSE": "0"},
}
KV_OPS = ("clone", "reserve", "merge", "regrow", "cow", "extract")  # admission + commit copies


class BenchError(RuntimeError):
    """A server did not start, or answered a request with an error."""


@dataclass
class Turn:
    """One request as the client and the server saw it."""

    index: int
    prompt_tokens: int  # usage.prompt_tokens
    restored_tokens: int  # /admin/requests (patched) or usage.cached_tokens (stock)
    reply_tokens: int  # usage.completion_tokens
    ttft_ms: float  # client: request sent -> first streamed token
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    reply_kept: int = 0  # patched: generated tokens the entry kept past the prompt (reply reuse)
    server: dict[str, float] = field(default_factory=dict)  # lookup/admission/prefill/commit/ttft ms
    kv_admission: str = ""  # patched: lent / copied, "" cold or stock
    restore_kind: str = ""
    copies: dict[str, int] = field(default_factory=dict)  # lookup -> first token (patched record)
    turn_copies: dict[str, int] = field(default_factory=dict)  # the whole turn (counter file)
    source: str = ""  # where the split came from

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.restored_tokens

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "prefilled_tokens": self.prefilled_tokens}


def kv_copied(copies: dict[str, int]) -> int:
    """KV bytes (latent, index, pooled, projected rows) moved by admission and commit copies."""
    return sum(v for k, v in copies.items() if k.endswith(".kv") and k.split(".")[0] in KV_OPS)


class BenchServer:
    """One server of ``mode`` with the copy counter on (``--copy-counter``), on a free loopback port."""

    def __init__(self, model_dir: Path, mode: str, workdir: Path, timeout: float = 300.0,
                 env: dict[str, str] | None = None, tree: Path | None = None) -> None:
        self.model_dir, self.mode, self.timeout = model_dir, mode, timeout
        self.tree = tree  # another revision's worktree the server runs from (``--against``)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = workdir / f"server-{mode}.log"
        self.counter_path = workdir / f"copies-{mode}.json"
        self.env = dict(os.environ)
        self.env.update({
            "HF_HUB_OFFLINE": "1", "APC_ENABLED": "1", "APC_DISK_ENABLED": "0", "APC_LINEAGE_DISK": "0",
            "APC_MEMORY_MAX_GB": "8",
            "APC_STATE_DIR": str(workdir / f"state-{mode}"), "APC_DISK_PATH": str(workdir / f"disk-{mode}"),
            "APC_LINEAGE_DISK_PATH": str(workdir / f"lineage-disk-{mode}"), "APC_ADMIN_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
        })
        if tree is not None:
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
        for key, value in {**MODES[base_mode(mode)], **(env or {})}.items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.admin = AdminClient(f"http://127.0.0.1:{self.port}", token=self.token, timeout=30)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def patched(self) -> bool:
        return self.mode != "stock"

    def __enter__(self) -> "BenchServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "server_patch.launch", "--model", str(self.model_dir),
                 "--port", str(self.port), f"--copy-counter={self.counter_path}"],
                cwd=self.tree or self.log_path.parent, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"{self.mode} server exited:\n{self.log_tail()}")
            try:
                self.admin.health()
                return self
            except AdminError:
                time.sleep(0.3)
        self.__exit__()
        raise BenchError(f"{self.mode} server did not start:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            terminate(psutil.Process(self.process.pid), 20)
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        return file_tail(self.log_path, lines)

    def copies(self) -> dict[str, int]:
        """The counter's running totals (the file the server rewrites after every counted copy)."""
        try:
            return json.loads(self.counter_path.read_text())
        except (OSError, ValueError):
            return {}

    def get_json(self, path: str, payload: Any = None, timeout: float = 30) -> Any:
        """GET ``path`` (POST ``payload`` when given) with the admin token; the JSON answer."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.admin.base_url + path, data=data,
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def stream(self, messages: list[dict[str, str]], max_tokens: int,
               on_token: Callable[[float], None] | None = None,
               extra: dict[str, Any] | None = None) -> tuple[float, str, dict[str, Any]]:
        """(ms to the first streamed token, reply text, usage) of one greedy streamed chat request;
        ``on_token`` gets the ``perf_counter`` time of every streamed piece (``bench stall``)."""
        payload = {"model": str(self.model_dir), "messages": messages, "temperature": 0.0,
                   "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                   **(extra or {})}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"{self.mode}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first, text, usage = None, "", {}
        for raw in resp:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece is not None and on_token is not None:
                    on_token(time.perf_counter())
                if piece is not None and first is None:
                    first = (time.perf_counter() - start) * 1000
                text += piece or ""
        conn.close()
        return first if first is not None else (time.perf_counter() - start) * 1000, text, usage


# ------------------------------------------------------------------------------ the split, as JSON


def record_split(record: dict[str, Any]) -> dict[str, float]:
    """The ms fields of one ``/admin/requests`` record."""
    return {k: float(record[k]) for k in ("lookup_ms", "admission_ms", "prefill_ms", "commit_ms", "ttft_ms")}


def newest_record(server: BenchServer, since: int, prompt_tokens: int, wait_s: float = 10.0) -> dict[str, Any]:
    """The newest finished record after ``since`` (it is appended at the first token; one
    request runs at a time, so it is this turn's: its prompt length must match the usage's)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = server.admin.requests(since=since)
        if records:
            record = records[-1]
            if int(record["prompt_tokens"]) != prompt_tokens:
                raise BenchError(f"{server.mode}: /admin/requests has a {record['prompt_tokens']}-token "
                                 f"request, the response said {prompt_tokens}")
            return record
        if time.monotonic() > deadline:
            raise BenchError(f"{server.mode}: no /admin/requests record after seq {since}")
        time.sleep(0.1)


def stock_split(server: BenchServer, completed: int, wait_s: float = 10.0) -> tuple[dict[str, float], int]:
    """mlx-vlm's ``/metrics`` envelope of the request that made ``completed`` + 1: its TTFT and
    its prompt batch's time (``prompt_eval_time_s``: prompt tokens / prompt rate)."""
    deadline = time.monotonic() + wait_s
    while True:
        payload = server.get_json("/metrics")
        done = int(payload["summary"]["requests_completed"])
        if done > completed and payload.get("latest"):
            latest = payload["latest"]
            split = {"ttft_ms": float(latest.get("ttft_s") or 0) * 1000,
                     "prefill_ms": float(latest.get("prompt_eval_time_s") or 0) * 1000}
            return split, done
        if time.monotonic() > deadline:
            raise BenchError(f"{server.mode}: /metrics reports no request after {completed}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------ one conversation


def conversation(context: int, model_dir: Path | None = None) -> list[dict[str, str]]:
    """A system prompt and one user message of about ``context`` tokens: the words per token are
    measured with the model's own tokenizer when ``model_dir`` is given (else ~6 per word, the
    tiny models' WordPiece on these words)."""
    per_word = _tokens_per_word(model_dir) if model_dir is not None else 6.2
    words = max(1, round(context / per_word))
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": _body(words)}]


def _body(words: int) -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]}{i % 97}" for i in range(words))


def _tokens_per_word(model_dir: Path, sample: int = 400) -> float:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(tokenizer.encode(_body(sample), add_special_tokens=False).ids) / sample


def next_turn(messages: list[dict[str, str]], reply: str, index: int) -> list[dict[str, str]]:
    """The conversation with the reply re-sent verbatim and the next short question."""
    return messages + [{"role": "assistant", "content": reply or "ok"},
                       {"role": "user", "content": QUESTION.format(n=index + 1)}]


def run_turn(server: BenchServer, index: int, messages: list[dict[str, str]], max_tokens: int,
             cursor: dict[str, int]) -> tuple[Turn, str]:
    """One request; ``cursor`` holds where the last one's record (seq) or count left off."""
    before = server.copies()
    ttft_ms, text, usage = server.stream(messages, max_tokens)
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
    turn = Turn(index, prompt_tokens, cached, int(usage.get("completion_tokens", 0)), round(ttft_ms, 1), cached)
    time.sleep(0.5)  # a deferred commit (and the reply's entry) follows the end of the stream
    if server.patched:
        record = newest_record(server, cursor.get("seq", 0), prompt_tokens)
        cursor["seq"] = int(record["seq"])
        turn.server, turn.source = record_split(record), "/admin/requests"
        turn.restored_tokens = int(record["restored_tokens"])
        turn.kv_admission, turn.restore_kind = record["kv_admission"], record["restore_kind"]
        turn.copies = dict(record.get("copies") or {})
        turn.reply_kept = int(record.get("reply_tokens", 0) or 0)
    else:
        turn.server, cursor["completed"] = stock_split(server, cursor.get("completed", 0))
        turn.source = "/metrics + usage"
    turn.turn_copies = ledger.delta(server.copies(), before)
    return turn, text


def run_mode(model_dir: Path, mode: str, context: int, questions: int, max_tokens: int, workdir: Path,
             timeout: float, echo: Callable[[str], None]) -> tuple[list[Turn], list[list[dict[str, str]]]]:
    """The turns of one server, and the messages each turn sent."""
    return run_modes(model_dir, [mode], context, questions, max_tokens, workdir, timeout, echo)[mode]


def run_modes(model_dir: Path, modes: list[str], context: int, questions: int, max_tokens: int, workdir: Path,
              timeout: float, echo: Callable[[str], None], trees: dict[str, Path] | None = None
              ) -> dict[str, tuple[list[Turn], list[list[dict[str, str]]]]]:
    """Per mode, the turns of its server and the messages each turn sent: the servers run side by
    side, turn by turn, the order reversed every other turn (``--against``: the box's load falls on
    both alike); ``trees``: the modes whose server runs from another revision's worktree."""
    out: dict[str, tuple[list[Turn], list[list[dict[str, str]]]]] = {m: ([], []) for m in modes}
    with ExitStack() as stack:
        servers = {m: stack.enter_context(BenchServer(model_dir, m, workdir, timeout, tree=(trees or {}).get(m)))
                   for m in modes}
        messages = {m: conversation(context, model_dir) for m in modes}
        cursors: dict[str, dict[str, int]] = {m: {} for m in modes}
        for i in range(questions + 1):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                turns, sent = out[mode]
                sent.append(messages[mode])
                turn, text = run_turn(servers[mode], i, messages[mode], max_tokens, cursors[mode])
                turns.append(turn)
                echo(f"  {mode} turn {i}: prompt {turn.prompt_tokens} restored {turn.restored_tokens} "
                     f"prefilled {turn.prefilled_tokens} reply {turn.reply_tokens}; ttft {turn.ttft_ms:.0f} ms, "
                     f"KV copied {kv_copied(turn.turn_copies) / 1e6:.1f} MB")
                messages[mode] = next_turn(messages[mode], text, i)
    return out


# ------------------------------------------------------------------------------ summary


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def summarize(turns: list[Turn]) -> dict[str, Any]:
    """Medians over the warm turns (those that restored something)."""
    warm = [t for t in turns[1:] if t.restored_tokens > 0]
    out: dict[str, Any] = {"warm_turns": len(warm), "cold_ttft_ms": turns[0].ttft_ms if turns else None}
    if not warm:
        return out
    out.update({
        "prompt_tokens": warm[-1].prompt_tokens,
        "restored_tokens": _median([t.restored_tokens for t in warm]),
        "prefilled_tokens": _median([t.prefilled_tokens for t in warm]),
        "reply_tokens": _median([t.reply_tokens for t in turns]),
        "ttft_ms": _median([t.ttft_ms for t in warm]),
        "ttft_ms_min": min(t.ttft_ms for t in warm),
        # after two warm turns MLX's pool holds a buffer of the merge's size
        "ttft_ms_steady": _median([t.ttft_ms for t in warm[2:]]),
        "kv_copied_bytes": _median([kv_copied(t.turn_copies) for t in warm]),
        "kv_copied_to_first_token_bytes": _median([kv_copied(t.copies) for t in warm]) if warm[0].copies else None,
        "lent_turns": sum(1 for t in warm if t.kv_admission == "lent"),
        "source": warm[0].source,
    })
    for key in ("lookup_ms", "admission_ms", "prefill_ms", "commit_ms", "ttft_ms"):
        values = [t.server[key] for t in warm if key in t.server]
        if values:
            out[f"server_{key}"] = _median(values)
    ops: dict[str, list[int]] = {}
    for t in warm:
        for k, v in t.turn_copies.items():
            ops.setdefault(k, []).append(v)
    out["copies_by_op"] = {k: int(statistics.median(v + [0] * (len(warm) - len(v)))) for k, v in sorted(ops.items())}
    return out


def forward_cases(turns: dict[str, list[Turn]], sent: dict[str, list[list[dict[str, str]]]]) -> list[dict[str, Any]]:
    """One in-process forward case per distinct first warm turn: its messages and how many of
    its tokens the mode restored (stock and reuse-off restore the same n - 1)."""
    cases: list[dict[str, Any]] = []
    for mode, mode_turns in turns.items():
        if len(mode_turns) < 2 or mode_turns[1].restored_tokens <= 0:
            continue
        case = {"messages": sent[mode][1], "restored": mode_turns[1].restored_tokens}
        for known in cases:
            if known["messages"] == case["messages"] and known["restored"] == case["restored"]:
                known["modes"].append(mode)
                break
        else:
            cases.append({**case, "modes": [mode]})
    return cases


def run_forward(cases: list[dict[str, Any]], model_dir: Path, repeat: int, workdir: Path) -> list[dict[str, Any]]:
    """``python -m apcctl.lab.bench.ttft_forward`` in a fresh process (the overlay patches mlx-vlm
    at import): each case's suffix forward, stock and patched."""
    spec = workdir / "forward-cases.json"
    spec.write_text(json.dumps(cases))
    done = subprocess.run(
        [sys.executable, "-m", "apcctl.lab.bench.ttft_forward", "--model", str(model_dir), "--cases", str(spec),
         "--repeat", str(repeat)],
        env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, cwd=workdir)
    if done.returncode != 0:
        raise BenchError(f"suffix forward measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ttft_target(summary: dict[str, Any], forward: dict[str, Any]) -> dict[str, Any]:
    """Warm TTFT against the faster of the two in-process forwards of the same suffix."""
    faster = min(forward["stock_one_forward_ms"], forward["one_forward_ms"])
    ttft = summary.get("ttft_ms")
    return {"stock_forward_ms": forward["stock_one_forward_ms"], "patched_forward_ms": forward["one_forward_ms"],
            "faster_forward_ms": faster, "ratio": round(ttft / faster, 2) if ttft and faster else None}


def run(model_dir: Path, modes: list[str], context: int, questions: int, max_tokens: int, repeat: int,
        workdir: Path, timeout: float, echo: Callable[[str], None],
        trees: dict[str, Path] | None = None) -> dict[str, Any]:
    """The whole bench: every mode's turns, summaries, the in-process forwards and the targets;
    a ``patched@REF`` mode of ``trees`` runs interleaved with ``patched`` (``bench.against``)."""
    result: dict[str, Any] = {"context": context, "max_tokens": max_tokens, "modes": modes, "turns": {},
                              "summary": {}, "workdir": str(workdir), "load_avg": list(os.getloadavg())}
    turns: dict[str, list[Turn]] = {}
    sent: dict[str, list[list[dict[str, str]]]] = {}
    for group in groups(modes):
        echo(f"{' + '.join(group)} server: cold turn of ~{context:,} tokens, then {questions} short questions")
        for mode, (mode_turns, mode_sent) in run_modes(model_dir, group, context, questions, max_tokens,
                                                       workdir, timeout, echo, trees).items():
            turns[mode], sent[mode] = mode_turns, mode_sent
            result["turns"][mode] = [t.as_dict() for t in mode_turns]
            result["summary"][mode] = summarize(turns[mode])
    cases = forward_cases(turns, sent)
    result["forward"] = []
    if repeat > 0 and cases:
        echo("suffix forward in-process, over each first warm turn's restored cache")
        result["forward"] = run_forward(cases, model_dir, repeat, workdir)
    result["targets"] = {}
    for forward in result["forward"]:
        for mode in forward["modes"]:
            if mode != "stock":
                result["targets"][mode] = ttft_target(result["summary"][mode], forward)
    result["load_avg_end"] = list(os.getloadavg())
    return result
