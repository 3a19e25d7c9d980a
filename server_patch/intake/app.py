"""The intake checks on mlx-vlm's app: one call, ``install``, from the overlay's ``intake`` topic."""

from __future__ import annotations

from typing import Any


def install(app: Any) -> None:
    """The watcher outside the body guard, both outside what mlx-vlm added so far; a bad limit stops here."""
    from server_patch import settings
    from server_patch.intake import media
    from server_patch.intake.body import InferenceBodyGuard
    from server_patch.intake.client_gone import ENV as CANCEL_ENV
    from server_patch.intake.client_gone import ClientGoneWatcher
    from server_patch.intake.limits import IntakeLimits

    try:
        limits, policy, cancel = IntakeLimits.from_env(), media.current(), bool(settings.value(CANCEL_ENV))
    except ValueError as exc:
        raise SystemExit(f"server_patch: {exc}") from None
    app.add_middleware(InferenceBodyGuard, limits=limits, policy=policy)
    if cancel:
        app.add_middleware(ClientGoneWatcher)
