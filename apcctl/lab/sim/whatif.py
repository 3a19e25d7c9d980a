"""What-if sizing from real traffic: a journal's window replayed through the simulator.

The journal keeps every sequence the server's cache processed as the live oracle's block hashes
(``blocks`` lines: a prompt at its lookup, a prompt and its fed reply when its entry moved past
it; no token text). Each hash names a whole prefix, so the replay rebuilds the traffic in block
space: a distinct hash becomes one id, repeated ``block`` times, so two rebuilt prompts share
exactly the whole blocks the real ones shared; each prompt ends in one id of its own (its last,
partial block: what the real prompt's last tokens were is not kept). A reply line is paired with
the latest prompt of its namespace it extends, and becomes that request's reply, so reply reuse
replays too. The rebuilt requests go through the same request flow as the server
(``LineagePolicy``, ``lineage.flow``), once with the settings the server ran with (the journal's
``start`` line) and once with the proposed ones.

What is lost is where the real restore points fell inside a block: a replayed request restores
at most a block less than the server did (and at most one token more). Chat-template segment and
anchor boundaries are not journaled: the replay plans no segment or anchor captures, so traffic
that restored at them replays colder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping

import numpy as np

from apcctl.lab.sim.policies.lineage import LineagePolicy
from apcctl.lab.sim.sizes import StateSizes
from apcctl.lab.sim.trace import Request
from server_patch.integration.block_lines import BlockDecoder
from server_patch.lineage.config import LineageConfig
from server_patch.lineage.misses import REPLY

# ``--what-if`` names: the config's fields, and the short names ``apcctl serve`` and the config file use.
ALIASES = {"ram_budget": "ram_budget_bytes", "disk_budget": "disk_max_bytes", "anchor_budget": "anchor_max_bytes",
           "shadow_budget": "shadow_budget_bytes"}


@dataclass
class _Seen:
    """One ``blocks`` line: a processed sequence."""

    t: float
    namespace: str
    tokens: int
    hashes: np.ndarray
    reply: "_Seen | None" = None


@dataclass
class JournalTraffic:
    """The window's prompts (each with its reply, if one was journaled) and the server's settings."""

    prompts: list[_Seen] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    block: int = 16
    restored: int = 0  # what the server restored in the window (its request lines)

    @property
    def prompt_tokens(self) -> int:
        return sum(p.tokens for p in self.prompts)


def read_traffic(records: Iterable[Mapping[str, Any]]) -> JournalTraffic:
    """The ``blocks``, ``request`` and ``start`` lines of a journal window, in order."""
    traffic = JournalTraffic()
    decoder = BlockDecoder()
    for record in records:
        kind = record.get("type")
        if kind == "start":
            decoder.start()
            if isinstance(record.get("lineage_config"), dict):
                traffic.config = dict(record["lineage_config"])
        elif kind == "request":
            traffic.restored += int(record.get("restored_tokens", 0))
        elif kind == "blocks":
            hashes = decoder.hashes(record)
            if hashes is None:
                continue  # its base line is outside the window
            seen = _Seen(float(record["time"]), str(record.get("namespace", "")), int(record["tokens"]), hashes)
            traffic.block = int(record.get("block", traffic.block))
            if record.get("kind") == REPLY:
                _pair(traffic.prompts, seen)
            else:
                traffic.prompts.append(seen)
    return traffic


def _pair(prompts: list[_Seen], reply: _Seen) -> None:
    """Give ``reply`` to the latest prompt of its namespace without one that it extends."""
    for prompt in reversed(prompts):
        full = len(prompt.hashes)
        if prompt.reply is None and prompt.namespace == reply.namespace and 0 < full < len(reply.hashes) \
                and reply.hashes[full - 1] == prompt.hashes[full - 1]:
            prompt.reply = reply
            return


def rebuild(traffic: JournalTraffic) -> list[Request]:
    """The prompts in block space (see the module docstring), in journal order."""
    ids: dict[int, int] = {}

    def expand(hashes: np.ndarray) -> np.ndarray:
        dense = [ids.setdefault(int(h), len(ids) + 1) for h in hashes]
        return np.repeat(np.asarray(dense, dtype=np.int64), traffic.block)

    requests = []
    own = 1 << 30  # each prompt's last id, never shared
    t0 = traffic.prompts[0].t if traffic.prompts else 0.0
    for index, prompt in enumerate(traffic.prompts):
        full = len(prompt.hashes)
        reply = None
        seen = prompt.reply
        if seen is not None and len(seen.hashes) > full:
            # The prompt's last id is the first block the reply completes, so prompt + reply
            # is the processed sequence's blocks, as the next prompt re-renders them.
            whole = expand(seen.hashes)
            tokens, reply = whole[: full * traffic.block + 1], whole[full * traffic.block + 1:]
        else:
            own += 1
            tokens = np.concatenate([expand(prompt.hashes), [own]])
        requests.append(Request(conv=prompt.namespace, t=prompt.t - t0, tokens=tokens.astype(np.int32),
                                namespace=prompt.namespace, index=index,
                                reply=None if reply is None else reply.astype(np.int32)))
    return requests


@dataclass
class Outcome:
    """One configuration's replay."""

    name: str
    config: LineageConfig
    reused: list[int]
    prompt_tokens: int
    oracle: dict[str, Any]
    ram_peak: int
    disk_end: int
    checkpoint_bytes: int

    @property
    def restored(self) -> int:
        return sum(self.reused)

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.restored)


def parse_overrides(text: str) -> dict[str, Any]:
    """``ram_budget=64G,max_checkpoints=6`` -> LineageConfig fields, each parsed as its setting."""
    from server_patch.settings import registry

    names = {f.name for f in fields(LineageConfig)}
    variables = LineageConfig.env_names()
    by_name = {s.name: s for s in registry()}
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if not sep or key not in names:
            raise ValueError(f"{part!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(sorted([*ALIASES, *names]))}")
        out[key] = by_name[variables[key]].parse(raw.strip())
    return out


def server_config(traffic: JournalTraffic) -> LineageConfig:
    """The settings the journaled server ran with (its last ``start`` line), else the defaults;
    the shadow block is the journal's."""
    known = {f.name for f in fields(LineageConfig)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in traffic.config.items() if k in known}
    return replace(LineageConfig(), **{**values, "shadow_block_tokens": traffic.block})


def replay(requests: list[Request], sizes: StateSizes, config: LineageConfig, name: str,
           prompt_tokens: int) -> Outcome:
    """Every rebuilt request through the simulator's lineage policy (the server's request flow)."""
    policy = LineagePolicy(sizes, segments=False, config=config)
    reused, peak = [], 0
    for req in requests:
        reused.append(policy.serve(req).reused)
        peak = max(peak, policy.ram_bytes())
    if requests:
        policy.finish(requests[-1].t)
    return Outcome(name, config, reused, prompt_tokens, policy.cache.misses.totals(), max(peak, policy.ram_bytes()),
                   policy.disk_bytes(), policy.checkpoint_bytes())


def what_if(records: Iterable[Mapping[str, Any]], sizes: StateSizes, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The window with the server's settings and with ``overrides``, side by side (JSON-ready)."""
    traffic = read_traffic(records)
    requests = rebuild(traffic)
    current = server_config(traffic)
    proposed = replace(current, **overrides)
    proposed.validate()
    runs = [replay(requests, sizes, current, "current", traffic.prompt_tokens),
            replay(requests, sizes, proposed, "proposed", traffic.prompt_tokens)]
    return {"requests": len(requests), "prompt_tokens": traffic.prompt_tokens, "block": traffic.block,
            "journal_restored_tokens": traffic.restored, "sizes": sizes.name,
            "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()},
            "runs": [_run_view(run) for run in runs]}


def _run_view(run: Outcome) -> dict[str, Any]:
    return {"name": run.name, "prefill_tokens": run.prefill_tokens, "restored_tokens": run.restored,
            "oracle_ratio": run.oracle["ratio"],
            "lost_tokens": {k: v for k, v in run.oracle["lost_tokens"].items() if v},
            "ram_peak_bytes": run.ram_peak, "disk_bytes": run.disk_end, "checkpoint_bytes": run.checkpoint_bytes,
            "ram_budget_bytes": run.config.ram_budget_bytes, "max_checkpoints": run.config.max_checkpoints,
            "reused": run.reused}


__all__ = ["ALIASES", "JournalTraffic", "Outcome", "parse_overrides", "read_traffic", "rebuild", "replay",
           "server_config", "what_if"]
