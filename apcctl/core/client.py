"""The one HTTP client of the admin endpoint, shared by the CLI and the dashboard.

HTTP through httpx, the event stream through httpx-sse (both imported on the first call, so a
command that never talks to a server does not load them). Errors are ``AdminError`` with the
HTTP status and the server's JSON message, never a traceback.

Every ``/admin`` answer comes back as its type from ``server_patch.admin.schema`` (parsed here,
so a field the server renamed or dropped is one ``AnswerMismatch`` naming it, not a ``KeyError``
in a command or the dashboard). The event stream's data stays JSON objects.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

if TYPE_CHECKING:
    from server_patch.admin import schema as S

T = TypeVar("T")


# The most an answer may weigh: a server sending more is broken or hostile, and the CLI must not
# hold it all in memory (the largest real answer, 200 requests or a big cache's entries, is a few MiB).
MAX_ANSWER_BYTES = 64 << 20
MAX_ERROR_BYTES = 64 << 10  # an error's body: only its message is read


class AdminError(RuntimeError):
    """An admin call failed; ``status`` is the HTTP status, or 0 when the server is unreachable.

    ``message`` may quote the server: escape sequences and control characters are removed
    (``sanitize.printable``), so a hostile answer cannot retitle or clear the terminal."""

    def __init__(self, status: int, message: str) -> None:
        from apcctl.core.sanitize import printable

        message = printable(message)
        super().__init__(message)
        self.status = status
        self.message = message


class AnswerMismatch(AdminError):
    """The server answered, but not in the shape this client knows (a field renamed or missing)."""


def hits_of(status: "S.Status | None") -> "S.Hits":
    """The server's own hit summary (``hits`` of ``/admin/status``, which every server sends:
    requests, hits and their rate, hits by restore kind, token reuse); the server's empty
    summary when there is no status (a server that does not answer)."""
    from server_patch.admin.schema import Answer, Hits

    if isinstance(status, Answer):
        return status.hits
    return Hits.from_json((status or {}).get("hits") or {}, "hits")  # a status that is still JSON


@dataclass
class AdminClient:
    """Talks to one patched server: ``base_url`` like ``http://127.0.0.1:8080``."""

    base_url: str
    token: str | None = None
    timeout: float = 10.0
    last_event_id: str = ""  # the last SSE ``id:`` (sent back as Last-Event-ID on the next stream)
    retry_ms: int | None = None  # the last SSE ``retry:``

    # ------------------------------------------------------------------ plumbing

    def _request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None,
                 query: dict[str, Any] | None = None, auth: bool = True) -> Any:
        import httpx  # (loaded by the first call: a command's --help never pays for it)

        params = {k: v for k, v in (query or {}).items() if v is not None}
        what = f"{method} {path}"
        try:
            with httpx.stream(method, self.base_url.rstrip("/") + path, params=params, json=body,
                              headers=self._headers(auth), timeout=timeout or self.timeout) as response:
                if response.is_error:
                    raw = _capped(response, MAX_ERROR_BYTES, what, truncate=True)
                    raise AdminError(response.status_code, _error_message(response.status_code, raw))
                raw = _capped(response, MAX_ANSWER_BYTES, what)
                content_type = response.headers.get("Content-Type", "")
        except httpx.TransportError as exc:
            raise AdminError(0, f"cannot reach {self.base_url}: {_reason(exc)}") from None
        if "json" in content_type:
            return parsed_json(raw, what)
        return raw.decode("utf-8", errors="replace")

    def _answer(self, kind: "type[T]", method: str, path: str, body: Any = None, *,
                expect: dict[str, Any] | None = None, **kwargs: Any) -> T:
        """``path``'s answer parsed as ``kind`` (a ``schema.Answer``); ``expect``: fields the
        answer must carry with these values (a write's proof that it happened: an answer that
        only fits the shape, ``{}``, is not a success)."""
        from server_patch.admin.schema import SchemaError

        answer = self._request(method, path, body, **kwargs)
        wrong = [k for k, v in (expect or {}).items() if not isinstance(answer, dict) or answer.get(k, ...) is not v]
        if wrong:
            raise AnswerMismatch(200, f"{method} {path}: the server's answer does not say "
                                      + ", ".join(f"{k} = {json.dumps(expect[k])}" for k in wrong)  # type: ignore[index]
                                      + " (a broken server, or not this apcctl's?)")
        try:
            return kind.from_json(answer)  # type: ignore[attr-defined]
        except SchemaError as exc:
            raise AnswerMismatch(200, f"{method} {path}: the server's answer does not fit this apcctl: {exc} "
                                      "(are apcctl and the server the same version?)") from None
        except (TypeError, ValueError, AttributeError, RecursionError) as exc:  # a shape no field expects
            raise AnswerMismatch(200, f"{method} {path}: the server's answer does not fit this apcctl: "
                                      f"{type(exc).__name__}: {exc}") from None

    def _headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if auth and self.token else {}

    # ------------------------------------------------------------------ reads

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", auth=False)

    def status(self) -> "S.Status":
        return self._answer(_schema().Status, "GET", "/admin/status")

    def entries(self, tier: str = "all", kind: str = "all") -> "list[S.EntryInfo]":
        return self._answer(_schema().Entries, "GET", "/admin/entries", query={"tier": tier, "kind": kind}).entries

    def entry(self, entry_id: str) -> "S.EntryInfo":
        return self._answer(_schema().EntryInfo, "GET", f"/admin/entries/{_quoted(entry_id)}")

    def anchors(self) -> "list[S.EntryInfo]":
        return self._answer(_schema().Anchors, "GET", "/admin/anchors").anchors

    def requests(self, since: int = 0, limit: int = 200) -> "list[S.RequestRecord]":
        return self._answer(_schema().Requests, "GET", "/admin/requests",
                            query={"since": since, "limit": limit}).requests

    def metrics(self) -> str:
        return self._request("GET", "/admin/metrics")

    def events(self, since: int = 0, timeout: float | None = None,
               stop: threading.Event | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-sent events as (event name, data) until the stream ends, or ``stop`` is set.

        Parsed by httpx-sse (the whole SSE grammar: ``event:``, multi-line ``data:``, ``id:``,
        ``retry:``, comments); the last ``id:`` and ``retry:`` seen are kept in ``last_event_id``
        and ``retry_ms`` for a caller that reconnects. ``stop`` is checked on every chunk the
        server sends, keepalives included, so setting it closes the connection within a
        keepalive interval (an open stream delays a server's shutdown).
        """
        import httpx
        from httpx_sse import EventSource

        url = self.base_url.rstrip("/") + "/admin/events"
        headers = {**self._headers(), "Accept": "text/event-stream", "Cache-Control": "no-store"}
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        try:
            with httpx.stream("GET", url, params={"since": int(since)}, headers=headers,
                              timeout=timeout or 30) as response:
                if response.is_error:
                    raw = _capped(response, MAX_ERROR_BYTES, "GET /admin/events", truncate=True)
                    raise AdminError(response.status_code, _error_message(response.status_code, raw))
                for sse in EventSource(_Stoppable(response, stop)).iter_sse():
                    self.last_event_id, self.retry_ms = sse.id or self.last_event_id, sse.retry or self.retry_ms
                    if sse.data:
                        data = parsed_json(sse.data.encode(), f"GET /admin/events ({sse.event or 'message'})")
                        if not isinstance(data, dict):
                            raise AnswerMismatch(200, "GET /admin/events: an event's data is not a JSON object")
                        yield sse.event or "message", data
        except httpx.TransportError as exc:
            raise AdminError(0, f"cannot reach {self.base_url}: {_reason(exc)}") from None

    # ------------------------------------------------------------------ inference

    def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, timeout: float | None = None,
             **params: Any) -> dict[str, Any]:
        """POST /v1/chat/completions: restart probes and demo traffic. The admin token goes along: a
        server with API keys takes it in place of a key (the keyless namespace, where anchors made
        through ``/admin/anchors`` are); one without keys ignores it."""
        body: dict[str, Any] = {"messages": messages, **params}
        if model is not None:
            body["model"] = model
        return self._request("POST", "/v1/chat/completions", body, timeout=timeout)

    # ------------------------------------------------------------------ writes

    def pin(self, entry_id: str) -> "S.EntryInfo":
        return self._answer(_schema().EntryInfo, "POST", f"/admin/anchors/{_quoted(entry_id)}/pin")

    def unpin(self, entry_id: str) -> "S.EntryInfo":
        return self._answer(_schema().EntryInfo, "POST", f"/admin/anchors/{_quoted(entry_id)}/unpin")

    def evict(self, entry_id: str, reason: str | None = None) -> "S.Evicted":
        """``reason``: who asks, for the events and the journal (``operator`` by default; apcctl
        restart's probe says ``restart probe``, so ``report`` does not count it as an operator's)."""
        return self._answer(_schema().Evicted, "DELETE", f"/admin/entries/{_quoted(entry_id)}",
                            query={"reason": reason})

    def new_anchor(self, system: str, tools: list[dict] | None = None, tenant: str | None = None,
                   timeout: float = 600) -> "S.NewAnchor":
        body = {"system": system, "tools": tools, "tenant": tenant}
        return self._answer(_schema().NewAnchor, "POST", "/admin/anchors",
                            {k: v for k, v in body.items() if v is not None}, timeout=timeout)

    def flush(self, timeout: float = 60.0) -> "S.FlushReport":
        return self._answer(_schema().FlushReport, "POST", "/admin/flush", {"timeout": timeout}, timeout=timeout + 10)

    def drain(self, retry_after: int = 5) -> "S.Traffic":
        return self._answer(_schema().Traffic, "POST", "/admin/drain", {"retry_after": retry_after},
                            expect={"draining": True})

    def undrain(self) -> "S.Traffic":
        return self._answer(_schema().Traffic, "POST", "/admin/undrain", expect={"draining": False})

    def model(self) -> "S.ModelInfo":
        """The served model (and its names), the loaded one, the open lineage runtimes."""
        return self._answer(_schema().ModelInfo, "GET", "/admin/model")

    def canary(self) -> "S.CanaryState":
        """The canary's counters, last result and suspect restore kinds."""
        return self._answer(_schema().CanaryState, "GET", "/admin/verify")

    def verify(self, *, entry_id: str | None = None, recent: int | None = None,
               timeout: float = 300.0) -> "S.VerifyReport":
        """Check restore points against a cold prefill (the server runs them while idle)."""
        body: dict[str, Any] = {"timeout_s": timeout}
        if entry_id:
            body["entry"] = entry_id
        if recent:
            body["recent"] = recent
        return self._answer(_schema().VerifyReport, "POST", "/admin/verify", body, timeout=timeout + 30)

    def clear_suspects(self, kind: str | None = None) -> "S.Cleared":
        return self._answer(_schema().Cleared, "POST", "/admin/verify/clear", {"kind": kind} if kind else {})


def _schema() -> Any:
    """The answers' types (imported on the first call, like httpx)."""
    from server_patch.admin import schema

    return schema


def _quoted(entry_id: str) -> str:
    return urllib.parse.quote(entry_id, safe="")


class _Stoppable:
    """The SSE response as httpx-sse reads it (``headers``, ``iter_text``), ending as soon as
    ``stop`` is set: checked at every chunk, and the server sends a keepalive every 0.25 s."""

    def __init__(self, response: Any, stop: threading.Event | None) -> None:
        self.response, self.stop, self.headers = response, stop, response.headers

    def iter_text(self) -> Iterator[str]:
        unbroken = 0  # characters since the last line break: one event's line may not grow unbounded
        for text in self.response.iter_text():
            if self.stop is not None and self.stop.is_set():
                return
            cut = max(text.rfind("\n"), text.rfind("\r"))
            unbroken = len(text) - cut - 1 if cut >= 0 else unbroken + len(text)
            if unbroken > MAX_ANSWER_BYTES:
                raise AnswerMismatch(200, f"GET /admin/events: a line of the stream is longer than "
                                          f"{MAX_ANSWER_BYTES:,} characters")
            yield text


def _reason(exc: Exception) -> str:
    """Why a connection failed, as the OS said it (``[Errno 111] Connection refused``)."""
    return str(exc) or type(exc).__name__


def _capped(response: Any, limit: int, what: str, *, truncate: bool = False) -> bytes:
    """The body, read as it comes, up to ``limit`` bytes: past it, the rest is dropped
    (``truncate``: an error's message is in its start) or the answer refused."""
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            if truncate:
                return b"".join(chunks)[:limit]
            raise AnswerMismatch(200, f"{what}: the server's answer is larger than {limit:,} bytes (a broken "
                                      "or hostile server?)")
    return b"".join(chunks)


def parsed_json(raw: bytes, what: str) -> Any:
    """``raw`` as JSON, or ``AnswerMismatch``: malformed JSON and JSON nested deeper than Python
    parses (``RecursionError``) say so instead of a traceback."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise AnswerMismatch(200, f"{what}: the server's answer is nested too deeply to be an answer") from None
    except ValueError as exc:
        raise AnswerMismatch(200, f"{what}: the server's answer is not JSON ({exc})") from None


def _error_message(status: int, raw: bytes) -> str:
    """``HTTP 404: <the server's message>``; only the status when the body is no JSON message."""
    try:
        return _message_of(status, json.loads(raw or b"{}"))
    except (ValueError, RecursionError):
        return f"HTTP {status}"


def _message_of(status: int, body: Any) -> str:
    detail = body.get("detail", body.get("error", body)) if isinstance(body, dict) else body
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    if isinstance(detail, list):  # FastAPI validation errors
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc') or [])}: {d.get('msg')}"
                           if isinstance(d, dict) and isinstance(d.get("loc") or [], list) else str(d)
                           for d in detail)
    text = str(detail)
    return f"HTTP {status}: {text[:MAX_MESSAGE_CHARS]}" + (" [...]" if len(text) > MAX_MESSAGE_CHARS else "")


MAX_MESSAGE_CHARS = 2000  # a server's error message, as the CLI prints it
