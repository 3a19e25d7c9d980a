"""Run the patched mlx-vlm server as a real subprocess, for integration tests.

Why a subprocess: the overlay must be installed before mlx-vlm is imported, and a server
holds global state (model, APC manager), so every test gets a fresh process started exactly
the way an operator starts it: ``python -m server_patch.launch --model DIR --port N``.

Usage (standard library HTTP only)::

    server = PatchedServer(model_dir, env={"APC_LINEAGE": "0"}, log_dir=tmp_path).start()
    try:
        health = server.get_json("/health")
        reply = server.chat([{"role": "user", "content": "Hi"}], max_tokens=4)
    finally:
        server.stop()

or ``with PatchedServer(...) as server:``. Defaults: loopback, APC on, the disk tier off and,
if it is turned on, pointed at a private directory (never ``~/.cache``), Hub access off.
``env`` overrides those; a value of ``None`` removes the variable.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from apcctl.core.hosts import free_port  # the one picker; tests import it from here too

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "APC_ENABLED": "1",
    "APC_DISK_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}


ADMIN_TOKEN = "test-admin-token"


class ServerError(RuntimeError):
    """The server did not come up, or answered with an HTTP error."""


class PatchedServer:
    """One ``server_patch.launch`` process serving ``model_dir`` on loopback."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        port: int | None = None,
        env: Mapping[str, str | None] | None = None,
        args: Sequence[str] = (),
        log_dir: Path | str | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or free_port()
        self.args = list(args)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="apc-server-"))
        self.log_path = self.log_dir / f"server-{self.port}.log"
        self.startup_timeout = startup_timeout
        self.env = self._environment(env or {})
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ServerError("server not started")
        return self.process.pid

    def _environment(self, overrides: Mapping[str, str | None]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(BASE_ENV)
        env["APC_DISK_PATH"] = str(self.log_dir / "apc-disk")
        # Lineage disk tier, admin token and state never touch the user's real directories.
        env["APC_LINEAGE_DISK_PATH"] = str(self.log_dir / "lineage-disk")
        env["APC_STATE_DIR"] = str(self.log_dir / "state")
        env["APC_ADMIN_TOKEN"] = ADMIN_TOKEN
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "server_patch.launch",
            "--model", str(self.model_dir), "--port", str(self.port), *self.args,
        ]

    def start(self) -> "PatchedServer":
        """Start the process and wait until ``/health`` answers 200 (or fail with the log)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"server exited with {self.process.returncode} before /health answered:\n"
                    + self.log_tail()
                )
            try:
                status, _ = self.request("GET", "/health", timeout=2.0)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerError(f"/health did not answer within {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code. Safe to call twice."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        return self.process.returncode

    def __enter__(self) -> "PatchedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def request(
        self, method: str, path: str, payload: Any = None, timeout: float = 120.0,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """(status, decoded JSON body or text); HTTP errors are returned, not raised."""
        data = None if payload is None else json.dumps(payload).encode()
        all_headers = {"Content-Type": "application/json"} if data is not None else {}
        all_headers.update(headers or {})
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=all_headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        text = body.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get_json(self, path: str) -> Any:
        return self._ok("GET", path)

    def post_json(self, path: str, payload: Any) -> Any:
        return self._ok("POST", path, payload)

    def _ok(self, method: str, path: str, payload: Any = None,
            headers: Mapping[str, str] | None = None) -> Any:
        status, body = self.request(method, path, payload, headers=headers)
        if status != 200:
            raise ServerError(f"{method} {path} -> {status}: {body}")
        return body

    def chat(self, messages: list[dict[str, Any]], *, tenant: str | None = None,
             **params: Any) -> dict[str, Any]:
        """POST /v1/chat/completions; greedy unless ``temperature`` is given.

        ``tenant`` is sent as ``X-APC-Tenant`` (a different tenant never shares cache entries).
        """
        payload = {"model": str(self.model_dir), "messages": messages, "temperature": 0.0}
        payload.update(params)
        headers = {"X-APC-Tenant": tenant} if tenant else None
        return self._ok("POST", "/v1/chat/completions", payload, headers=headers)

    def admin(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        """(status, body) of an ``/admin`` call with the harness's bearer token."""
        return self.request(method, "/admin" + path, payload,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def stream_and_drop(self, messages: list[dict[str, Any]], *, chunks: int = 3,
                        tenant: str | None = None, **params: Any) -> list[str]:
        """Open a streaming chat request, read ``chunks`` SSE data lines, then close the
        connection mid-stream (a client that went away). Returns the data lines read."""
        payload = {"model": str(self.model_dir), "messages": messages, "temperature": 0.0,
                   "stream": True}
        payload.update(params)
        headers = {"Content-Type": "application/json"}
        if tenant:
            headers["X-APC-Tenant"] = tenant
        conn = http.client.HTTPConnection(HOST, self.port, timeout=120)
        got: list[str] = []
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(payload), headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise ServerError(f"stream -> {resp.status}: {resp.read()[:500]!r}")
            while len(got) < chunks:
                line = resp.readline()
                if not line:
                    break
                text = line.decode("utf-8", errors="replace").strip()
                if text.startswith("data:") and text != "data: [DONE]":
                    got.append(text[5:].strip())
        finally:
            if conn.sock is not None:  # drop the TCP connection without reading the rest
                conn.sock.close()
            conn.close()
        return got

    def chat_restore(self, messages: list[dict[str, Any]], **params: Any) -> tuple[dict[str, Any], dict[str, str]]:
        """One sequential ``chat`` and the one restore line it logged (asserted: exactly one)."""
        before = len(self.lineage_lines("restore"))
        answer = self.chat(messages, **params)
        lines = self.lineage_lines("restore")
        assert len(lines) == before + 1, self.log_tail()
        return answer, lines[-1]

    def lineage_lines(self, what: str = "restore") -> list[dict[str, str]]:
        """The ``apc_lineage <what> key=value ...`` log lines, parsed, oldest first."""
        return parse_lineage_lines(self.log_text(), what)


_LINEAGE_LINE = re.compile(r"apc_lineage (restore|timing) (.*)$")


@contextlib.contextmanager
def all_running(servers: dict[str, "PatchedServer"]) -> Iterator[dict[str, "PatchedServer"]]:
    """Start ``servers`` in order and stop every one of them at the end, whatever failed."""
    try:
        for server in servers.values():
            server.start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def wait_for(predicate, what: str, server: "PatchedServer", timeout: float = 60.0) -> None:
    """Poll until ``predicate()`` holds (a background effect: a disk write, a stream slot);
    the timeout only bounds a hang, and its failure shows the server's log tail."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen; log tail:\n{server.log_tail()}")
        time.sleep(0.1)


def parse_lineage_lines(text: str, what: str = "restore") -> list[dict[str, str]]:
    """``apc_lineage restore|timing k=v ...`` lines of a server log as dicts."""
    out = []
    for line in text.splitlines():
        match = _LINEAGE_LINE.search(line)
        if match and match.group(1) == what:
            out.append(dict(pair.split("=", 1) for pair in match.group(2).split() if "=" in pair))
    return out


# Words the tiny model's tokenizer was trained on: one token each (with its leading space).
WORDS = (
    "model token cache prompt prefix lineage snapshot layer attention linear sparse index pool "
    "path line code python test assert return class import def self none true false yield async"
).split()


def words(count: int, seed: int) -> list[str]:
    """``count`` deterministic pseudo-random words (about one token each on the tiny model)."""
    import random

    rng = random.Random(seed)
    return [rng.choice(WORDS) for _ in range(count)]


def text(count: int, seed: int) -> str:
    return " ".join(words(count, seed))


def reply_tokens(answer: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The generated tokens of a chat reply requested with ``logprobs``, as (text, bytes)."""
    content = answer["choices"][0]["logprobs"]["content"]
    return [(c["token"], tuple(c.get("bytes") or ())) for c in content]


def first_top_logprobs(answer: dict[str, Any]) -> dict[str, float]:
    """The first generated token's ``top_logprobs`` as {token text: logprob}."""
    content = answer["choices"][0]["logprobs"]["content"]
    return {t["token"]: float(t["logprob"]) for t in content[0]["top_logprobs"]}


def assert_same_output(warm: dict[str, Any], cold: dict[str, Any], tol: float = 1e-3) -> None:
    """Greedy tokens equal, and the first token's top logprobs equal within ``tol``.

    Top-k membership may differ only for a candidate tied (within ``tol``) with the k-th one.
    """
    warm_tokens, cold_tokens = reply_tokens(warm), reply_tokens(cold)
    assert warm_tokens, "no logprobs in the reply (is TOP_LOGPROBS_K set?)"
    if warm_tokens != cold_tokens:
        at = next(i for i, (a, b) in enumerate(zip(warm_tokens, cold_tokens)) if a != b)
        w = warm["choices"][0]["logprobs"]["content"][at]
        c = cold["choices"][0]["logprobs"]["content"][at]
        raise AssertionError(
            f"greedy tokens differ at position {at}: warm {w['token']!r} ({w['logprob']:.6f}) vs "
            f"cold {c['token']!r} ({c['logprob']:.6f}); warm top {w['top_logprobs']}, "
            f"cold top {c['top_logprobs']}")
    warm_top, cold_top = first_top_logprobs(warm), first_top_logprobs(cold)
    assert len(warm_top) == len(cold_top) > 0, (warm_top, cold_top)
    floor = min(min(warm_top.values()), min(cold_top.values()))
    for token in set(warm_top) | set(cold_top):
        if token in warm_top and token in cold_top:
            assert abs(warm_top[token] - cold_top[token]) <= tol, (token, warm_top, cold_top)
        else:
            value = warm_top.get(token, cold_top.get(token))
            assert abs(value - floor) <= tol, f"top-k differs beyond a tie: {warm_top} vs {cold_top}"


def reply_text(answer: dict[str, Any]) -> str:
    """The assistant's reply, as the next turn re-sends it (never empty)."""
    return answer["choices"][0]["message"]["content"] or "."


def cached_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens"])


def fed_tokens(answer: dict[str, Any]) -> int:
    """Tokens the model was fed for ``answer``: the prompt and every reply token it emitted
    (the one it sampled last is never fed). With reply reuse, its entry's head."""
    return prompt_tokens(answer) + int(answer["usage"]["completion_tokens"])


def assert_next_turn_restored(previous: dict[str, Any], answer: dict[str, Any], kind: str) -> None:
    """The next turn of ``previous``'s lineage restores past its reply (the entry's head) when
    the model's template re-renders the reply verbatim, else at ``previous``'s prompt end (the
    ``final`` checkpoint the entry keeps there): never less than before reply reuse."""
    restored = (kind, cached_tokens(answer))
    expected = {("entry", fed_tokens(previous)), ("final", prompt_tokens(previous) - 1)}
    assert restored in expected, (restored, sorted(expected))


@dataclass(kw_only=True)
class TrafficLoop:
    """A client thread of a restart test: one request per round until ``stop`` is set, then
    ``after_stop`` more (at most ``cap`` in all). Subclasses say how a round is sent."""

    after_stop: int = 3
    cap: int = 300
    stop: threading.Event = field(default_factory=threading.Event)
    ok: int = 0
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        extra = 0
        for i in range(self.cap):
            if self.stop.is_set():
                extra += 1
                if extra > self.after_stop:
                    return
            self.send_round(i)

    def send_round(self, i: int) -> None:
        raise NotImplementedError
