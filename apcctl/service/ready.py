"""``python -m apcctl.service.ready URL [TIMEOUT]``: exit 0 once ``URL/health`` answers 200.

Under a systemd unit (``Type=notify``, ``NotifyAccess=all``) ``apcctl serve --foreground``
starts it beside the server it becomes, with ``NOTIFY_SOCKET`` set: once ``/health`` answers it
sends systemd the one datagram ``READY=1`` (the whole of ``sd_notify`` a readiness needs, so no
dependency), and ``systemctl --user start|restart`` returns only once the model is loaded and
serving. Without ``NOTIFY_SOCKET`` it is a plain readiness check.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Callable, Mapping

NOTIFY_SOCKET = "NOTIFY_SOCKET"  # (apcctl.core.manage.NOTIFY_SOCKET: this module stays light)
# systemd reads the sender's cgroup from its PID; a sender that exits at once may be gone before
# it does (older systemd then drops the message), so the notifier lingers this long after it.
LINGER_S = 2.0


def wait_healthy(url: str, timeout: float, poll_s: float = 0.5, alive: Callable[[], bool] | None = None) -> bool:
    """``url``/health answered 200 within ``timeout``; stops early once ``alive()`` is False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (alive is None or alive()):
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2.0) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(poll_s)
    return False


def notify(message: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` (``READY=1``) to systemd's ``NOTIFY_SOCKET``; False when there is none."""
    address = environ.get(NOTIFY_SOCKET, "")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)
    return True


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m apcctl.service.ready URL [TIMEOUT_S]", file=sys.stderr)
        return 2
    timeout = float(args[1]) if len(args) == 2 else 600.0
    parent = os.getppid()  # the server (the process that started this one, then became the server)
    if wait_healthy(args[0], timeout, alive=lambda: os.getppid() == parent):
        if notify("READY=1"):
            time.sleep(LINGER_S)
        return 0
    print(f"apcctl.service.ready: {args[0]}/health did not answer within {timeout:.0f} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
