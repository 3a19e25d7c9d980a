"""Which web pages may call the inference routes, and under which names the server answers.

mlx-vlm 0.7.10 installs a CORS middleware that lets every origin read every answer, with
credentials, so any web page a local user opened could drive the inference routes and read
them. ``/admin`` and the management routes have their own gate (``infra/guard.py``); this ASGI
middleware sits outside mlx-vlm's CORS middleware too, and:

* refuses (403 JSON, no ``Access-Control-Allow-*`` headers) an inference request, preflight
  included, whose ``Origin`` is another site than the one it was sent to, unless
  ``APC_ALLOWED_ORIGINS`` lists it (like Ollama's ``OLLAMA_ORIGINS``): a listed origin gets
  mlx-vlm's own CORS answer, and ``*`` restores stock's every-origin CORS;
* refuses (403 JSON) a request on any route whose ``Host`` is a name other than ``localhost``,
  this machine's host name, a name under ``.localhost``, ``.local`` or ``.internal`` (names
  public DNS cannot hand out; Ollama accepts the same), the ``--host`` name, a name in
  ``APC_ALLOWED_HOSTS`` or an allowed origin's host. That is DNS rebinding: ``evil.example``
  re-resolved to 127.0.0.1 makes this server the page's own origin. IP addresses are always
  accepted: a page cannot rebind a literal address.

Clients that are not browsers send no ``Origin`` and are not affected.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from server_patch import settings
from server_patch.infra.guard import Receive, Scope, Send, classify, header, reply, route_path

ANY = "*"
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")  # never handed out by public DNS
# The --host the launcher binds, when it is a name (set by server_patch.launch before mlx-vlm starts).
# The process's, on purpose: one command line, one listening socket per process; no runtime's state.
BOUND_HOSTS: list[str] = []


def origin_key(raw: str) -> str:
    """``https://UI.example:8443/`` -> ``https://ui.example:8443``: how origins are compared."""
    return raw.strip().lower().rstrip("/")


def host_name(host: str) -> str | None:
    """The name or address in a ``Host`` header or an origin's authority (no port, no brackets)."""
    try:
        name = urllib.parse.urlsplit("//" + host.strip()).hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


def is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class OriginPolicy:
    """``APC_ALLOWED_ORIGINS`` and ``APC_ALLOWED_HOSTS``, read once at start."""

    origins: frozenset[str] = frozenset()
    hosts: frozenset[str] = frozenset()
    any_origin: bool = False
    any_host: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, bound_hosts: list[str] = BOUND_HOSTS) -> "OriginPolicy":
        origins = {origin_key(o) for o in settings.value("APC_ALLOWED_ORIGINS", env)}
        hosts = {h.strip().lower().rstrip(".") for h in settings.value("APC_ALLOWED_HOSTS", env)}
        hosts |= {host_name(o.split("://", 1)[-1]) or "" for o in origins if o != ANY}
        hosts |= {h.lower() for h in bound_hosts} | {"localhost", socket.gethostname().lower().rstrip(".")}
        return cls(frozenset(origins - {ANY}), frozenset(hosts - {ANY, ""}), ANY in origins, ANY in hosts)

    def host_allowed(self, host: bytes | None) -> bool:
        """A missing ``Host`` (HTTP/1.0, not a browser) passes; so does any IP address."""
        if host is None or self.any_host:
            return True
        name = host_name(host.decode("latin-1"))
        if name is None:
            return False
        return is_address(name) or name in self.hosts or name.endswith(LOCAL_SUFFIXES)

    def origin_allowed(self, origin: bytes, host: bytes | None) -> bool:
        """Listed, or the very server the request went to (a same-origin request)."""
        if self.any_origin:
            return True
        key = origin_key(origin.decode("latin-1"))
        if key in self.origins:
            return True
        return host is not None and key.partition("://")[2] == host.decode("latin-1").strip().lower()


class OriginGuard:
    """403 for a foreign ``Origin`` on the inference routes and for a foreign ``Host`` anywhere."""

    def __init__(self, app: Callable, *, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = header(scope, b"host")
        if not self.policy.host_allowed(host):
            shown = host.decode("latin-1") if host else ""
            await self._refuse(scope, receive, send, f"Host {shown!r} is not a name of this server (a DNS-rebound "
                                                     "name?); list it in APC_ALLOWED_HOSTS")
            return
        origin = header(scope, b"origin")
        if origin is not None and classify(route_path(scope)) is None \
                and not self.policy.origin_allowed(origin, host):
            await self._refuse(scope, receive, send, f"cross-origin requests from {origin.decode('latin-1')!r} "
                                                     "are not accepted; list the origin in APC_ALLOWED_ORIGINS "
                                                     "(apcctl serve --allowed-origins)")
            return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, detail: str) -> None:
        if scope["type"] == "websocket":  # closed before accept: the client sees HTTP 403
            await receive()
            await send({"type": "websocket.close", "code": 1008, "reason": detail[:120]})
            return
        await reply(send, 403, detail)


def policy_from_env() -> OriginPolicy:
    """The policy in force; a bad value stops the server with a message."""
    try:
        return OriginPolicy.from_env()
    except ValueError as exc:
        raise SystemExit(f"server_patch: {exc}") from None


def install(app: Any) -> None:
    """Put the guard outside mlx-vlm's CORS middleware (``guard.install_outermost``)."""
    from server_patch.infra.guard import install_outermost

    install_outermost(app, OriginGuard, policy=policy_from_env())
