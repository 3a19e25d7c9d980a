"""The one HTTP client of the admin endpoint, shared by the CLI and the dashboard.

HTTP through the standard library (urllib), so it works wherever apcctl installs. Errors are
``AdminError`` with the HTTP status and the server's JSON message, never a traceback.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator



class AdminError(RuntimeError):
    """An admin call failed; ``status`` is the HTTP status, or 0 when the server is unreachable."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def hits_of(status: dict[str, Any] | None) -> dict[str, Any]:
    """The server's own hit summary (``hits`` of ``/admin/status``, which every server sends:
    requests, hits and their rate, hits by restore kind, token reuse); the server's empty
    summary when there is no status (a server that does not answer)."""
    if status:
        return status["hits"]
    from server_patch.lineage.summary import hit_summary  # (the server package loads numpy)

    return hit_summary({})


@dataclass
class AdminClient:
    """Talks to one patched server: ``base_url`` like ``http://127.0.0.1:8080``."""

    base_url: str
    token: str | None = None
    timeout: float = 10.0

    # ------------------------------------------------------------------ plumbing

    def _request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None,
                 query: dict[str, Any] | None = None, auth: bool = True) -> Any:
        url = self.base_url.rstrip("/") + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if auth and self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
                kind = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise AdminError(exc.code, _error_message(exc)) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(0, f"cannot reach {self.base_url}: {reason}") from None
        if "json" in kind:
            return json.loads(raw)
        return raw.decode(errors="replace")

    # ------------------------------------------------------------------ reads

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", auth=False)

    def status(self) -> dict[str, Any]:
        return self._request("GET", "/admin/status")

    def entries(self, tier: str = "all", kind: str = "all") -> list[dict[str, Any]]:
        return self._request("GET", "/admin/entries", query={"tier": tier, "kind": kind})["entries"]

    def entry(self, entry_id: str) -> dict[str, Any]:
        return self._request("GET", f"/admin/entries/{urllib.parse.quote(entry_id, safe='')}")

    def anchors(self) -> list[dict[str, Any]]:
        return self._request("GET", "/admin/anchors")["anchors"]

    def requests(self, since: int = 0, limit: int = 200) -> list[dict[str, Any]]:
        return self._request("GET", "/admin/requests", query={"since": since, "limit": limit})["requests"]

    def metrics(self) -> str:
        return self._request("GET", "/admin/metrics")

    def events(self, since: int = 0, timeout: float | None = None,
               stop: threading.Event | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-sent events as (event name, data) until the stream ends, or ``stop`` is set.

        ``stop`` is checked on every line, keepalives included, so setting it closes the
        connection within a keepalive interval (an open stream delays a server's shutdown).
        """
        url = self.base_url.rstrip("/") + f"/admin/events?since={int(since)}"
        request = urllib.request.Request(url)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            response = urllib.request.urlopen(request, timeout=timeout or 30)
        except urllib.error.HTTPError as exc:
            raise AdminError(exc.code, _error_message(exc)) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            raise AdminError(0, f"cannot reach {self.base_url}: {getattr(exc, 'reason', exc)}") from None
        with response:
            name, data = "message", []
            for raw in response:
                if stop is not None and stop.is_set():
                    return
                line = raw.decode(errors="replace").rstrip("\n")
                if not line:
                    if data:
                        yield name, json.loads("\n".join(data))
                    name, data = "message", []
                elif line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())

    # ------------------------------------------------------------------ inference

    def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, timeout: float | None = None,
             **params: Any) -> dict[str, Any]:
        """POST /v1/chat/completions without the admin token: restart probes and demo traffic."""
        body: dict[str, Any] = {"messages": messages, **params}
        if model is not None:
            body["model"] = model
        return self._request("POST", "/v1/chat/completions", body, timeout=timeout, auth=False)

    # ------------------------------------------------------------------ writes

    def pin(self, entry_id: str) -> dict[str, Any]:
        return self._request("POST", f"/admin/anchors/{urllib.parse.quote(entry_id, safe='')}/pin")

    def unpin(self, entry_id: str) -> dict[str, Any]:
        return self._request("POST", f"/admin/anchors/{urllib.parse.quote(entry_id, safe='')}/unpin")

    def evict(self, entry_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/admin/entries/{urllib.parse.quote(entry_id, safe='')}")

    def new_anchor(self, system: str, tools: list[dict] | None = None, tenant: str | None = None,
                   timeout: float = 600) -> dict[str, Any]:
        body = {"system": system, "tools": tools, "tenant": tenant}
        return self._request("POST", "/admin/anchors", {k: v for k, v in body.items() if v is not None},
                             timeout=timeout)

    def flush(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._request("POST", "/admin/flush", {"timeout": timeout}, timeout=timeout + 10)

    def drain(self, retry_after: int = 5) -> dict[str, Any]:
        return self._request("POST", "/admin/drain", {"retry_after": retry_after})

    def undrain(self) -> dict[str, Any]:
        return self._request("POST", "/admin/undrain")

    def canary(self) -> dict[str, Any]:
        """The canary's counters, last result and suspect restore kinds."""
        return self._request("GET", "/admin/verify")

    def verify(self, *, entry_id: str | None = None, recent: int | None = None,
               timeout: float = 300.0) -> dict[str, Any]:
        """Check restore points against a cold prefill (the server runs them while idle)."""
        body: dict[str, Any] = {"timeout_s": timeout}
        if entry_id:
            body["entry"] = entry_id
        if recent:
            body["recent"] = recent
        return self._request("POST", "/admin/verify", body, timeout=timeout + 30)

    def clear_suspects(self, kind: str | None = None) -> dict[str, Any]:
        return self._request("POST", "/admin/verify/clear", {"kind": kind} if kind else {})


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return f"HTTP {exc.code}"
    detail = body.get("detail", body.get("error", body)) if isinstance(body, dict) else body
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    if isinstance(detail, list):  # FastAPI validation errors
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" for d in detail)
    return f"HTTP {exc.code}: {detail}"
