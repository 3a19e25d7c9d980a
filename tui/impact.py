"""What an operator's verb will free or hold, in words, for the confirmation dialogs.

Computed from the last poll (entry sizes and the budgets), so the dialog says it before the
server does it. Pure functions: tested without a screen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from apcctl.core import render
from server_patch.admin.schema import Budgets, EntryInfo


@dataclass(frozen=True)
class Impact:
    """A dialog's title, body and confirm button; ``possible`` False means the server would refuse."""

    title: str
    body: str
    confirm: str
    possible: bool = True


def _bytes(n: int | None) -> str:
    return render.human_bytes(n or 0)


def _budgets(budgets: Budgets | Mapping[str, int] | None) -> Budgets:
    """The last poll's budgets; before the cache runs (None), or a budget an older server lacks, reads 0."""
    if isinstance(budgets, Budgets):
        return budgets
    return Budgets.from_json({**{key: 0 for key in Budgets.json_keys()}, **(budgets or {})}, "budgets")


def _name(entry: EntryInfo) -> str:
    return f"{entry.kind} {entry.id} ({entry.length:,} tokens)"


def pin(entry: EntryInfo | Mapping[str, Any], budgets: Budgets | Mapping[str, int] | None) -> Impact:
    entry, b = EntryInfo.of(entry), _budgets(budgets)
    size = entry.bytes
    if entry.only_on_disk:
        return Impact(f"Pin {entry.id}", f"{_name(entry)} is only on disk; the server pins entries held in RAM. "
                      "A request that restores it brings it back to RAM.", "Pin", possible=False)
    if entry.pinned:
        return Impact(f"Pin {entry.id}", f"{_name(entry)} is already a pinned anchor.", "Pin", possible=False)
    count, count_cap = b.anchor_count, b.anchor_count_limit
    held, held_cap = b.anchor_bytes, b.anchor_bytes_limit
    lines = [f"Pin {_name(entry)} as an anchor: LRU eviction no longer touches it.",
             f"Holds {_bytes(size)} of RAM on the anchor budget: {_bytes(held)} -> {_bytes(held + size)} "
             f"of {_bytes(held_cap)}; anchors in RAM {count} -> {count + 1} of {count_cap}.",
             f"Frees {_bytes(size)} of the conversation budget (it stops counting there)."]
    if (count_cap and count + 1 > count_cap) or (held_cap and held + size > held_cap):
        lines.append("Over an anchor cap: the least recently used anchor leaves RAM (it stays on disk if written).")
    return Impact(f"Pin {entry.id}", "\n".join(lines), "Pin")


def unpin(entry: EntryInfo | Mapping[str, Any], budgets: Budgets | Mapping[str, int] | None) -> Impact:
    entry, b = EntryInfo.of(entry), _budgets(budgets)
    if not entry.pinned:
        return Impact(f"Unpin {entry.id}", f"{_name(entry)} is not pinned.", "Unpin", possible=False)
    if entry.only_on_disk:
        return Impact(f"Unpin {entry.id}", f"{_name(entry)} is only on disk; the server unpins entries held "
                      "in RAM.", "Unpin", possible=False)
    size = entry.bytes
    count, held = b.anchor_count, b.anchor_bytes
    body = (f"Unpin {_name(entry)}: it joins the conversation LRU and may be evicted like any conversation.\n"
            f"Frees {_bytes(size)} of the anchor budget ({_bytes(held)} -> {_bytes(max(0, held - size))}; "
            f"anchors in RAM {count} -> {max(0, count - 1)}) and holds it on the conversation budget "
            f"({_bytes(b.conversation_bytes)} -> {_bytes(b.conversation_bytes + size)}"
            f" of {_bytes(b.ram_limit)} RAM).")
    return Impact(f"Unpin {entry.id}", body, "Unpin")


def evict(entry: EntryInfo | Mapping[str, Any], budgets: Budgets | Mapping[str, int] | None) -> Impact:
    entry, b = EntryInfo.of(entry), _budgets(budgets)
    ram, disk = entry.bytes, entry.disk_bytes
    checkpoints = len(entry.checkpoints)
    held = f"with its {checkpoints} checkpoint{'s' if checkpoints != 1 else ''}" if checkpoints else "(no checkpoints)"
    lines = [f"Evict {_name(entry)} {held} from RAM and disk."]
    if entry.pinned:
        lines.append("Sessions sharing this system prompt prefill it again until it is captured again.")
    else:
        lines.append("The conversation's next request prefills from its anchor, or from the start.")
    lines.append(f"Frees {_bytes(ram)} of RAM ({_bytes(b.ram_used)} -> "
                 f"{_bytes(max(0, b.ram_used - ram))} of {_bytes(b.ram_limit)}) "
                 f"and {_bytes(disk)} of disk.")
    if entry.pinned:
        lines.append(f"Frees an anchor slot in RAM ({b.anchor_count} -> "
                     f"{max(0, b.anchor_count - 1)} of {b.anchor_count_limit}).")
    return Impact(f"Evict {entry.id}", "\n".join(lines), "Evict")


CHARACTERS_PER_TOKEN = 4  # the dashboard has no tokenizer: a rough count, said as such


@dataclass(frozen=True)
class Sizes:
    """This model's state sizes, read off the entries the server holds: KV bytes per token, one
    state snapshot (an entry's head, or a checkpoint: fixed-size for recurrent layers), and the
    checkpoint bytes anchors carry per token."""

    per_token: float
    snapshot: int
    checkpoints_per_token: float

    @classmethod
    def of(cls, entries: Sequence[EntryInfo | Mapping[str, Any]]) -> "Sizes | None":
        held = [e for e in map(EntryInfo.of, entries) if e.kv_bytes and e.length]
        if not held:
            return None
        heads = [e.bytes - e.kv_bytes - e.checkpoint_bytes for e in held if e.bytes]
        points = [c.bytes for e in held for c in e.checkpoints if c.bytes]
        snapshots = sorted(b for b in heads + points if b > 0)
        anchors = [e for e in held if e.pinned] or held
        return cls(per_token=sum(e.kv_bytes for e in held) / sum(e.length for e in held),
                   snapshot=snapshots[len(snapshots) // 2] if snapshots else 0,
                   checkpoints_per_token=sum(e.checkpoint_bytes for e in anchors) / sum(e.length for e in anchors))

    def anchor_bytes(self, tokens: int) -> int:
        return int((self.per_token + self.checkpoints_per_token) * tokens + self.snapshot)


def new_anchor(path: str, system: str, tools: list[dict[str, Any]] | None,
               budgets: Budgets | Mapping[str, int] | None, entries: Sequence[EntryInfo | Mapping[str, Any]]) -> Impact:
    """``entries``: what the server holds (any kind); the estimate is made from their real sizes."""
    sizes = Sizes.of(entries)
    tokens = max(1, len(system) // CHARACTERS_PER_TOKEN)
    b = _budgets(budgets)
    count, count_cap = b.anchor_count, b.anchor_count_limit
    lines = [f"Prefill the system prompt in {path} ({len(system):,} characters"
             f"{f', {len(tools)} tool' + ('s' if len(tools) != 1 else '') if tools else ''}) now, "
             "and pin the result as an anchor.",
             f"Holds one anchor slot in RAM ({count} -> {count + 1} of {count_cap}) and its state there"
             + (f": about {_bytes(sizes.anchor_bytes(tokens))} for ~{tokens:,} tokens ({_bytes(sizes.per_token)} "
                f"of KV per token and a {_bytes(sizes.snapshot)} state snapshot, as this model's entries hold; "
                f"~{CHARACTERS_PER_TOKEN} characters a token)." if sizes else "."),
             "The prefill runs as one request on the server, beside live traffic."]
    if count_cap and count + 1 > count_cap:
        lines.append("Over the anchor count cap: the least recently used anchor leaves RAM.")
    return Impact("Pin a new anchor", "\n".join(lines), "Prefill and pin")


def read_anchor_file(text: str) -> tuple[str, list[dict[str, Any]] | None]:
    """A file is the system prompt, or JSON ``{"system": ..., "tools": [...]}``."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except ValueError:
            return text, None
        if isinstance(data, dict) and isinstance(data.get("system"), str):
            tools = data.get("tools")
            return data["system"], tools if isinstance(tools, list) else None
    return text, None
