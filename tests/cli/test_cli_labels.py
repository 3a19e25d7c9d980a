"""A label a client wrote never drives the operator's terminal.

An anchor's label is the start of a client's system prompt. Printed raw, ``ESC[2J`` clears the
operator's screen, an OSC string retitles the window (or, in some terminals, writes the
clipboard), and a rich/Textual markup tag restyles the table or, malformed, crashes it. Through
the real CLI against a real server: ``anchors list``, ``entries`` and ``entries ID`` print the
label with every escape sequence and control character removed and brackets as plain text; the
dashboard's label cell and entry title come from the same ``render.printable``.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from rich.text import Text

from apcctl.cli import main
from apcctl.core import render
from tests.server_harness import ADMIN_TOKEN, PatchedServer, text

# CSI clear screen, an OSC title (BEL- and ST-terminated), 8-bit CSI and OSC, C0 and C1 controls,
# a bidi override, and markup that rich would read (the last one malformed).
HOSTILE = ("A\x1b[2J\x1b]0;pwned\x07B\x1b]52;c;Y2xpcA==\x1b\\C\x9b31mD\x9d0;t\x9cE\x00\x08\x7f\x85F"
           "\u202eG [bold red]H[/] [/nope]")
SHOWN = "ABCDE FG [bold red]H[/] [/nope]"  # what an operator must see instead (NEL: a space)
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # a newline ends a line


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("cli-labels")) as srv:
        yield srv


@pytest.fixture(scope="module")
def anchor(server: PatchedServer) -> dict[str, Any]:
    system = f"{HOSTILE} {uuid.uuid4().hex[:8]} " + text(120, 401)
    status, body = server.admin("POST", "/anchors", {"system": system})
    assert status == 200, body
    assert "\x1b[2J" in body["anchor"]["label"]  # the server keeps the client's text as it came
    return body["anchor"]


def _cli(server: PatchedServer, *args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--server", server.base_url, "--token", ADMIN_TOKEN])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.server
@pytest.mark.parametrize("command", [("anchors", "list"), ("entries",), ("entries", "--kind", "anchor"),
                                     ("entries", "{id}"), ("anchors", "list", "--checkpoints")])
def test_labels_are_printed_without_escapes_or_markup(server: PatchedServer, anchor: dict[str, Any],
                                                      command: tuple[str, ...]) -> None:
    output = _cli(server, *(part.replace("{id}", anchor["id"]) for part in command))
    assert anchor["id"] in output
    assert not CONTROL.search(output), repr(output)
    assert SHOWN in output, output  # a label's first 40 characters once cleaned


def test_printable_removes_whole_sequences_and_keeps_text() -> None:
    assert render.printable(HOSTILE) == SHOWN
    assert render.printable("line one\nline\ttwo\r") == "line one line two "  # one row stays one line
    assert render.printable("unterminated \x1b]0;title") == "unterminated "
    assert render.printable("caf\u00e9 \u65e5\u672c") == "caf\u00e9 \u65e5\u672c"  # printable text is kept


def test_table_cells_are_plain_text_never_markup() -> None:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render.table(("LABEL",), [(HOSTILE,)]))
    assert SHOWN in out.getvalue() and not CONTROL.search(out.getvalue())


def test_the_dashboard_shows_labels_the_same_way() -> None:
    from tui.columns import entry_columns
    from tui.widgets.timeline import describe

    (label,) = [c for c in entry_columns(lambda: 0.0) if c.key == "label"]
    cell = label.cell({"label": HOSTILE})
    assert isinstance(cell, Text) and not CONTROL.search(cell.plain) and cell.plain.startswith("ABCDE FG [bold")
    title = describe({"id": "e1", "kind": "anchor", "length": 3, "checkpoints": [], "label": HOSTILE})
    assert SHOWN in title.plain and not CONTROL.search(title.plain.replace("\n", " "))
