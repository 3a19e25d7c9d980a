"""How an admin route reaches the server's parts: a FastAPI dependency, never a module global.

``admin.api.install(app, parts)`` puts the parts (``integration.parts.Parts``) on the app it
mounts /admin on; a route that needs them declares ``parts: PartsDep`` and FastAPI hands them
over per request (a test mounts the router on its own app with its own parts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, HTTPException, Request

from server_patch.infra.attributes import state_of

if TYPE_CHECKING:
    from server_patch.integration.parts import Parts
    from server_patch.integration.runtime import LineageRuntime


def parts_of(request: Request) -> "Parts":
    """The parts ``install`` put on this app."""
    parts: Parts = state_of(request.app, "apc_parts")
    return parts


PartsDep = Annotated[Any, Depends(parts_of)]


def lineage_of(parts: "Parts") -> "LineageRuntime":
    """The open lineage runtime, or 409 before the first request started the cache."""
    current = parts.runtimes.current
    if current is None:
        raise HTTPException(409, detail="no model has been served yet: the lineage cache starts with the first request")
    return current
