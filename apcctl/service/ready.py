"""``python -m apcctl.service.ready URL [TIMEOUT]``: exit 0 once ``URL/health`` answers 200.

A systemd unit runs it as ``ExecStartPost``: with ``Type=exec`` the unit stays "activating"
until it exits, so ``systemctl --user start|restart`` returns only once the model is loaded
and serving (or fails, and ``Restart=on-failure`` tries again). Python has no ``sd_notify``
without a dependency, so ``Type=notify`` is not used.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request


def wait_healthy(url: str, timeout: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2.0) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m apcctl.service.ready URL [TIMEOUT_S]", file=sys.stderr)
        return 2
    timeout = float(args[1]) if len(args) == 2 else 600.0
    if wait_healthy(args[0], timeout):
        return 0
    print(f"apcctl.service.ready: {args[0]}/health did not answer within {timeout:.0f} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
