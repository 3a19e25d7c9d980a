"""TERM then KILL through ``psutil.wait_procs``, on real child processes."""

from __future__ import annotations

import subprocess
import sys

import psutil

from apcctl.core.manage import terminate

IGNORES_TERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(600)")


def started(code: str) -> tuple[subprocess.Popen[str], psutil.Process]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child, psutil.Process(child.pid)


def test_a_process_that_exits_on_sigterm_is_not_killed() -> None:
    child, process = started("import time; print('ready', flush=True); time.sleep(600)")
    assert terminate(process, grace=60) == "SIGTERM"
    assert not process.is_running()
    child.wait(10)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    child, process = started(IGNORES_TERM)
    assert terminate(process, grace=0.5) == "SIGKILL"
    assert not process.is_running()  # reaped by wait_procs, not left a zombie
    child.wait(10)


def test_a_process_already_gone_is_reported_as_terminated() -> None:
    child, process = started("print('ready', flush=True)")
    child.wait(10)
    assert terminate(process, grace=1) == "SIGTERM"
