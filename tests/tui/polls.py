"""The dashboard as the key-driven tests build it: no periodic poll during a test.

Its poll interval is long enough that every poll a test sees is one it asked for (``r``, a
verb's own poll after it is done, a lost server's backoff, a finished restart's), and the idle
app does not redraw every pane each second while a test waits (a third of some tests' CPU on a
busy box). A test that depends on the periodic poll builds its app with ``make_app`` itself.

Its notifications stay up for the whole test: Textual removes one after
``App.NOTIFICATION_TIMEOUT`` (5 s) of wall clock, so on a busy box a test reading
``app._notifications`` could find the message already gone (seen at load ~14).
"""

from __future__ import annotations

from typing import Any

from tui.app import DashboardApp, make_app
from tui.source import DashboardSource

ASKED_POLLS_ONLY = 60.0
SHOWN_FOR_THE_TEST = 3600.0  # seconds a notification stays (Textual's default: 5)


def quiet_app(source: DashboardSource, **options: Any) -> DashboardApp:
    """``make_app(source, **options)`` polling only when asked (see the module's docstring)."""
    app = make_app(source, refresh_s=ASKED_POLLS_ONLY, **options)
    app.NOTIFICATION_TIMEOUT = SHOWN_FOR_THE_TEST  # read per notification (``App.notify``)
    return app
