"""The replay trace: one JSON object per line, one request per object.

A request carries a conversation id ``conv``, a time ``t`` in seconds, and its prompt as one of

* ``tokens``: the token ids;
* ``text``: text, split by a trivial deterministic whitespace tokenizer (``tokenize_text``);
* ``from``/``keep``/``add``: the first ``keep`` tokens of request number ``from`` (0-based, in
  file order) followed by the ids in ``add``. Clients re-send whole conversations, so this
  stores each turn's new tokens once and keeps a 3M-token trace near 1 MB.

Optional fields: ``anchor_len`` (the system+tools prefix length the server computes, slack
included), ``segments`` (chat-template boundary lengths: tools end, system end, each message
start), ``gen`` (the generation prompt's length at the prompt's end), ``blocks`` (section starts
inside the first user message, ``boundaries.Kind.BLOCK``), ``ns`` (cache namespace, default ""),
``kind`` (what the generator meant: turn, edit,
regenerate, retry, new_session, subagent, scheduled), ``agent``, ``reply`` (the ids the model
generated and was fed, its sampled stop token excluded) and ``verbatim`` (whether the
conversation's next prompt re-renders that reply token for token; see
``apcctl.lab.sim.template_study``). With a reply, ``from``/``keep`` may reach into it: request
``from``'s base is then its prompt followed by its reply. A line with a ``trace`` key is a header
and holds metadata only; traces without replies load as before.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO

import numpy as np

from apcctl.lab.sim.prefix import PrefixSet

FORMAT = "apcctl-replay/1"
TEXT_VOCAB_BASE = 1000
TEXT_VOCAB_SIZE = 150_000


@dataclass(eq=False)
class Request:
    """One prompt as the server would see it, plus what the server would know about its shape."""

    conv: str
    t: float
    tokens: np.ndarray
    anchor_len: int | None = None
    segments: tuple[int, ...] = ()
    namespace: str = ""
    kind: str = "turn"
    agent: str = ""
    index: int = 0
    reply: np.ndarray | None = None
    reply_verbatim: bool = False
    gen: int = 0  # the generation prompt's tokens at the prompt's end (0: unknown)
    blocks: tuple[int, ...] = ()  # section starts inside the first user message (``Kind.BLOCK``)

    @property
    def gen_start(self) -> int | None:
        """Where the generation prompt starts (None: unknown)."""
        return self.n - self.gen if 0 < self.gen < self.n else None

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seen(self) -> np.ndarray:
        """The prompt and the generated reply after it: what a cache could hold once it ends."""
        if self.reply is None or not self.reply.shape[0]:
            return self.tokens
        return np.concatenate([self.tokens, self.reply]).astype(np.int32)


@dataclass
class Trace:
    """Requests in file order, and the header's metadata."""

    requests: list[Request]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.n for r in self.requests)

    def in_time_order(self) -> list[Request]:
        """Requests sorted by time; ties keep file order (the sort is stable)."""
        return sorted(self.requests, key=lambda r: r.t)


def tokenize_text(text: str) -> np.ndarray:
    """Whitespace-split words mapped to ids by CRC32: deterministic across runs and machines."""
    ids = [TEXT_VOCAB_BASE + zlib.crc32(word.encode("utf-8")) % TEXT_VOCAB_SIZE
           for word in text.split()]
    return np.asarray(ids, dtype=np.int32)


def _as_ids(values: Iterable[Any]) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(list(values), dtype=np.int32).reshape(-1))


def parse_lines(lines: Iterable[str]) -> Trace:
    """Parse JSONL text; raises ValueError naming the line on a malformed record."""
    requests: list[Request] = []
    meta: dict[str, Any] = {}
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
            if "trace" in record:
                meta.update(record)
                continue
            requests.append(_request(record, requests))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"trace line {lineno}: {exc}") from None
    return Trace(requests, meta)


def _request(record: dict[str, Any], earlier: list[Request]) -> Request:
    if "tokens" in record:
        tokens = _as_ids(record["tokens"])
    elif "text" in record:
        tokens = tokenize_text(str(record["text"]))
    elif "from" in record:
        base = earlier[int(record["from"])].seen
        keep = int(record.get("keep", earlier[int(record["from"])].n))
        if keep > base.shape[0]:
            raise ValueError(f"keep={keep} exceeds request {record['from']}'s {base.shape[0]} tokens")
        tokens = np.concatenate([base[:keep], _as_ids(record.get("add", []))])
    else:
        raise ValueError("a request needs 'tokens', 'text' or 'from'")
    anchor = record.get("anchor_len")
    reply = record.get("reply")
    return Request(
        conv=str(record.get("conv", f"r{len(earlier)}")),
        t=float(record.get("t", len(earlier))),
        tokens=tokens,
        anchor_len=None if anchor is None else int(anchor),
        segments=tuple(int(s) for s in record.get("segments", ())),
        namespace=str(record.get("ns", "")),
        kind=str(record.get("kind", "turn")),
        agent=str(record.get("agent", "")),
        index=len(earlier),
        reply=None if reply is None else _as_ids(reply),
        reply_verbatim=bool(record.get("verbatim", False)),
        gen=int(record.get("gen", 0)),
        blocks=tuple(int(b) for b in record.get("blocks", ())),
    )


def read_trace(path: str | Path) -> Trace:
    with open(path, encoding="utf-8") as fh:
        return parse_lines(fh)


def encode(requests: list[Request], meta: dict[str, Any] | None = None) -> Iterator[str]:
    """JSONL lines; each prompt is written as a delta on the earlier prompt sharing most of it."""
    if meta is not None:
        yield json.dumps({"trace": FORMAT, **meta}, separators=(",", ":"))
    seen = PrefixSet()
    for i, req in enumerate(requests):
        record: dict[str, Any] = {"conv": req.conv, "t": round(req.t, 3)}
        if req.agent:
            record["agent"] = req.agent
        if req.kind != "turn":
            record["kind"] = req.kind
        if req.namespace:
            record["ns"] = req.namespace
        keep, base = seen.longest(req.tokens)
        if keep > 0:
            record.update({"from": base, "keep": keep, "add": req.tokens[keep:].tolist()})
        else:
            record["tokens"] = req.tokens.tolist()
        if req.anchor_len is not None:
            record["anchor_len"] = req.anchor_len
        if req.segments:
            record["segments"] = list(req.segments)
        if req.gen:
            record["gen"] = req.gen
        if req.blocks:
            record["blocks"] = list(req.blocks)
        if req.reply is not None:
            record["reply"] = req.reply.tolist()
            record["verbatim"] = req.reply_verbatim
        seen.add(req.seen, i)
        yield json.dumps(record, separators=(",", ":"))


def write_trace(out: str | Path | TextIO, requests: list[Request], meta: dict[str, Any] | None = None) -> None:
    lines = encode(requests, meta)
    if isinstance(out, (str, Path)):
        with open(out, "w", encoding="utf-8") as fh:
            fh.writelines(line + "\n" for line in lines)
    else:
        out.writelines(line + "\n" for line in lines)


def bundled_trace_path() -> Path:
    """The full-scale agent trace shipped with the package (``apcctl bench replay``'s default)."""
    from importlib import resources

    return Path(str(resources.files("apcctl.lab.sim").joinpath("traces", "agents.jsonl")))
