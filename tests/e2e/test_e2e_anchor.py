"""End to end: new sessions land on the anchor, system-prompt variants reuse their siblings,
and no request ever reuses fewer tokens than stock mlx-vlm given the same requests.

The same sequence of requests goes to a patched server and to a stock one (``APC_LINEAGE=0``,
``APC_ENABLED=1``), under two configurations: the defaults, and a 256-token periodic stride
(``APC_LINEAGE_PERIODIC_STRIDE`` for the lineage cache, ``APC_CHECKPOINT_INTERVAL_TOKENS``
for stock's exact mode), so that stock's periodic checkpoints exist on the tiny model too and
a variant's first session is served from one by both.

The sequence: two turns of a session with system prompt S1 and tools; a second S1 session;
S2 = S1 with 4 words changed near its end (first and second session, then a second turn);
S3 = S1 with the same 4 words changed differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import PatchedServer, fed_tokens, text, words

TENANT = "anchor-suite"
# With the tools block (~410 tokens) the system + tools prefix is ~850 tokens, so with a
# 256-token stride the last periodic checkpoint (768) lies before the variants' changed words, and
# the tools block's end (a segment point) lies more than the 256-token segment gap before the
# anchor. (It was 690 words, ~1100 tokens: one stride more of the same text, no other case.)
SYSTEM_WORDS = 434
CHANGED = slice(SYSTEM_WORDS - 8, SYSTEM_WORDS - 4)  # 4 words near the end of the system text
TOOLS = [
    {"type": "function", "function": {
        "name": "search_cache", "description": "Search the prompt cache for a prefix.",
        "parameters": {"type": "object", "properties": {
            "prefix": {"type": "string", "description": "Token prefix."},
            "limit": {"type": "integer", "description": "How many entries."}},
            "required": ["prefix"]}}},
    {"type": "function", "function": {
        "name": "evict_entry", "description": "Evict one lineage entry.",
        "parameters": {"type": "object", "properties": {
            "entry_id": {"type": "string"}}, "required": ["entry_id"]}}},
]

CONFIGS = {
    "default": {},
    # A lower divergence gain, so that a variant restored at a periodic checkpoint still
    # leaves a divergence checkpoint at its changed words.
    "periodic256": {"APC_LINEAGE_PERIODIC_STRIDE": "256", "APC_CHECKPOINT_INTERVAL_TOKENS": "256",
                    "APC_LINEAGE_DIVERGENCE_MIN_GAIN": "32"},
}


def _system(replacement: list[str] | None) -> str:
    body = words(SYSTEM_WORDS, 101)
    if replacement is not None:
        body[CHANGED] = replacement
    return " ".join(body)


S1 = _system(None)
S2 = _system(["apple", "banana", "orange", "water"])
S3 = _system(["river", "mountain", "forest", "ocean"])


@dataclass
class Step:
    name: str
    lineage: dict[str, Any]
    stock: dict[str, Any]
    line: dict[str, str]

    @property
    def cached(self) -> int:
        return int(self.lineage["usage"]["prompt_tokens_details"]["cached_tokens"])

    @property
    def stock_cached(self) -> int:
        return int(self.stock["usage"]["prompt_tokens_details"]["cached_tokens"])

    @property
    def prompt(self) -> int:
        return int(self.lineage["usage"]["prompt_tokens"])

    @property
    def fed(self) -> int:
        return fed_tokens(self.lineage)


@dataclass
class Run:
    config: str
    steps: dict[str, Step] = field(default_factory=dict)
    anchors: list[dict] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)


def _session(system: str, user_seed: int) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": text(60, user_seed)}]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request: pytest.FixtureRequest, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Run:
    config = request.param
    log_dir = tmp_path_factory.mktemp(f"e2e-anchor-{config}")
    lineage = PatchedServer(tiny_model_dir, env=CONFIGS[config], log_dir=log_dir)
    stock = PatchedServer(tiny_model_dir, env={**CONFIGS[config], "APC_LINEAGE": "0"}, log_dir=log_dir)
    result = Run(config)
    try:
        lineage.start()
        stock.start()

        def send(name: str, messages: list[dict]) -> dict[str, Any]:
            before = len(lineage.lineage_lines("restore"))
            answer = lineage.chat(messages, tenant=TENANT, tools=TOOLS, max_tokens=4)
            lines = lineage.lineage_lines("restore")
            assert len(lines) == before + 1, lineage.log_tail()
            reference = stock.chat(messages, tenant=TENANT, tools=TOOLS, max_tokens=4)
            result.steps[name] = Step(name, answer, reference, lines[-1])
            return answer

        s1a = _session(S1, 1)
        first = send("s1_session1", s1a)
        send("s1_session1_turn2", s1a + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"] or "."},
            {"role": "user", "content": text(40, 2)}])
        send("s1_session2", _session(S1, 3))
        s2a = _session(S2, 4)
        s2_first = send("s2_session1", s2a)
        send("s2_session2", _session(S2, 5))
        send("s2_session1_turn2", s2a + [
            {"role": "assistant", "content": s2_first["choices"][0]["message"]["content"] or "."},
            {"role": "user", "content": text(40, 6)}])
        send("s3_session1", _session(S3, 7))
        send("s1_session3", _session(S1, 8))

        status, body = lineage.admin("GET", "/anchors")
        assert status == 200, body
        result.anchors = body["anchors"]
        status, body = lineage.admin("GET", "/entries")
        assert status == 200, body
        result.entries = body["entries"]
    finally:
        lineage.stop()
        stock.stop()
    return result


def _divergence_length(run: Run) -> int:
    lengths = {c["length"] for e in run.entries for c in e["checkpoints"] if c["kind"] == "divergence"}
    assert len(lengths) == 1, run.entries
    return lengths.pop()


@pytest.mark.server
def test_never_fewer_cached_tokens_than_stock(run: Run) -> None:
    table = [(s.name, s.line["kind"], s.cached, s.stock_cached) for s in run.steps.values()]
    for step in run.steps.values():
        assert step.lineage["usage"]["prompt_tokens"] == step.stock["usage"]["prompt_tokens"]
        assert step.cached >= step.stock_cached, table


@pytest.mark.server
def test_new_session_with_same_system_and_tools_lands_on_the_anchor(run: Run) -> None:
    s1_anchor = [a for a in run.anchors if a["length"] < run.steps["s1_session1"].prompt
                 and a["kind"] == "anchor"]
    assert s1_anchor, run.anchors
    for name in ("s1_session2", "s1_session3"):
        step = run.steps[name]
        assert step.line["kind"] == "anchor", (name, step.line)
        assert step.cached in {a["length"] for a in run.anchors}
        # The anchor is the system + tools prefix: everything but the user turn (60 words)
        # and the chat template's few tokens around it.
        assert step.prompt - 80 <= step.cached < step.prompt - 60, (step.prompt, step.cached)


@pytest.mark.server
def test_system_prompt_variant_reuses_nearly_all_of_its_prefix(run: Run) -> None:
    first = run.steps["s2_session1"]
    second = run.steps["s2_session2"]
    anchor_len = run.steps["s1_session2"].cached
    # Second session of the variant: nearly all of the variant's own system + tools prefix.
    assert second.line["kind"] in ("anchor", "divergence"), second.line
    assert second.cached >= anchor_len - 2, (second.cached, anchor_len)
    # Its first session: the best earlier restore point, never worse than stock.
    assert first.cached >= first.stock_cached
    divergence = _divergence_length(run)
    if run.config == "periodic256":
        # Both caches hold a checkpoint at 768, before the changed words.
        assert first.line["kind"] == "periodic", first.line
        assert first.cached == (divergence // 256) * 256 == first.stock_cached, (first.line, divergence)
    else:
        # Stock has nothing before the changed words; lineage restores at a chat-template
        # segment boundary (the end of the tools block) that an earlier session left.
        assert first.stock_cached == 0 and first.line["kind"] == "segment", first.line
        assert 0 < first.cached < divergence, (first.line, divergence)
    # The divergence checkpoint the first session left: at the first changed token,
    # 4 words from the end of the system text.
    assert anchor_len - 12 <= divergence < anchor_len, (divergence, anchor_len)
    # A third variant, changed at the same words, restores there.
    third = run.steps["s3_session1"]
    assert third.line["kind"] == "divergence", third.line
    assert third.cached == divergence
    turn2 = run.steps["s2_session1_turn2"]
    # The next turn re-sends the reply verbatim: it restores past it (reply reuse).
    assert turn2.line["kind"] == "entry" and turn2.cached == first.fed, (turn2.cached, first.prompt)
