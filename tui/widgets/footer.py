"""The footer with Help and Quit first.

Textual's footer lists the focused widget's keys, then the screen's, then the app's, and on a
narrow terminal (80 columns) cuts what does not fit at the right end: the app's ``? Help`` and
``q Quit``. Here they come first, so they are always on screen.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

FIRST = ("help", "quit")  # actions drawn leftmost


class KeysFooter(Footer):
    def compose(self) -> ComposeResult:
        keys = list(super().compose())
        if any(key.has_class("-grouped") for key in keys):  # grouped keys sit in a KeyGroup: keep the order
            yield from keys
            return
        first = sorted((k for k in keys if isinstance(k, FooterKey) and k.action in FIRST),
                       key=lambda k: FIRST.index(k.action))
        yield from first + [k for k in keys if k not in first]
