"""What serving adds to mlx-vlm's app: the 404's error shape, the origin guard, and the patch's
``/health`` fields. Called from the overlay's ``served_model`` and ``identity`` topics."""

from __future__ import annotations

from typing import Any


def install(app: Any) -> None:
    """The 404's error shape and the origin guard; a bad setting stops the server here."""
    from server_patch.serving import origins
    from server_patch.serving.served import ModelNotServed, not_served_response

    app.add_exception_handler(ModelNotServed, not_served_response)
    origins.install(app)


def health_fields() -> dict[str, str]:
    """Extra ``/health`` keys added by the patch: how a test or an operator tells a patched
    server from a stock one."""
    from server_patch import PATCH_VERSION

    return {"apc_lineage_patch": PATCH_VERSION}
