"""mlx-vlm's ``GET /metrics`` without its per-request records, unless the caller holds the admin token.

Stock answers ``/metrics`` to anyone (its own key only when ``--api-key`` is set) with the latest
and the 32 most recent requests: each one's prompt size, reply size and timings, and the last
error's text. Without the admin token the patched server keeps the aggregates (``summary``
less ``last_error``, ``server``) that monitoring reads; the per-request view is the token's
(here, or ``/admin/requests``). ``APC_METRICS_PUBLIC=1`` answers everyone in full, as stock does.

With API keys (``--api-key``) even the aggregates are the admin token's: their totals (requests,
prompt sizes, times) cover every key, so one key holder polling them learns what the others
send. A key gets 403 JSON there; the operator's monitoring uses the admin token (or
``/admin/metrics``). Keys and ``APC_METRICS_PUBLIC=1`` together answer everyone, as asked.
"""

from __future__ import annotations

from typing import Any

from server_patch.infra.attributes import state_of
from server_patch.infra.auth import token_matches

ENV = "APC_METRICS_PUBLIC"
PER_REQUEST = ("latest", "recent")
KEYED_MESSAGE = "with API keys, /metrics needs the admin token: its totals cover every key"


def public() -> bool:
    from server_patch import settings

    return bool(settings.value(ENV))


def metrics_view(request: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` (``ServerMetricsStore.snapshot()``) as this caller may see it."""
    token = state_of(request.app, "apc_admin_token")
    if public() or (token and token_matches(token, request.headers.get("authorization"))):
        return payload
    if state_of(request.app, "apc_api_keys_on", False):
        from fastapi import HTTPException

        raise HTTPException(403, detail=KEYED_MESSAGE)
    view = {key: value for key, value in payload.items() if key not in PER_REQUEST}
    if isinstance(view.get("summary"), dict):
        view["summary"] = {key: value for key, value in view["summary"].items() if key != "last_error"}
    return view
