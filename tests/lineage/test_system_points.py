"""Points inside a long system message where its text is structured (``boundaries.system_points``).

Units: line kinds, the breaks found in a text, the token-space thinning (one point per gap
window from the end, a section or heading start preferred). Then the finder on a system-first
template (ChatML with the tools after the system text, as Qwen3 renders them) through the
lineage policy: a variant whose last line differs restores at its own section's start, inside
the system text, where before it restored at the 2048 stride. And the
replay of a trace rendered with the real Qwen3 template (``apcctl bench trace-gen --template``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from server_patch.boundaries import Kind, SegmentFinder, SegmentSettings
from server_patch.boundaries.system_points import (
    POINT_GAP, add_points, line_kind, structured_breaks, thin,
)
from server_patch.lineage import LineageCache, LineageConfig, SizedKV, SizedSnapshot
from tests.lineage.test_segments import CHATML, FakeTokenizer, render, words
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb


def test_line_kinds():
    assert line_kind("# Rules") == Kind.HEADING and line_kind("### Style") == Kind.HEADING
    assert line_kind("<env>") == Kind.SECTION and line_kind('  <rules priority="1">') == Kind.SECTION
    assert line_kind("</env>") == Kind.LINE  # a closing tag ends a section; its start is a line
    assert line_kind("#hashtag") == Kind.LINE and line_kind("- a rule") == Kind.LINE


def test_breaks_keep_every_heading_and_section_and_space_plain_lines():
    lines = ["intro"] + ["- " + "x" * 50] * 20 + ["# Tail", "<env>", "cwd: /w", "</env>", "Today."]
    content = "\n".join(lines)
    found = structured_breaks(content)
    kinds = {content[o:].split("\n", 1)[0]: k for o, k in found.items()}
    assert kinds["# Tail"] == Kind.HEADING and kinds["<env>"] == Kind.SECTION and kinds["Today."] == Kind.LINE
    plain = sorted(o for o, k in found.items() if k == Kind.LINE)
    assert all(b - a >= 256 for a, b in zip(plain, plain[1:]))
    assert 0 not in found and "\n\n" not in content
    # Lines after a paragraph break are paragraph points, not line points.
    assert structured_breaks("first line here\n\nsecond paragraph\nthird line") == {
        len("first line here\n\nsecond paragraph\n"): Kind.LINE}


def test_thin_takes_one_point_per_gap_window_from_the_end_preferring_sections():
    kinds = {10: Kind.TOOLS, 400: Kind.LINE, 700: Kind.HEADING, 900: Kind.LINE, 1500: Kind.LINE,
             1800: Kind.SECTION, 1900: Kind.LINE, 1950: Kind.SYSTEM_TEXT, 3000: Kind.SYSTEM}
    kept = thin(kinds, keep=2)
    # 1900's window [1645, 1900] holds the <section> at 1800: that wins; then 1500 (the latest
    # left at least a gap before 1800); 1950 (system_text) stays for the policy to arbitrate.
    assert sorted(kept) == [10, 1500, 1800, 1950, 3000]
    assert sorted(p for p, k in thin(kinds, keep=-1).items() if k in (Kind.LINE, Kind.HEADING, Kind.SECTION)) \
        == [400, 700, 1500, 1800]  # 900's window holds the heading at 700
    assert not [p for p, k in thin(kinds, keep=0).items() if k == Kind.LINE]
    # A point closer than the gap to another boundary is never offered (the policy would drop it).
    assert 2900 not in thin({**kinds, 2900: Kind.LINE}, keep=3)


def test_add_points_marks_the_system_text_end_and_an_anchor_candidate():
    system = "\n".join(["You are an agent."] + [f"- rule {i} " + "y" * 40 for i in range(10)] + ["<env>", "x", "</env>", "Today."])
    full = f"<|im_start|>system\n{system}\n\n# Tools\n<tools>...</tools><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    offsets = {len(full) - 20: Kind.SYSTEM}
    anchors = add_points([{"role": "system", "content": system}], full, offsets, 2, [len(full) - 20])
    end = full.index(system) + len(system)
    assert offsets[end] == Kind.SYSTEM_TEXT  # Qwen3's "\n\n# Tools" follows: a sub-agent's point
    env = full.index("<env>")
    assert offsets[env] == Kind.SECTION and env in anchors  # the tail section: the anchor may end there
    assert add_points([{"role": "system", "content": system}], full, {}, 0, [1]) == [1]  # off


def _policy_run(finder: SegmentFinder, tok: FakeTokenizer, first: list, second: list) -> tuple[int, int]:
    """``first`` prefilled and committed; what ``second`` restores, and how much it shares."""
    cache = LineageCache(LineageConfig())
    ids = render(finder, tok, first, tools=TOOLS)
    info = finder.boundaries(ids)
    caps = cache.plan_captures(ids, cache.lookup(ids), anchor_len=info.anchor_len, segments=info.segments)
    cache.commit(ids, kv=SizedKV(10, len(ids) - 1), head=SizedSnapshot(100),
                 captures={c.length: (c.kind, SizedSnapshot(100)) for c in caps})
    other = render(finder, tok, second, tools=TOOLS)
    shared = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
    return cache.lookup(other).length, shared


TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": words(120, 300 + i)}}
         for i in range(4)]


def _system(date: str) -> str:
    lines = ["You are a coding agent."] + [f"- {words(30, 400 + i)}" for i in range(40)]
    return "\n".join(lines + ["<env>", "Working directory: /work/project", "Git status: clean", "</env>",
                              f"Today is {date}."])


@pytest.mark.parametrize("points", [False, True])
def test_a_system_first_variant_restores_at_its_own_section_start(points):
    """ChatML with the tools after the system text (Qwen3's layout): a changed last line
    diverges before the tools block. Without system points only the 2048 stride is a restore
    point inside the system text; with them the variant restores at its ``<env>`` section's start."""
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(replace(SegmentSettings(fallback_stride=0), system_points=points))
    first = [{"role": "system", "content": _system("Tuesday")}, {"role": "user", "content": words(20, 1)}]
    second = [{"role": "system", "content": _system("Wednesday")}, {"role": "user", "content": words(20, 2)}]
    restored, shared = _policy_run(finder, tok, first, second)
    text = tok.decode(render(finder, tok, first, tools=TOOLS).tolist())
    section = len(tok.encode(text[:text.index("<env>")]))
    assert shared > section > 2 * POINT_GAP
    if points:
        assert section - 2 <= restored <= shared  # the section's start (2 tokens of BPE slack)
    else:
        # No break inside the system text: the periodic stride only, far from the change.
        assert restored % 2048 == 0 and shared - restored > POINT_GAP, (restored, shared)


def test_the_rendered_qwen3_trace_restores_more_with_system_points():
    """``apcctl bench trace-gen --template qwen3.jinja`` (with and without system points),
    replayed through the lineage policy: the late variants' first requests restore inside the
    system text, and the whole trace needs fewer prefill tokens."""
    from apcctl.lab.sim.replay import replay_policy
    from apcctl.lab.sim.sizes import load_sizes
    from apcctl.lab.sim.tracegen_rendered import generate

    sizes = load_sizes("tiny")
    runs, firsts = {}, {}
    for points in (False, True):
        requests, _ = generate(sessions=2, turns=(2, 2), system_points=points)
        runs[points] = replay_policy("lineage", requests, sizes)
        firsts[points] = {}  # agent -> what its first request restored, in order of first sight
        for i, req in enumerate(requests):
            firsts[points].setdefault(req.agent, runs[points].reused[i])
    variants = [a for a in firsts[True] if a != "coder"]
    # The first variant seen diverges where nothing is stored yet: before, only the template's
    # first tokens (later variants reuse the divergence checkpoint it left); after, its section.
    assert firsts[False][variants[0]] < 8
    assert all(firsts[True][a] > 900 for a in variants), firsts[True]
    assert runs[True].prefill_tokens < runs[False].prefill_tokens


def test_trace_gen_renders_with_a_template_and_refuses_an_unknown_one(tmp_path):
    from click.testing import CliRunner

    from apcctl.cli import main
    from apcctl.lab.sim.trace import read_trace

    out = tmp_path / "qwen3.jsonl"
    result = CliRunner().invoke(main, ["bench", "trace-gen", str(out), "--template", "qwen3.jinja"])
    assert result.exit_code == 0, result.output
    trace = read_trace(out)
    assert trace.meta["template"] == "qwen3.jinja" and trace.meta["system_points"] is True
    assert all(r.segments and r.anchor_len for r in trace.requests)
    bad = CliRunner().invoke(main, ["bench", "trace-gen", str(tmp_path / "x.jsonl"), "--template", "nope.jinja"])
    assert bad.exit_code != 0 and "qwen3.jinja" in bad.output
