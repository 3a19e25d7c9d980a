"""The dashboard's own polls kept out of uvicorn's access log (issue 36).

``apcctl top`` reads ``/admin/status``, ``/admin/requests`` and friends several times a second;
in the access log those lines drowned what an operator looks for (a sixth of ``apcctl logs``
after five minutes). A filter on the ``uvicorn.access`` logger drops the admin reads that
succeeded (GET or HEAD of ``/admin...``, status below 400); admin writes (drain, pin, evict,
restart probes) and every failure (a 401 from a scanner) are still logged, and so is everything
else. ``APC_LOG_ADMIN_REQUESTS=1`` logs the reads too.

uvicorn configures its loggers with ``logging.config.dictConfig`` when it starts, which replaces
a logger's handlers but keeps its filters, so the filter is installed before ``uvicorn.run``.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

ACCESS_LOGGER = "uvicorn.access"
SETTING = "APC_LOG_ADMIN_REQUESTS"


class AdminReadsFilter(logging.Filter):
    """Drops uvicorn's access line of a successful admin read: its arguments are
    ``(client, method, path with query, HTTP version, status)`` (uvicorn 0.x's format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True  # not the access line's shape: keep it
        method, path, status = args[1], args[2], args[4]
        return not (method in ("GET", "HEAD") and isinstance(path, str) and _is_admin(path)
                    and isinstance(status, int) and status < 400)


def _is_admin(path: str) -> bool:
    route = path.split("?", 1)[0]
    return route == "/admin" or route.startswith("/admin/")


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """Filter the access log unless ``APC_LOG_ADMIN_REQUESTS`` is on; whether it was installed."""
    from server_patch import settings

    if settings.value(SETTING, environ):
        return False
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, AdminReadsFilter) for f in logger.filters):
        logger.addFilter(AdminReadsFilter())
    return True
