"""``apcctl bench fleet``: how much of one server's reuse each smg policy keeps on a fleet.

N tiny-model servers on loopback; the same agent trace goes to one server directly, then
through a fresh gateway per policy (each run its own tenant, sent as the OpenAI ``user`` field that
the servers take as the tenant with ``APC_TENANT_FROM_USER=1``, so no run reuses another's entries;
and a fresh gateway, so no policy inherits another's routing memory). Reuse is
``cached_tokens / prompt_tokens`` over the trace; the split is how many requests each server
served and "prefilled" the prompt tokens the servers computed (both from their /admin/status
counters, so the prefills of pinning anchors count too). ``trace`` picks the traffic
(``apcctl.fleet.traffic.TRACES``: the agent trace, or the e2e tests' conversations).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from apcctl.core.client import AdminClient
from apcctl.core.gateway import GatewayProcess, GatewaySpec
from apcctl.core.hosts import free_port
from apcctl.core.manage import ManagedServer, build_spec
from apcctl.fleet.traffic import TraceResult, replay, system_prompts


@dataclass(frozen=True)
class Variant:
    """One way of routing: a policy, its flags, and whether the client sends a routing key."""

    label: str
    policy: str | None  # None: straight to the first server, no gateway
    cache_boundaries: tuple[int, ...] = ()
    routing_key: str = ""  # what the client's x-smg-routing-key names: "conversation", "agent"
    args: tuple[str, ...] = ()
    pin_everywhere: bool = False  # every server pins every agent's system prompts first


def variants(boundaries: tuple[int, ...]) -> list[Variant]:
    return [Variant("one server (direct)", None), Variant("round_robin", "round_robin"),
            Variant("cache_aware", "cache_aware"),
            Variant("round_robin + every server pins the system prompts", "round_robin", pin_everywhere=True),
            Variant("cache_aware + every server pins the system prompts", "cache_aware", pin_everywhere=True),
            Variant(f"prefix_hash --cache-boundaries {','.join(map(str, boundaries))}", "prefix_hash", boundaries),
            Variant("prefix_hash", "prefix_hash"),
            Variant("prefix_hash --prefix-token-count 32", "prefix_hash", args=("--prefix-token-count", "32")),
            Variant("consistent_hashing", "consistent_hashing"),
            Variant("consistent_hashing + key per conversation", "consistent_hashing", routing_key="conversation"),
            Variant("consistent_hashing + key per agent", "consistent_hashing", routing_key="agent")]


@dataclass
class Row:
    variant: Variant
    result: TraceResult
    split: list[int] = field(default_factory=list)
    anchor_bytes: int = 0  # pinned for this run, all servers together
    prefilled: int = 0  # prompt tokens the servers prefilled for this run (pins included), all together

    def as_dict(self, baseline: float) -> dict[str, Any]:
        r = self.result
        return {"policy": self.variant.label, "requests": len(r.sent), "failed": r.failed,
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "reuse": round(r.reuse, 4),
                "of_one_server": round(r.reuse / baseline, 4) if baseline else None, "split": self.split,
                "anchor_bytes": self.anchor_bytes, "prefilled_tokens": self.prefilled, "by_kind": self.by_kind()}

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Requests, prompt and cached tokens per request kind (new_session, turn, edit...)."""
        kinds: dict[str, dict[str, int]] = {}
        for sent in self.result.sent:
            row = kinds.setdefault(sent.kind, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            row["requests"] += 1
            row["prompt_tokens"] += sent.prompt_tokens
            row["cached_tokens"] += sent.cached_tokens
        return kinds


def run_bench(model: str, *, servers: int = 3, requests: int = 24, max_tokens: int = 8, agents: int = 3,
              boundaries: tuple[int, ...] = (64, 256), only: tuple[str, ...] = (),
              on_progress: Callable[[str], None] = lambda _: None, root: Path | None = None,
              trace: str = "agents") -> list[Row]:
    """Start the servers, run every variant (``only``: labels or policies to keep), stop them."""
    root = root or Path(tempfile.mkdtemp(prefix="apcctl-bench-fleet-"))
    members = [ManagedServer(f"bench-{i + 1}", root / "servers") for i in range(servers)]
    specs = [build_spec(m.name, model=model, port=free_port(), env={"HF_HUB_OFFLINE": "1", "APC_TENANT_FROM_USER": "1"}, directory=m.directory)
             for m in members]
    chosen = [v for v in variants(boundaries) if (not only or v.label in only or v.policy in only
              or (v.policy is None and "direct" in only)) and (trace == "agents" or not v.pin_everywhere)]
    rows: list[Row] = []
    try:
        for member, spec in zip(members, specs):
            member.start(spec)
        for member in members:
            member.wait_ready(300)
        on_progress(f"{servers} servers ready: {', '.join(s.url for s in specs)}")
        admins = [AdminClient(s.url, m.token()) for m, s in zip(members, specs)]
        for n, variant in enumerate(chosen):
            tenant = f"run {n:02d}"
            pinned = [_anchor_bytes(a) for a in admins]
            before = [_counters(a) for a in admins]
            if variant.pin_everywhere:
                for admin in admins:
                    for system in system_prompts(agents):
                        admin.new_anchor(system, tenant=tenant)
            served = [_counters(a)[0] for a in admins]
            if variant.policy is None:
                result = replay(specs[0].url, model=model, requests=requests, max_tokens=max_tokens, tenant=tenant,
                                agents=agents, trace=trace)
            else:
                result = _through_gateway(root / "gateways" / str(n), variant, [s.url for s in specs], model,
                                          requests, max_tokens, tenant, agents, trace)
            after = [_counters(a) for a in admins]
            rows.append(Row(variant, result, [a[0] - b for a, b in zip(after, served)],
                            sum(_anchor_bytes(a) for a in admins) - sum(pinned),
                            sum(a[1] - b[1] for a, b in zip(after, before))))
            on_progress(f"{variant.label}: reuse {result.reuse:.3f} over {len(result.sent)} requests, "
                        f"split {rows[-1].split}")
    finally:
        for member in members:
            member.stop(grace=20)
    return rows


def _through_gateway(directory: Path, variant: Variant, urls: list[str], model: str, requests: int,
                     max_tokens: int, tenant: str, agents: int, trace: str) -> TraceResult:
    gateway = GatewayProcess(directory)
    spec = GatewaySpec(port=free_port(), worker_urls=urls, policy=variant.policy or "",
                       cache_boundaries=list(variant.cache_boundaries), args=list(variant.args),
                       metrics_port=free_port())
    gateway.start(spec)
    try:
        gateway.client(spec.url).wait_ready(urls, 120, gateway)
        return replay(spec.url, model=model, requests=requests, max_tokens=max_tokens, tenant=tenant,
                      routing_key=variant.routing_key, agents=agents, trace=trace)
    finally:
        gateway.stop(grace=10)


def _anchor_bytes(admin: AdminClient) -> int:
    sizing = admin.status().sizing
    return sizing.budgets.anchor_bytes if sizing else 0


def _counters(admin: AdminClient) -> tuple[int, int]:
    """Requests this server has answered (lookups of its lineage cache, hits and colds) and the
    prompt tokens it prefilled."""

    hits = admin.status().hits
    return hits.requests, hits.prefill_tokens
