"""mlx-vlm's Responses store, namespaced like the cache: a stored response is visible only to
requests of the namespace that stored it.

mlx-vlm 0.7.10 keeps every stored Response in one process-wide dict (``response_store`` in
``mlx_vlm.server.responses_state``): with API keys, any key could read another's response by id
(``GET /v1/responses/{id}``, ``/input_items``), cancel or delete it, or continue its conversation
with ``previous_response_id``. The overlay makes that dict a :class:`NamespacedResponses`; the
request's namespace (``tenancy.namespace``, set by the tenant middleware in :data:`CURRENT`)
is recorded with each response, and a lookup from any other namespace finds nothing, so a
foreign id answers exactly as an unknown one (mlx-vlm's own 404). Without keys, tenants or
salts every request is in the one namespace ``None``: stock behaviour.

No mlx-vlm import: the overlay loads this before mlx-vlm.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

# The namespace of the request being served; the tenant middleware sets it for every inference
# request, and asyncio tasks and Starlette's thread pool carry it into the handlers.
CURRENT: ContextVar[str | None] = ContextVar("apc_responses_namespace", default=None)
_ABSENT = object()


class NamespacedResponses(dict):
    """A ``dict`` of response id -> stored response whose lookups see the current namespace's only."""

    def __init__(self) -> None:
        super().__init__()
        self._owners: dict[str, str | None] = {}

    def _visible(self, key: Any) -> bool:
        owner = self._owners.get(key, _ABSENT)
        return owner is not _ABSENT and owner == CURRENT.get() and dict.__contains__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._owners[key] = CURRENT.get()
        super().__setitem__(key, value)

    def __getitem__(self, key: str) -> Any:
        if not self._visible(key):
            raise KeyError(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        return self._visible(key)

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key, default) if self._visible(key) else default

    def pop(self, key: str, *default: Any) -> Any:
        """``DELETE /v1/responses/{id}``: another namespace's response is not there to delete."""
        if not self._visible(key):
            if default:
                return default[0]
            raise KeyError(key)
        self._owners.pop(key, None)
        return super().pop(key)

    def evict(self, key: str) -> None:
        """mlx-vlm's size limit drops the oldest response, whichever namespace stored it."""
        self._owners.pop(key, None)
        super().pop(key, None)


__all__ = ["CURRENT", "NamespacedResponses"]
