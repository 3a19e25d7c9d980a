"""The exit codes every server command shares (``common`` re-exports them); importing this is
free, so ``apcctl --help`` can list them without loading any command."""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    OK = 0
    FAILED = 1  # the operation failed: server error, restart stopped, timeout
    USAGE = 2  # click's usage errors, unknown server names, bad config files
    UNREACHABLE = 3  # nothing answered at the server's URL
    AUTH = 4  # missing or wrong admin token (HTTP 401/403)
    NOT_FOUND = 5  # unknown entry or anchor id, or no such managed server


EXIT_CODES_HELP = """\b
Exit codes:
  0  ok
  1  the operation failed (server error, restart stopped, timeout)
  2  usage error (bad option, unknown server name, bad config file)
  3  server unreachable
  4  authentication failed (missing or wrong admin token)
  5  not found (unknown entry or anchor id, no such managed server)"""

EXIT_CODES_SHORT = "Exit codes: 0 ok, 1 failed, 2 usage, 3 unreachable, 4 auth failed, 5 not found."
