"""The one place ``launchctl`` and ``systemctl`` are run.

They are looked up on ``PATH`` like any command, so a test puts a directory of fake binaries
first on ``PATH`` and sees real processes called with real arguments.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


class SupervisorError(RuntimeError):
    """A supervisor command is missing or failed; the message names it and its stderr."""


@dataclass(frozen=True)
class Outcome:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_supervisor(argv: list[str], *, check: bool = True, timeout: float = 600.0) -> Outcome:
    """Run ``argv`` (``launchctl ...``/``systemctl ...``); with ``check``, a non-zero exit raises."""
    if shutil.which(argv[0]) is None:
        raise SupervisorError(f"{argv[0]} is not on PATH: is this the right machine for this supervisor?")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SupervisorError(f"{' '.join(argv)} did not finish within {timeout:.0f} s") from None
    outcome = Outcome(argv, done.returncode, done.stdout, done.stderr)
    if check and done.returncode != 0:
        raise SupervisorError(f"{' '.join(argv)} exited {done.returncode}: "
                              f"{(done.stderr or done.stdout).strip()}")
    return outcome
