"""``apcctl bench ttft``: short warm turns on a long conversation, stock and patched side by side.

One run starts a stock server (``APC_LINEAGE=0``, ``APC_ENABLED=1``) and then a patched one on
the ``bench`` model (KV weighs what it weighs on the real model), both with the copy counter
(``python -m server_patch.copyfree.counted``). Each grows one conversation to ``--context``
tokens with a cold first turn, then asks ``--questions`` short questions of about 22 new
tokens (the previous reply plus the question). Per warm turn it records the time to first
token at the client (streaming), the server's split (``apc_lineage`` log lines: lookup,
admission, prefill, commit; stock logs only its prefill time) and the bytes every cache copy
moved (``APC_COPY_COUNTER_FILE``). In a subprocess it then times the suffix forward alone: one
forward of the suffix over a restored ``--context``-token cache (and the 0.7.10 split of it,
suffix - 1 tokens then 1), the copy into the batch layout excluded.

Not a test: nothing here asserts a time. ``--json`` prints every number.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONTEXT = 4096  # 16384 works too; the patched cold prefill of the bench preset is slow on a CPU
QUESTION = "Which word follows item {n}?"
KV_OPS = ("clone", "reserve", "merge", "regrow", "cow", "extract")  # admission + commit copies
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def register(main: click.Group, bench: click.Group) -> None:
    del main
    bench.add_command(ttft)


# ------------------------------------------------------------------------------ one server


@dataclass
class Turn:
    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0  # client: request sent -> first streamed token
    server: dict[str, float] = field(default_factory=dict)  # lookup/admission/prefill/commit ms
    copies: dict[str, int] = field(default_factory=dict)  # counter delta, "op.kind" -> bytes
    commit_mode: str = ""  # patched: adopt / copy (deferred) or "" (immediate)

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def kv_copied(self) -> int:
        return sum(v for k, v in self.copies.items() if k.endswith(".kv") and k.split(".")[0] in KV_OPS)


class BenchServer:
    """A ``server_patch.copyfree.counted`` subprocess on a free loopback port."""

    def __init__(self, model_dir: Path, mode: str, workdir: Path, timeout: float) -> None:
        self.model_dir, self.mode, self.timeout = model_dir, mode, timeout
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log_path = workdir / f"server-{mode}.log"
        self.counter_path = workdir / f"copies-{mode}.json"
        self.env = dict(os.environ)
        self.env.update({
            "HF_HUB_OFFLINE": "1", "APC_ENABLED": "1", "APC_DISK_ENABLED": "0",
            "APC_LINEAGE_DISK": "0", "APC_MEMORY_MAX_GB": "8", "APC_COPY_COUNTER": "1",
            "APC_COPY_COUNTER_FILE": str(self.counter_path), "APC_STATE_DIR": str(workdir / f"state-{mode}"),
            "APC_DISK_PATH": str(workdir / f"disk-{mode}"), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        })
        if mode == "stock":
            self.env["APC_LINEAGE"] = "0"
        else:
            self.env.pop("APC_LINEAGE", None)
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "BenchServer":
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "server_patch.copyfree.counted", "--model", str(self.model_dir),
                 "--port", str(self.port)], cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise click.ClickException(f"{self.mode} server exited:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise click.ClickException(f"{self.mode} server did not start:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def copies(self) -> dict[str, int]:
        try:
            return json.loads(self.counter_path.read_text())
        except (OSError, ValueError):
            return {}

    def stream(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, dict]:
        """(ms to the first streamed token, reply text, usage) of one greedy chat request."""
        payload = {"model": str(self.model_dir), "messages": messages, "temperature": 0.0,
                   "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise click.ClickException(f"{self.mode}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first, text, usage = None, "", {}
        for raw in resp:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece is not None and first is None:
                    first = (time.perf_counter() - start) * 1000
                text += piece or ""
        conn.close()
        return first if first is not None else (time.perf_counter() - start) * 1000, text, usage


_KV = re.compile(r"(\w+)=([^\s]+)")


def _lines(text: str, marker: str) -> list[dict[str, str]]:
    return [dict(_KV.findall(line.split(marker, 1)[1])) for line in text.splitlines() if marker in line]


def _server_split(server: BenchServer, seen: dict[str, int]) -> tuple[dict[str, float], str]:
    """The newest request's split from the log, and how a deferred entry was committed."""
    text = server.log_text()
    split: dict[str, float] = {}
    restores, timings = _lines(text, "apc_lineage restore "), _lines(text, "apc_lineage timing ")
    if len(restores) > seen.get("restore", 0) and len(timings) > seen.get("timing", 0):
        for key in ("lookup_ms", "admission_ms"):
            split[key] = float(restores[-1][key])
        for key in ("prefill_ms", "commit_ms", "ttft_ms"):
            split[key] = float(timings[-1][key])
    prefills = re.findall(r"Prefill completed: .*elapsed=([\d.]+)s", text)
    if len(prefills) > seen.get("prefill", 0):
        split["prefill_elapsed_ms"] = float(prefills[-1]) * 1000
    firsts = re.findall(r"time_to_first_token=([\d.]+)s", text)
    if len(firsts) > seen.get("first", 0):
        split["server_ttft_ms"] = float(firsts[-1]) * 1000
    if len(restores) > seen.get("restore", 0):
        split["kv_lent"] = 1.0 if restores[-1].get("kv") == "lent" else 0.0
    commits = _lines(text, "apc_copyfree commit ")
    mode = commits[-1].get("mode", "") if len(commits) > seen.get("commit", 0) else ""
    seen.update(restore=len(restores), timing=len(timings), prefill=len(prefills), first=len(firsts),
                commit=len(commits))
    return split, mode


def conversation(context: int) -> list[dict[str, str]]:
    """A system prompt and one user message of about ``context`` tokens (~5 tokens per 1 word)."""
    words = max(1, context // 5)
    body = " ".join(f"{WORDS[i % len(WORDS)]}{i % 97}" for i in range(words))
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": body}]


def run_server(model_dir: Path, mode: str, context: int, questions: int, max_tokens: int,
               workdir: Path, timeout: float, echo: Any) -> tuple[list[Turn], list[list[dict[str, str]]]]:
    """The turns, and the messages each turn sent."""
    turns: list[Turn] = []
    sent: list[list[dict[str, str]]] = []
    with BenchServer(model_dir, mode, workdir, timeout) as server:
        messages = conversation(context)
        seen: dict[str, int] = {}
        for i in range(questions + 1):
            before = server.copies()
            sent.append(messages)
            ttft_ms, text, usage = server.stream(messages, max_tokens)
            time.sleep(0.5)  # the deferred commit runs when the request leaves the batch
            split, mode_used = _server_split(server, seen)
            details = usage.get("prompt_tokens_details") or {}
            turn = Turn(i, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0) or 0),
                        round(ttft_ms, 1), split, _delta(server.copies(), before), mode_used)
            turns.append(turn)
            echo(f"  {mode} turn {i}: prompt {turn.prompt_tokens} cached {turn.cached_tokens} "
                 f"ttft {turn.ttft_ms:.0f} ms, KV copied {turn.kv_copied() / 1e6:.1f} MB")
            messages = messages + [{"role": "assistant", "content": text or "ok"},
                                   {"role": "user", "content": QUESTION.format(n=i + 1)}]
    return turns, sent


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


# ------------------------------------------------------------------------------ suffix forward


def forward_times(model_dir: Path, cold: list[dict[str, str]], warm: list[dict[str, str]],
                  repeat: int) -> dict[str, float]:
    """In this process (the overlay is installed here): the suffix forward over a restored cache.

    ``cold`` and ``warm`` are the messages of the conversation's first two turns; their token
    ids come from the chat template and tokenizer the server uses, so the suffix is the first
    warm turn's (MoE routing, hence cost, depends on the tokens). The cache of the cold prompt's
    first n - 1 tokens (the lineage entry) is built with stock attention (the patched sparse path
    is slow for long chunks on a CPU; the state differs by float rounding only). Each path then
    restores it the way its server does (``*restore_ms``, not part of the forward): patched,
    lineage views and the copy-free merge; stock, its clone of the whole snapshot (projected
    cache included) and its merge. Timed: one forward of the suffix, and the two forwards 0.7.10
    runs (suffix - 1 prompt tokens, then the last one), each evaluated with the cache; patched
    sparse attention with the patched server's pool limit, stock attention with MLX's default
    limit (``stock_*``), as each server runs.
    """
    from server_patch.overlay import install

    install()
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.models.glm5_next import language
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    from mlx_vlm.apc import _clone_prompt_cache_for_apc, make_warm_batch_exact_cache_multi

    from server_patch.copyfree.merge import merge_rows
    from server_patch.copyfree.settings import CopyFreeSettings
    from server_patch.state.layout import CacheLayout

    model, processor = load(str(model_dir))
    lm = model.language_model

    def ids(messages: list[dict[str, str]]) -> list[int]:
        prompt = apply_chat_template(processor, model.config, messages)
        return prepare_inputs(processor, prompts=prompt)["input_ids"][0].tolist()

    context = len(ids(cold)) - 1
    tokens = ids(warm)
    suffix = len(tokens) - context
    patched = language.Glm5NextAttention._attend
    language.Glm5NextAttention._attend = language.Glm5NextAttention._stock_attend
    try:
        cache = lm.make_cache()
        for start in range(0, context, 2048):
            out = lm(mx.array(tokens[start:min(context, start + 2048)])[None], cache=cache)
            mx.eval(out.logits, [c.state for c in cache])
    finally:
        language.Glm5NextAttention._attend = patched
    layout = CacheLayout.from_model(lm)
    kv, snapshot = layout.split(cache, context)  # views of ``cache``, which is not written again

    def patched_restore() -> list[Any]:
        # the lineage restore: views, then the one copy (the copy-free merge)
        return merge_rows([layout.build(kv, snapshot, context)], [context], [suffix], 256)

    def stock_restore() -> list[Any]:
        # stock 0.7.10's: a clone of the whole snapshot (projected cache included, so stock's
        # attention finds it in sync), then its merge
        clone = _clone_prompt_cache_for_apc(cache, min_capacity_tokens=len(tokens))
        merged, _ = make_warm_batch_exact_cache_multi([clone], [context])
        return merged

    def run(restore: Any, chunks: list[int]) -> tuple[float, float]:
        start = time.perf_counter()
        caches = restore()
        restore_ms = (time.perf_counter() - start) * 1000
        start, at = time.perf_counter(), context
        for n in chunks:
            out = lm(mx.array(tokens[at:at + n])[None], cache=caches)
            mx.eval(out.logits, [c.state for c in caches])
            at += n
        return (time.perf_counter() - start) * 1000, restore_ms

    # Each path under its own server's pool setting: the patched server raises MLX's cache limit
    # (on the CPU backend the default keeps 32 MB, so every large temporary is page-faulted in
    # afresh); the stock server keeps the default.
    default_limit = mx.set_cache_limit(0)
    mx.set_cache_limit(default_limit)
    results: dict[str, list[float]] = {}
    paths = (("stock_", language.Glm5NextAttention._stock_attend, default_limit, stock_restore),
             ("", patched, int(CopyFreeSettings.from_env().pool_limit_gb * (1 << 30)), patched_restore))
    for i in range(repeat + 1):  # the first round warms up (and fills MLX's pool)
        for attention, attend, limit, restore in paths:  # interleaved: host load hits both alike
            language.Glm5NextAttention._attend = attend
            mx.set_cache_limit(limit)
            try:
                one, restore_ms = run(restore, [suffix])
                split, _ = run(restore, [suffix - 1, 1])
            finally:
                language.Glm5NextAttention._attend = patched
            if i:
                results.setdefault(f"{attention}one_forward_ms", []).append(one)
                results.setdefault(f"{attention}split_forwards_ms", []).append(split)
                results.setdefault(f"{attention}restore_ms", []).append(restore_ms)
    out = {k: round(statistics.median(v), 1) for k, v in results.items()}
    out.update(context=context, suffix=suffix, kv_bytes=int(kv.nbytes))
    return out


def _forward_subprocess(model_dir: Path, cold: list[dict[str, str]], warm: list[dict[str, str]],
                        repeat: int, workdir: Path) -> dict[str, float]:
    spec = workdir / "forward-messages.json"
    spec.write_text(json.dumps({"cold": cold, "warm": warm}))
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-m", "apcctl.commands.bench_ttft", str(model_dir), str(spec), str(repeat)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"suffix forward measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ report


def summarize(turns: list[Turn]) -> dict[str, Any]:
    warm = [t for t in turns[1:] if t.cached_tokens > 0]
    if not warm:
        return {"warm_turns": 0}

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 1) if values else float("nan")

    out: dict[str, Any] = {
        "warm_turns": len(warm),
        "cold_ttft_ms": turns[0].ttft_ms,
        "prompt_tokens": warm[-1].prompt_tokens,
        "new_tokens": median([t.new_tokens for t in warm]),
        "ttft_ms": median([t.ttft_ms for t in warm]),
        "ttft_ms_min": min(t.ttft_ms for t in warm),
        # after two warm turns MLX's pool holds a buffer of the merge's size (a turn frees the
        # buffer of the entry two turns back), so these no longer page-fault a fresh one
        "ttft_ms_steady": median([t.ttft_ms for t in warm[2:]]) if len(warm) > 2 else None,
        "kv_copied_bytes": median([t.kv_copied() for t in warm]),
        "restored_tokens": median([t.cached_tokens for t in warm]),
        "commit_modes": sorted({t.commit_mode or "immediate" for t in warm}),
        # warm turns whose restored KV was the entry's own buffer, lent (no merge copy)
        "lent_turns": sum(1 for t in warm if t.server.get("kv_lent")),
    }
    for key in ("lookup_ms", "admission_ms", "prefill_ms", "commit_ms", "prefill_elapsed_ms", "server_ttft_ms"):
        values = [t.server[key] for t in warm if key in t.server]
        if values:
            out[key] = median(values)
    ops: dict[str, list[int]] = {}
    for t in warm:
        for k, v in t.copies.items():
            ops.setdefault(k, []).append(v)
    out["copies_by_op"] = {k: int(statistics.median(v + [0] * (len(warm) - len(v)))) for k, v in sorted(ops.items())}
    return out


def _forward_ms(forward: dict[str, float], mode: str) -> float:
    """One forward of the suffix with the mode's own attention path."""
    return forward["stock_one_forward_ms" if mode == "stock" else "one_forward_ms"]


def _fmt_ms(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def render(result: dict[str, Any]) -> str:
    forward = result["forward"]
    kv_one = forward["kv_bytes"]
    rows = [("", *result["modes"])]
    s = {m: result["summary"][m] for m in result["modes"]}

    def row(label: str, fn: Any) -> None:
        rows.append((label, *(fn(s[m]) for m in result["modes"])))

    row("warm turns (new tokens, median)", lambda x: f"{x['warm_turns']} ({x['new_tokens']:.0f})")
    row("prompt tokens (last turn)", lambda x: f"{x['prompt_tokens']:,}")
    row("TTFT, client (median)", lambda x: _fmt_ms(x.get("ttft_ms")))
    row("TTFT, client, from the 3rd warm turn", lambda x: _fmt_ms(x.get("ttft_ms_steady")))
    row("  server: lookup", lambda x: _fmt_ms(x.get("lookup_ms")))
    row("  server: admission (lookup + merge)", lambda x: _fmt_ms(x.get("admission_ms")))
    row("  server: prefill (suffix forwards)", lambda x: _fmt_ms(x.get("prefill_ms", x.get("prefill_elapsed_ms"))))
    row("  server: commit", lambda x: _fmt_ms(x.get("commit_ms")))
    row("  server: TTFT", lambda x: _fmt_ms(x.get("server_ttft_ms")))
    rows.append(("suffix forward, in-process", *(_fmt_ms(_forward_ms(forward, m)) for m in result["modes"])))
    rows.append(("TTFT / suffix forward", *(f"{s[m]['ttft_ms'] / _forward_ms(forward, m):.2f}x"
                                             for m in result["modes"])))
    rows.append(("  from the 3rd warm turn", *(
        f"{s[m]['ttft_ms_steady'] / _forward_ms(forward, m):.2f}x" if s[m].get("ttft_ms_steady") else "-"
        for m in result["modes"])))
    per_token = kv_one / forward["context"]  # latent + index bytes per token (one KV copy)
    row("KV copied per warm turn", lambda x: f"{x['kv_copied_bytes'] / 1e6:,.0f} MB "
        f"({x['kv_copied_bytes'] / (per_token * x['restored_tokens']):.2f}x KV)")
    row("warm turns lent the entry's buffer", lambda x: f"{x.get('lent_turns', 0)} of {x['warm_turns']}")
    row("commit", lambda x: ", ".join(x.get("commit_modes", [])))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(f"suffix forward in-process ({forward['suffix']} tokens over {forward['context']:,}): "
                 f"patched attention {forward['one_forward_ms']:,.0f} ms in one forward, "
                 f"{forward['split_forwards_ms']:,.0f} ms as {forward['suffix'] - 1} + 1 (16 GB pool); stock "
                 f"attention {forward['stock_one_forward_ms']:,.0f} / {forward['stock_split_forwards_ms']:,.0f} ms "
                 f"(MLX's default pool); restore before it: the one merge copy {forward['restore_ms']:,.0f} ms "
                 f"(a warm turn lent its entry's buffer skips it), "
                 f"stock clone + merge {forward['stock_restore_ms']:,.0f} ms (one KV copy = {kv_one / 1e6:,.0f} MB)")
    for mode in result["modes"]:
        ops = ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in s[mode]["copies_by_op"].items() if v)
        lines.append(f"{mode} copies per warm turn, MB by op: {ops or 'none'}")
    return "\n".join(lines)


@click.command("ttft")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A bench-preset model directory (default: built once in a temp cache dir).")
@click.option("--context", default=DEFAULT_CONTEXT, show_default=True, help="Tokens of the conversation.")
@click.option("--questions", default=6, show_default=True, help="Warm turns after the cold one.")
@click.option("--max-tokens", default=4, show_default=True, help="Reply length of every turn.")
@click.option("--modes", default="stock,patched", show_default=True, help="Servers to run, in order.")
@click.option("--repeat", default=5, show_default=True, help="Timed suffix forwards (median).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the server logs and counter files here (default: a temp dir).")
@click.option("--startup-timeout", default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def ttft(model_dir: Path | None, context: int, questions: int, max_tokens: int, modes: str, repeat: int,
         workdir: Path | None, startup_timeout: float, as_json: bool) -> None:
    """Warm-turn time to first token and KV bytes copied per turn, stock vs patched."""
    from apcctl.tiny_model import build_model

    if model_dir is None:
        model_dir = Path(tempfile.gettempdir()) / "apcctl-bench-model"
    model_dir = build_model(model_dir, preset="bench", seed=0)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="apcctl-ttft-"))
    workdir.mkdir(parents=True, exist_ok=True)
    echo = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    selected = [m.strip() for m in modes.split(",") if m.strip()]
    if not set(selected) <= {"stock", "patched"}:
        raise click.BadParameter("modes are stock and patched")
    result: dict[str, Any] = {"context": context, "modes": selected, "turns": {}, "summary": {},
                              "workdir": str(workdir), "load_avg": list(os.getloadavg())}
    sent: list[list[dict[str, str]]] = []
    for mode in selected:
        echo(f"{mode} server: cold turn of ~{context:,} tokens, then {questions} short questions")
        turns, sent = run_server(model_dir, mode, context, questions, max_tokens, workdir, startup_timeout, echo)
        result["turns"][mode] = [asdict(t) for t in turns]
        result["summary"][mode] = summarize(turns)
    echo("suffix forward in-process, over the first warm turn's restored cache")
    result["forward"] = _forward_subprocess(model_dir, sent[0], sent[1] if len(sent) > 1 else sent[0],
                                            repeat, workdir)
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(render(result))
        click.echo(f"logs and counter files: {workdir}")


if __name__ == "__main__":  # the in-process half: python -m apcctl.commands.bench_ttft MODEL MESSAGES REPEAT
    _spec = json.loads(Path(sys.argv[2]).read_text())
    print(json.dumps(forward_times(Path(sys.argv[1]), _spec["cold"], _spec["warm"], int(sys.argv[3]))))
