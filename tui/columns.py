"""How each record becomes a table row: the requests, lineage and anchor tables' columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from rich.text import Text

from apcctl.core import render
from apcctl.core.drift_view import drift_label
from apcctl.core.render import LOST_SHORT, largest_first
from tui.state import Keyed, reuse_fraction
from tui.widgets.keyed_table import Column

if TYPE_CHECKING:
    from server_patch.admin.schema import EntryInfo

KIND_STYLES = {"cold": "red", "entry": "green", "anchor": "cyan", "disk": "blue", "final": "green",
               "divergence": "magenta", "periodic": "blue", "segment": "cyan", "guard": "yellow"}


def kind_text(kind: str, label: str | None = None) -> Text:
    return Text(label or kind, style=KIND_STYLES.get(kind, ""))


def tokens(n: int | None) -> str:
    return "-" if n is None else f"{int(n):,}"


def clip(text: str, width: int) -> str:
    text = " ".join(render.printable(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


def label_text(text: str, width: int) -> Text:
    """A client-derived label as a cell: controls stripped, and a ``Text`` so Textual never reads markup."""
    return Text(clip(text, width))


def short_id(entry_id: str | None) -> str:
    return entry_id or "-"


def oracle_cell(record: Mapping[str, Any]) -> str:
    """What an unbounded cache would have restored; ``-`` from a server before issue 26."""
    return tokens(record.get("oracle"))


def lost_total(record: Mapping[str, Any]) -> int | None:
    """The tokens it restored less than the oracle (the LOST column sorts by it)."""
    if "oracle" not in record:
        return None
    return sum(int(n) for n in (record.get("lost") or {}).values())


def lost_cell(record: Mapping[str, Any]) -> str | Text:
    """The top reason and its tokens, ``+`` when there were more reasons ("ram 48+"); blank
    when nothing was lost, ``-`` from a server before issue 26."""
    label = render.lost_label(record)
    return Text(label, style="yellow") if label not in ("", "-") else label


def oracle_line(totals: Mapping[str, Any]) -> Text:
    """The counters' oracle row in one line, in the LOST column's names: "0.67 of unbounded ·
    lost ram 16%, disk bad 7%, …" (restored / oracle; ``apcctl status`` says it in words)."""
    oracle = int(totals.get("oracle_tokens") or 0)
    if totals.get("enabled") is False:
        line = "off (APC_LINEAGE_SHADOW_BUDGET_BYTES=0)"
    elif not oracle:
        line = f"no repeated prefix yet ({int(totals.get('requests') or 0):,} requests)"
    else:
        line = f"{int(totals.get('restored_tokens') or 0) / oracle:.2f} of unbounded"
        lost = largest_first(totals.get("lost_tokens"))
        if lost:
            line += " · lost " + ", ".join(f"{LOST_SHORT.get(reason, reason)} {_share(n, oracle)}" for n, reason in lost)
    return Text(line, no_wrap=True, overflow="ellipsis")


def _share(part: int, whole: int) -> str:
    share = 100 * part / whole
    return f"{share:.0f}%" if share >= 1 else "<1%"


def drift_cell(record: Mapping[str, Any]) -> str | Text:
    """What the client changed against its earlier prompt and where ("date @1,204", issue 37;
    ``apcctl requests ID`` shows the diff); blank when nothing, ``-`` from an older server."""
    label = drift_label(record)
    return Text(label, style="magenta") if label not in ("", "-") else label


def wait_cell(record: Mapping[str, Any]) -> str | Text:
    """The time it waited for other requests' work and what most of it was ("2,914 prefill+");
    blank when nothing held it up, ``-`` from a server before issue 29's waits."""
    label = render.wait_label(record)
    return Text(label, style="yellow") if label not in ("", "-") else label


def gap_cell(record: Mapping[str, Any]) -> str | Text:
    """Its longest inter-token gap while decoding and what most of it was ("734 join", issue 40);
    yellow when another's work was the most of it, blank before a gap, ``-`` from an older server."""
    label = render.gap_label(record)
    own = label.endswith((" step", " unattributed"))
    return Text(label, style="yellow") if label not in ("", "-") and not own else label


def request_columns() -> list[Column[Keyed]]:
    """What it restored, what an unbounded cache would have (the live oracle) and why the rest
    was lost, then time to first token split where an operator can act on it: lookup,
    admission, prefill, commit; then how long other requests' work held it up (WAIT)."""

    def field(name: str) -> Callable[[Keyed], Any]:
        return lambda r: r.data.get(name)

    def ms(name: str) -> Column[Keyed]:
        label = name.removesuffix("_ms").replace("admission", "admit").upper()
        return Column(name, f"{label} ms" if name == "ttft_ms" else label,
                      lambda r: render.ms(r.data.get(name)), field(name), numeric=True)

    return [
        Column("started", "TIME", lambda r: render.clock(r.data.get("started")), field("started")),
        Column("entry_id", "ENTRY", lambda r: short_id(r.data.get("entry_id")), field("entry_id")),
        Column("prompt_tokens", "PROMPT", lambda r: tokens(r.data.get("prompt_tokens")), field("prompt_tokens"),
               numeric=True),
        Column("restored_tokens", "RESTORED", lambda r: tokens(r.data.get("restored_tokens")),
               field("restored_tokens"), numeric=True),
        Column("reuse", "REUSE", lambda r: f"{100 * reuse_fraction(r.data):.0f}%", lambda r: reuse_fraction(r.data),
               numeric=True),
        Column("restore_kind", "KIND", lambda r: kind_text(r.data.get("restore_kind", "?"), render.restore_label(r.data)),
               field("restore_kind")),
        Column("oracle", "ORACLE", lambda r: oracle_cell(r.data), field("oracle"), numeric=True),
        Column("lost", "LOST", lambda r: lost_cell(r.data), lambda r: lost_total(r.data)),
        Column("drift", "DRIFT", lambda r: drift_cell(r.data), lambda r: (r.data.get("drift") or {}).get("tokens")),
        ms("lookup_ms"), ms("admission_ms"), ms("prefill_ms"), ms("commit_ms"), ms("ttft_ms"),
        Column("waited_ms", "WAIT ms", lambda r: wait_cell(r.data), field("waited_ms")),
        Column("worst_gap", "GAP ms", lambda r: gap_cell(r.data), lambda r: (r.data.get("worst_gap") or {}).get("ms")),
    ]


def _label(entry: EntryInfo | Mapping[str, Any]) -> str:
    """An entry's label; also of a row still in JSON (the label tests hand the column one)."""
    return (entry.get("label") if isinstance(entry, Mapping) else entry.label) or ""


def entry_columns(now: Callable[[], float]) -> list[Column[EntryInfo]]:
    """Lineage entries and anchors: what they hold, where, and how recently they paid off."""
    return [
        Column("id", "ID", lambda e: e.id, lambda e: e.id),
        Column("kind", "KIND", lambda e: kind_text(str(e.kind)), lambda e: str(e.kind)),
        Column("pinned", "PIN", lambda e: Text("●", style="bold cyan") if e.pinned else "", lambda e: e.pinned),
        Column("length", "TOKENS", lambda e: tokens(e.length), lambda e: e.length, numeric=True),
        Column("bytes", "RAM", lambda e: render.human_bytes(e.bytes) if e.bytes else "-", lambda e: e.bytes,
               numeric=True),
        Column("disk_bytes", "DISK", lambda e: render.human_bytes(e.disk_bytes) if e.disk_bytes else "-",
               lambda e: e.disk_bytes, numeric=True),
        Column("tier", "TIER", lambda e: str(e.tier), lambda e: str(e.tier)),
        Column("checkpoints", "CKPTS", lambda e: str(len(e.checkpoints)), lambda e: len(e.checkpoints), numeric=True),
        Column("hits", "HITS", lambda e: str(e.hits), lambda e: e.hits, numeric=True),
        Column("last_used", "LAST USED", lambda e: render.ago(e.last_used, now()), lambda e: e.last_used),
        Column("label", "LABEL", lambda e: label_text(_label(e), 32), _label),
    ]
