"""The one way a fail-closed handler gives up: log it, and re-raise under ``APC_TEST_FAULTS=1``.

A production server hides a bug in a restore, a commit or a hook behind a cold prefill (never
garbage, never a failed request). That is right in production and wrong in a test: a test
would see only a slower answer. So each such handler calls ``fail_closed``, which logs as the
handler always did and, with the test fault switch on, raises the exception again so the test
sees it. Handlers that must swallow a fault *by design* (a write the disk refuses, a damaged
file, an injected ENOSPC) do not call it: those faults are what the fault suite injects.
"""

from __future__ import annotations

import logging

from server_patch import settings


def raises_in_tests() -> bool:
    """Whether fail-closed handlers re-raise (the test fault switch, ``APC_TEST_FAULTS``)."""
    return bool(settings.value("APC_TEST_FAULTS"))


def fail_closed(exc: BaseException, what: str, *, log: logging.Logger, level: int = logging.WARNING) -> None:
    """Log ``what`` failed with ``exc``; re-raise it under ``APC_TEST_FAULTS=1``. Call it from
    inside the ``except`` block, so the re-raise keeps the traceback."""
    log.log(level, "%s failed: %s", what, exc)
    if raises_in_tests():
        raise exc


__all__ = ["fail_closed", "raises_in_tests"]
