"""The dashboard as the key-driven tests build it: no periodic poll during a test.

Its poll interval is long enough that every poll a test sees is one it asked for (``r``, a
verb's own poll after it is done, a lost server's backoff, a finished restart's), and the idle
app does not redraw every pane each second while a test waits (a third of some tests' CPU on a
busy box). A test that depends on the periodic poll builds its app with ``make_app`` itself.
"""

from __future__ import annotations

from typing import Any

from tui.app import DashboardApp, make_app
from tui.source import DashboardSource

ASKED_POLLS_ONLY = 60.0


def quiet_app(source: DashboardSource, **options: Any) -> DashboardApp:
    """``make_app(source, **options)`` polling only when asked (see the module's docstring)."""
    return make_app(source, refresh_s=ASKED_POLLS_ONLY, **options)
