"""The demo's agent trace (``apcctl.agent_traffic.AgentTraffic``) sent through a gateway,
with every answer and its ``usage`` kept: the reuse a routing policy gets is
``cached_tokens / prompt_tokens`` summed over the trace, which smg passes through unchanged.

Several runs on the same servers must not reuse each other's entries: each run is its own tenant.
smg 1.13 drops ``X-APC-Tenant`` (it forwards only ``authorization``, ``x-request-id``(``-*``),
``x-correlation-id``, ``traceparent``/``tracestate`` and ``x-smg-routing-key``) but forwards the body,
so the tenant also goes as the OpenAI ``user`` field, which servers started with
``APC_TENANT_FROM_USER=1`` take as the tenant (``server_patch/tenancy/middleware.py``).
``routing_key`` adds ``x-smg-routing-key``: ``"conversation"`` sends one key per conversation
(what a client that knows its conversations would send), ``"agent"`` one key per agent (all the
sessions that share its system prompts).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from apcctl.agent_traffic import AgentTraffic
from apcctl.core.client import AdminClient, AdminError
from apcctl.core.gateway import ROUTING_KEY_HEADER
from apcctl.fleet.holdout import ConversationTraffic

TENANT_HEADER = "X-APC-Tenant"
# The traces a run can send: the demo's agents (sessions sharing system prompts) and the
# holdout-style conversations of the e2e tests (nothing shared between conversations).
TRACES: dict[str, type[AgentTraffic]] = {"agents": AgentTraffic, "conversations": ConversationTraffic}


@dataclass
class Sent:
    conversation: str
    kind: str
    messages: list[dict[str, Any]]
    answer: dict[str, Any]
    at: float = field(default_factory=time.monotonic)  # when the answer came (monotonic seconds)

    @property
    def prompt_tokens(self) -> int:
        return int(self.answer["usage"]["prompt_tokens"])

    @property
    def cached_tokens(self) -> int:
        details = self.answer["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


@dataclass
class RecordingClient(AdminClient):
    """``AdminClient.chat`` with a tenant (header for a server, ``user`` for behind a gateway) and
    the routing-key header, keeping every answer."""

    tenant: str | None = None
    routing_key: str = ""  # "", "conversation" or "agent": what x-smg-routing-key names
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. logprobs for the equality check
    conversation: tuple[str, str] = ("", "")
    sent: list[Sent] = field(default_factory=list)

    def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, timeout: float | None = None,
             **params: Any) -> dict[str, Any]:
        body = {"messages": messages, **params, **self.extra, **({"model": model} if model else {}),
                **({"user": self.tenant} if self.tenant else {})}
        headers = {"Content-Type": "application/json", **({TENANT_HEADER: self.tenant} if self.tenant else {})}
        if self.routing_key:
            conversation = self.conversation[0]
            headers[ROUTING_KEY_HEADER] = conversation.split("/", 1)[0] if self.routing_key == "agent" else conversation
        request = urllib.request.Request(self.base_url.rstrip("/") + "/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise AdminError(exc.code, f"HTTP {exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            raise AdminError(0, f"cannot reach {self.base_url}: {getattr(exc, 'reason', exc)}") from None
        self.sent.append(Sent(*self.conversation, [dict(m) for m in messages], answer))
        return answer


@dataclass
class TraceResult:
    sent: list[Sent]
    failed: int

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.sent)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.sent)

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(url: str, *, model: str | None, requests: int, max_tokens: int, tenant: str, routing_key: str = "",
           agents: int = 1, seed: int = 0, extra: dict[str, Any] | None = None, trace: str = "agents",
           gate: Callable[[], None] | None = None) -> TraceResult:
    """Send ``trace`` (one of ``TRACES``) to ``url`` from ``agents`` clients at once and keep the answers.

    Each client is the trace with its own seed (its own system prompts and questions), sends one
    request at a time as an agent does, and gets ``requests // agents`` of the requests. The
    clients run side by side, as several users of one fleet do. ``tenant`` keeps the run's cache
    entries its own (see the module docstring for how it crosses the gateway). ``gate`` is called
    by each client before each request (it may hold the client: ``roll_bench.Schedule``).
    """
    kind = TRACES[trace]
    runs = []
    for agent in range(agents):
        client = RecordingClient(url, timeout=300.0, tenant=tenant, routing_key=routing_key, extra=dict(extra or {}))
        traffic = kind(client, seed=seed + agent, model=model, max_requests=requests // agents,
                       max_tokens=max_tokens, on_request=_tracker(client, agent, gate))
        runs.append((client, traffic))
    threads = [traffic.start() for _, traffic in runs]
    for thread in threads:
        thread.join()
    return TraceResult([s for client, _ in runs for s in client.sent], sum(t.failed for _, t in runs))


def system_prompts(agents: int, seed: int = 0) -> list[str]:
    """The system prompts the agent trace sends with these arguments (the sub-agent's extends the coder's)."""
    prompts = []
    for agent in range(agents):
        traffic = AgentTraffic(AdminClient(""), seed=seed + agent)
        prompts += [traffic.assistant, traffic.coder]
    return prompts


def _tracker(client: RecordingClient, agent: int, gate: Callable[[], None] | None = None) -> Callable[[str, str], None]:
    """Keeps the conversation of the next request on the client (its routing key, when sent)."""

    def on_request(conversation: str, kind: str) -> None:
        if gate is not None:
            gate()
        client.conversation = (f"agent{agent}/{conversation}", kind)

    return on_request
