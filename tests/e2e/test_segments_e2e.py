"""End to end on the tiny model: an agent-shaped scenario, cached tokens before and after segments.

Several agents with shared and varied tools, a clock in a trailing system message, system-prompt
variants, sub-agents and an edit, sent to a real patched server (``usage.prompt_tokens_details
.cached_tokens``). The oracle for each request is the longest prefix its token ids share with
any earlier request's (capped at n - 1), computed here from the same chat template.

"before": segments off (``APC_SEGMENTS=0``: the anchor only); "after": segments on (the
default). Both are started through this file's ``serve`` entry point, which installs the overlay
like ``server_patch.launch`` and also writes each prompt's token ids to ``$SEG_E2E_DUMP`` (the
oracle needs the exact ids the server prefilled).

``python tests/e2e/test_segments_e2e.py report`` prints the table for ``docs/segments.md``.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests"))

import pytest  # noqa: E402

from tests.server_harness import PatchedServer  # noqa: E402

# Words the tiny tokenizer knows as one token each (with their leading space).
WORDS = ("model token cache prompt prefix lineage snapshot layer attention linear sparse index pool "
         "path line code python test assert return class import def self none true false yield async").split()


def text(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def tool(name: str, seed: int, words: int = 170) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": text(words, seed),
        "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": text(12, seed + 1)}}}}}


OPS_TOOLS = [tool(f"ops_{i}", 100 + i) for i in range(8)]
MCP_TOOLS = OPS_TOOLS + [tool("mcp_search", 200), tool("mcp_fetch", 201)]
LITE_TOOLS = OPS_TOOLS[:4] + [tool("lite_a", 210), tool("lite_b", 211)]
SUB_TOOLS = [tool("sub_read", 220), tool("sub_write", 221)]
# 350 words (it was 900): the ~2,470-token tools block before it still passes the 2048 periodic
# point, and the system text still puts the anchor more than the 256-token segment gap past the
# tools' end (the sub-agent's too); the other 550 words were prefill of the same text, no case.
OPS_SYSTEM = text(350, 1)
HELPER_SYSTEM = text(600, 2)
PARAGRAPHS = [text(300, 10 + i) for i in range(4)]
WRITER_A = "\n\n".join(PARAGRAPHS)
WRITER_B = "\n\n".join(PARAGRAPHS[:2] + [text(300, 99)] + PARAGRAPHS[3:])


def clock(minute: int) -> dict[str, str]:
    return {"role": "system", "content": f"Current time: 2026-11-30 09:{minute:02d}"}


def user(seed: int, words: int = 25) -> dict[str, str]:
    return {"role": "user", "content": text(words, seed)}


def reply(seed: int, words: int = 320) -> dict[str, str]:
    return {"role": "assistant", "content": text(words, seed)}


def scenario() -> list[tuple[str, list[dict], list[dict]]]:
    """(name, messages, tools) in the order they are sent."""
    ops = [{"role": "system", "content": OPS_SYSTEM}, clock(41)]
    steps: list[tuple[str, list[dict], list[dict]]] = []
    s1 = ops + [user(1)]
    steps.append(("ops s1 cold", s1, OPS_TOOLS))
    s1 = s1 + [reply(2), user(3)]
    steps.append(("ops s1 turn 2", s1, OPS_TOOLS))
    s1 = s1 + [reply(4), user(5)]
    steps.append(("ops s1 turn 3", s1, OPS_TOOLS))
    steps.append(("ops s2 new session, next minute", [ops[0], clock(42), user(6)], OPS_TOOLS))
    steps.append(("helper: ops tools, own system", [{"role": "system", "content": HELPER_SYSTEM}, user(7)],
                  OPS_TOOLS))
    steps.append(("sub-agent: ops system, own tools", [ops[0], user(8)], SUB_TOOLS))
    steps.append(("ops-mcp: 2 tools appended", [ops[0], user(9)], MCP_TOOLS))
    steps.append(("ops-lite: first 4 tools shared", [{"role": "system", "content": HELPER_SYSTEM}, user(10)],
                  LITE_TOOLS))
    w1 = [{"role": "system", "content": WRITER_A}, user(11)]
    steps.append(("writer A cold", w1, SUB_TOOLS))
    steps.append(("writer B: 3rd paragraph differs", [{"role": "system", "content": WRITER_B}, user(12)],
                  SUB_TOOLS))
    w1 = w1 + [reply(13), user(14), reply(15), user(16)]
    steps.append(("writer A turn 2 (2 turns at once)", w1, SUB_TOOLS))
    edited = w1[:3] + [user(17)]  # the second question rewritten
    steps.append(("writer A edit of the 2nd question", edited, SUB_TOOLS))
    steps.append(("ops s3 new session, minute 43", [ops[0], clock(43), user(18)], OPS_TOOLS))
    s1 = [ops[0], clock(44)] + s1[2:] + [reply(19), user(20)]
    steps.append(("ops s1 turn 4, clock re-rendered", s1, OPS_TOOLS))
    return steps


@dataclass
class Step:
    name: str
    prompt: int
    cached: int
    oracle: int


class ScenarioServer(PatchedServer):
    """The patched server started through this file's ``serve``, which only records each
    prompt's token ids (for the oracle); ``wire``: segments on (``APC_SEGMENTS``)."""

    def __init__(self, model_dir: Path, *, wire: bool, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.dump = self.log_dir / "prompts.jsonl"
        self.env["SEG_E2E_DUMP"] = str(self.dump)
        self.env["APC_SEGMENTS"] = "1" if wire else "0"

    def command(self) -> list[str]:
        from server_patch.launch import server_argv

        return [sys.executable, str(Path(__file__).resolve()), "serve",
                *server_argv(["--model", str(self.model_dir), "--port", str(self.port), *self.args])]

    def last_prompt(self):
        import json

        import numpy as np

        lines = self.dump.read_text().splitlines()
        return np.asarray(json.loads(lines[-1]), dtype=np.int32)


def run(server: ScenarioServer) -> list[Step]:
    from server_patch.lineage.lookup import common_prefix_len

    seen: list = []
    out = []
    for name, messages, tools in scenario():
        answer = server.chat(messages, tools=tools, max_tokens=2)
        ids = server.last_prompt()
        usage = answer["usage"]
        assert usage["prompt_tokens"] == len(ids), (name, usage, len(ids))
        best = max((common_prefix_len(ids, s) for s in seen), default=0)
        seen.append(ids)
        out.append(Step(name, len(ids), int(usage["prompt_tokens_details"]["cached_tokens"]),
                        min(best, len(ids) - 1)))
    return out


def table(runs: dict[str, list[Step]]) -> str:
    """Markdown: cached tokens per request and configuration, against the oracle."""
    names = list(runs)
    first = runs[names[0]]
    lines = ["| request | prompt | oracle | " + " | ".join(names) + " |",
             "|---|---:|---:|" + "---:|" * len(names)]
    for i, step in enumerate(first):
        lines.append(f"| {step.name} | {step.prompt:,} | {step.oracle:,} | "
                     + " | ".join(f"{runs[n][i].cached:,}" for n in names) + " |")
    oracle = sum(s.oracle for s in first)
    prompt = sum(s.prompt for s in first)
    reused = {n: sum(s.cached for s in runs[n]) for n in names}
    lines.append(f"| **reused** | {prompt:,} | {oracle:,} | "
                 + " | ".join(f"{reused[n]:,} ({reused[n] / oracle:.1%})" for n in names) + " |")
    lines.append(f"| **computed** | | {prompt - oracle:,} | "
                 + " | ".join(f"{prompt - reused[n]:,} ({(prompt - reused[n]) / (prompt - oracle):.2f}x)"
                              for n in names) + " |")
    return "\n".join(lines)


# The report's third column: tool boundaries on (a setting, off by default).
TOOLS_ON = {"APC_SEGMENTS_TOOLS": "1"}


def both(model_dir: Path, log_dir: Path, env: dict[str, str] | None = None,
         tools: bool = False, after_entries: list[dict] | None = None) -> dict[str, list[Step]]:
    """The scenario on a server with segments off, then on; ``after_entries`` (if given) gets the
    second server's ``/admin/entries`` once its run is done (one server fewer to start)."""
    env = dict(env or {})
    out = {}
    with ScenarioServer(model_dir, wire=False, env=env, log_dir=log_dir / "before") as server:
        out["before"] = run(server)
        assert "segments off" in server.log_text(), server.log_tail()
    with ScenarioServer(model_dir, wire=True, env=env, log_dir=log_dir / "after") as server:
        out["after"] = run(server)
        assert "segments on" in server.log_text(), server.log_tail()
        if after_entries is not None:
            after_entries.extend(admin_entries(server))
    if tools:
        with ScenarioServer(model_dir, wire=True, env={**env, **TOOLS_ON}, log_dir=log_dir / "tools") as server:
            out["after + tool boundaries"] = run(server)
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    entries: list[dict] = []  # the session's tiny model: the same preset and seed ``report`` builds
    runs = both(tiny_model_dir, tmp_path_factory.mktemp("seg-e2e-logs"), after_entries=entries)
    before, after = runs["before"], runs["after"]
    return {s.name: s for s in before}, {s.name: s for s in after}, before, after, entries


def admin_entries(server: PatchedServer) -> list[dict]:
    import json
    import urllib.request

    from tests.server_harness import ADMIN_TOKEN

    req = urllib.request.Request(server.base_url + "/admin/entries",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["entries"]


@pytest.mark.server
def test_segments_reuse_more_and_never_more_than_the_oracle(results):
    _, _, before, after, _ = results
    assert sum(s.cached for s in after) > sum(s.cached for s in before)
    for b, a in zip(before, after):
        assert a.cached <= a.oracle and b.cached <= b.oracle, (a, b)


@pytest.mark.server
def test_first_sight_divergences_restore_at_template_segments(results):
    before, after, _, _, _ = results
    # A session in the next minute: the anchor ends before the clock message (the tiny
    # tokenizer spells its 12 digits one token each: ~25 tokens before the minute differs),
    # so it restores there instead of at the periodic checkpoint.
    step = after["ops s2 new session, next minute"]
    assert step.oracle - 30 <= step.cached and step.cached > before[step.name].cached
    # A system variant differing in its 3rd of 4 paragraphs: restores at that paragraph's start.
    step = after["writer B: 3rd paragraph differs"]
    assert step.cached >= step.oracle - 2 and step.cached > before[step.name].cached
    # Another lineage's tools end: writer A shares only the sub-agent's tools block.
    step = after["writer A cold"]
    assert step.cached >= step.oracle - 1 and before[step.name].cached < step.cached


@pytest.mark.server
def test_admin_entries_show_segment_checkpoints(results):
    # the entries of the segments-on server once it has served the whole scenario
    kinds = {c["kind"] for e in results[4] for c in e["checkpoints"]}
    assert "segment" in kinds, kinds


# ----------------------------------------------------------------------------- command line


def dump_prompts(path: str) -> None:
    """Append each prompt's token ids the coordinator looks up to ``path`` (one JSON list a line)."""
    import json

    from server_patch.integration import coordinator

    cls = coordinator.LineageCoordinator
    lookup = cls.lookup

    def logged(self, token_ids, **kwargs):
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps([int(t) for t in token_ids]) + "\n")
        return lookup(self, token_ids, **kwargs)

    cls.lookup = logged


def _serve(argv: list[str]) -> None:
    import os

    from server_patch.overlay import install

    install()
    if os.environ.get("SEG_E2E_DUMP"):
        dump_prompts(os.environ["SEG_E2E_DUMP"])
    state = "segments off" if os.environ.get("APC_SEGMENTS") == "0" else "segments on"
    print(f"test_segments_e2e: overlay installed; {state}", file=sys.stderr)
    sys.argv = ["mlx_vlm.server", *argv]
    from mlx_vlm.server.cli import main as server_main

    server_main()


def _report() -> None:
    import tempfile

    from apcctl.lab.tinymodel.build import build_model

    root = Path(tempfile.mkdtemp(prefix="seg-e2e-"))
    model_dir = build_model(root / "tiny", "tiny", seed=0)
    print(table(both(model_dir, root, tools=True)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        _serve(sys.argv[2:])
    elif sys.argv[1:2] == ["report"]:
        _report()
    else:
        raise SystemExit("usage: test_segments_e2e.py report | serve --model DIR --port N")
