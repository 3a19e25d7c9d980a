"""Segment boundaries: the template rendered on message prefixes, mapped onto the prompt's tokens.

Two real templates (the tiny model's GLM-style one through mlx-vlm's processor, and a
ChatML-style one through a fake tokenizer), templates that render only partly or not at all
piecewise (stride fallback), BPE merges across a seam (slack), a tokenizer that adds BOS, and
the caches (render and tokenization counts).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from mlx_vlm.prompt_utils import apply_chat_template

from server_patch.boundaries import BPE_SLACK, AnchorRegistry, Kind, SegmentFinder, SegmentInfo, SegmentSettings
from server_patch.integration import segments
from server_patch.lineage import SEGMENT, LineageCache, LineageConfig, SizedKV, SizedSnapshot
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

CONTENT, MESSAGE, PREAMBLE, STRIDE, SYSTEM, TOOL = (Kind.CONTENT, Kind.MESSAGE, Kind.TOOLS, Kind.STRIDE, Kind.SYSTEM,
                                                    Kind.TOOL)

# ----------------------------------------------------------------------------- a fake tokenizer

CHATML = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if not (m.role == 'system' and loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# No special tokens at all: every seam is plain text that BPE may merge across.
PLAIN = """{%- for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{%- if add_generation_prompt %}assistant:{% endif %}"""

# Renders the message count first: no prefix render is a prefix of the full prompt.
COUNTED = """Conversation of {{ messages | length }} messages.
{% for m in messages %}[{{ m.role }}] {{ m.content }}
{% endfor %}{%- if add_generation_prompt %}[assistant]{% endif %}"""

# Refuses to render a conversation that does not end with a user message.
USER_LAST = """{%- if messages[-1].role != 'user' %}{{ raise_exception('must end with a user turn') }}{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class FakeTokenizer:
    """Words, spaces and punctuation each one token; ``merges`` join across a seam; added tokens split first.

    ``apply_chat_template`` renders like transformers (a sandboxed jinja environment with
    ``tojson`` and ``raise_exception``) and counts its calls.
    """

    SPECIALS = ("<|bos|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, template: str, *, merges: tuple[str, ...] = (), bos: bool = False) -> None:
        self.chat_template = template
        self.merges = merges
        self.bos = bos
        self.renders = 0
        self.encodes = 0
        self.vocab: dict[str, int] = {s: i for i, s in enumerate(self.SPECIALS)}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v: json.dumps(v, sort_keys=True)
        env.globals["raise_exception"] = self._raise
        self._template = env.from_string(template)
        pattern = "|".join(re.escape(m) for m in sorted(merges, key=len, reverse=True))
        self._word = re.compile((pattern + "|" if pattern else "") + r"\w+|\s|[^\w\s]")

    @staticmethod
    def _raise(message: str) -> None:
        raise ValueError(message)

    def _id(self, piece: str) -> int:
        return self.vocab.setdefault(piece, len(self.vocab))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        ids = [0] if (self.bos and add_special_tokens) else []
        for part in re.split("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")", text):
            if part in self.SPECIALS:
                ids.append(self.vocab[part])
            elif part:
                ids.extend(self._id(tok) for tok in self._word.findall(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(inverse[i] for i in ids)

    def get_added_vocab(self) -> dict[str, int]:
        return {s: self.vocab[s] for s in self.SPECIALS}

    @property
    def all_special_ids(self) -> list[int]:
        return [0]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
        self.renders += 1
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **kwargs)


CONFIG = {"model_type": "fake_chatml"}  # not in mlx-vlm's MODEL_CONFIG: the text-only path


def render(finder: SegmentFinder, tok: FakeTokenizer, messages: list[dict], tools=None) -> np.ndarray:
    """One request as the server runs it: render (noted), then tokenize the whole text."""
    kwargs = {"tools": tools} if tools else {}
    text = apply_chat_template(tok, CONFIG, messages, **kwargs)
    finder.note(apply_chat_template, tok, CONFIG, messages, {"add_generation_prompt": True, **kwargs}, text)
    return np.asarray(tok.encode(text), dtype=np.int32)


def words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    pool = "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega".split()
    return " ".join(rng.choice(pool) for _ in range(n))


def tool(name: str, n: int) -> dict:
    return {"type": "function", "function": {"name": name, "description": words(n, sum(map(ord, name))),
                                             "parameters": {"type": "object", "properties": {}}}}


def position_of(tok: FakeTokenizer, ids: np.ndarray, text_before: str) -> int:
    """Token length of the prompt's prefix that decodes to ``text_before``."""
    for i in range(len(ids) + 1):
        if tok.decode(ids[:i].tolist()) == text_before:
            return i
    raise AssertionError(f"no token boundary after {text_before[-40:]!r}")


# ----------------------------------------------------------------------------- ChatML


def test_chatml_boundaries_are_the_message_starts_and_exact_at_special_tokens():
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    messages = [{"role": "system", "content": words(300, 1)},
                {"role": "user", "content": words(40, 2)},
                {"role": "assistant", "content": words(60, 3)},
                {"role": "user", "content": words(30, 4)}]
    tools = [tool("read_file", 80), tool("write_file", 90)]
    ids = render(finder, tok, messages, tools)
    info = finder.boundaries(ids)
    assert info.source == "template"
    text = tok.decode(ids.tolist())
    # Every message starts at <|im_start|>: each boundary is the token right before one. (Not
    # the generation prompt's: the end of the conversation is never a useful checkpoint.)
    starts = [m.start() for m in re.finditer(re.escape("<|im_start|>"), text)]
    expected = [position_of(tok, ids, text[:s]) for s in starts[1:-1]]
    assert [p for p in info.segments if info.kinds[p] in (SYSTEM, MESSAGE)] == expected
    assert info.kinds[expected[0]] == SYSTEM  # the system message (with its tools) ends there
    # The anchor is the system message + tools, exact: the next token is an added one.
    assert info.anchor_len == expected[0]
    assert info.anchor_label.startswith(messages[0]["content"][:20]) or "tools" in info.anchor_label


def test_chatml_a_tool_list_variant_diverges_inside_the_system_message_and_tool_boundaries_find_it():
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0, tool_boundaries=True))
    shared = [tool("read_file", 80), tool("write_file", 90)]
    messages = [{"role": "system", "content": words(50, 5)}, {"role": "user", "content": words(10, 6)}]
    ids_a = render(finder, tok, messages, shared + [tool("search", 70)])
    ids_b = render(finder, tok, messages, shared + [tool("browse", 70)])
    info_a = finder.boundaries(ids_a)
    tool_points = [p for p in info_a.segments if info_a.kinds[p] == TOOL]
    assert len(tool_points) == 3  # after each tool, the last one included
    shared_len = int(np.argmax(ids_a[: len(ids_b)] != ids_b[: len(ids_a)]))
    # The third tool differs in its description: the end of the second tool (minus the BPE
    # slack, the seam is plain text) is a few JSON tokens before the divergence.
    assert shared_len - 20 <= tool_points[1] < shared_len


# ----------------------------------------------------------------------------- fallbacks


def test_a_template_that_cannot_render_piecewise_falls_back_to_the_stride():
    tok = FakeTokenizer(COUNTED)
    finder = SegmentFinder(SegmentSettings(fallback_stride=64))
    messages = [{"role": "system", "content": words(120, 7)}, {"role": "user", "content": words(60, 8)}]
    ids = render(finder, tok, messages)
    info = finder.boundaries(ids)
    assert info.source == "fallback"
    assert info.segments == list(range(64, len(ids), 64))
    assert set(info.kinds.values()) == {STRIDE}
    assert finder.stats["fallback"] == 1


def test_a_template_that_renders_some_prefixes_keeps_those_boundaries():
    tok = FakeTokenizer(USER_LAST)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    messages = [{"role": "system", "content": words(100, 9)}, {"role": "user", "content": words(20, 10)},
                {"role": "assistant", "content": words(30, 11)}, {"role": "user", "content": words(20, 12)}]
    ids = render(finder, tok, messages)
    info = finder.boundaries(ids)
    text = tok.decode(ids.tolist())
    ends = [m.end() + 1 for m in re.finditer(re.escape("<|im_end|>"), text)]  # after "\n"
    # Prefixes ending with the system or assistant message fail; the first user end remains
    # (the last message's end is never rendered: it is the generation prompt's start).
    assert [p for p in info.segments if info.kinds[p] == MESSAGE] == [position_of(tok, ids, text[:ends[1]])]
    assert finder.stats["render_failures"] >= 2


def test_no_note_at_all_gives_the_stride_and_the_registered_anchor():
    finder = SegmentFinder(SegmentSettings(fallback_stride=100))
    info = finder.boundaries(np.arange(350))
    assert (info.segments, info.source) == ([100, 200, 300], "fallback")
    assert SegmentFinder(SegmentSettings(fallback_stride=0)).boundaries(np.arange(350)).segments == []


def test_disabled_finder_returns_no_segments():
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(enabled=False))
    ids = render(finder, tok, [{"role": "user", "content": words(30, 1)}])
    assert finder.boundaries(ids).segments == [] and len(finder) == 0


# ----------------------------------------------------------------------------- BPE


def test_seams_that_bpe_merges_are_placed_before_the_merge_with_slack():
    # "\nuser" and "\nassistant" are single tokens: BPE merges across every message seam.
    tok = FakeTokenizer(PLAIN, merges=("\nuser", "\nassistant"))
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    messages = [{"role": "system", "content": words(100, 13)}, {"role": "user", "content": words(50, 14)},
                {"role": "assistant", "content": words(50, 15)}, {"role": "user", "content": words(20, 16)}]
    ids = render(finder, tok, messages)
    info = finder.boundaries(ids)
    assert info.source == "template"
    text = tok.decode(ids.tolist())
    for start in [m.start() + 1 for m in re.finditer("\n(user|assistant)", text)][:-1]:
        # The seam token "\nuser" straddles the text boundary: the checkpoint sits before it,
        # BPE_SLACK tokens early (the slack keeps it valid for a prompt whose next text differs).
        exact_text_before = text[:start - 1]  # up to the end of the content, "\n" excluded
        limit = position_of(tok, ids, exact_text_before)
        assert any(limit - BPE_SLACK <= p <= limit for p in info.segments), (limit, info.segments)
    assert finder.stats["seam_merges"] >= 2


def test_soft_seams_without_merges_are_moved_by_the_slack_and_hard_ones_are_exact():
    tok = FakeTokenizer(PLAIN)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    messages = [{"role": "system", "content": words(40, 17)}, {"role": "user", "content": words(20, 18)}]
    ids = render(finder, tok, messages)
    info = finder.boundaries(ids)
    text = tok.decode(ids.tolist())
    cut = text.index("user:")
    assert info.segments[0] == position_of(tok, ids, text[:cut]) - BPE_SLACK
    # The same boundary on ChatML is next to <|im_start|>: exact.
    chat = FakeTokenizer(CHATML)
    ids = render(finder, chat, messages)
    text = chat.decode(ids.tolist())
    cut = text.index("<|im_start|>user")
    info = finder.boundaries(ids)
    assert [p for p in info.segments if info.kinds[p] == SYSTEM] == [position_of(chat, ids, text[:cut])]


def test_a_tokenizer_that_adds_bos_shifts_every_boundary_by_one():
    plain, bos = FakeTokenizer(CHATML), FakeTokenizer(CHATML, bos=True)
    messages = [{"role": "system", "content": words(60, 19)}, {"role": "user", "content": words(20, 20)}]
    a, b = SegmentFinder(SegmentSettings(fallback_stride=0)), SegmentFinder(SegmentSettings(fallback_stride=0))
    ids_plain = render(a, plain, messages)
    ids_bos = render(b, bos, messages)
    assert ids_bos[0] == 0 and np.array_equal(ids_bos[1:], ids_plain)
    info_plain, info_bos = a.boundaries(ids_plain), b.boundaries(ids_bos)
    assert info_bos.segments == [p + 1 for p in info_plain.segments]
    assert info_bos.anchor_len == info_plain.anchor_len + 1


# ----------------------------------------------------------------------------- caching


def test_a_conversation_renders_only_its_new_messages_and_tokenizes_only_new_text():
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    messages = [{"role": "system", "content": words(200, 21)}, {"role": "user", "content": words(20, 22)}]
    tools = [tool("read_file", 80)]
    render(finder, tok, messages, tools)
    for turn in range(10):
        messages = messages + [{"role": "assistant", "content": words(40, 100 + turn)},
                               {"role": "user", "content": words(15, 200 + turn)}]
        tok.renders = tok.encodes = 0
        ids = render(finder, tok, messages, tools)
        # 1 full render by the server + 1 new prefix (the new question's start). The probe and
        # older prefixes are cached; the previous prompt's end (the reply's start) is skipped:
        # its entry sits there.
        assert tok.renders == 2, turn
        # the server's own encode + the new reply and the new question with the generation prompt
        assert tok.encodes == 3, turn
        info = finder.boundaries(ids)
        assert len([p for p in info.segments if info.kinds[p] == MESSAGE]) == turn + 1
    assert finder.stats["matched_exact"] == 10
    # A resend of the same conversation renders nothing new (only the server's own render).
    tok.renders = 0
    render(finder, tok, messages, tools)
    assert tok.renders == 1


def test_render_budget_keeps_the_anchor_and_the_newest_prefixes():
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0, max_new_renders=4))
    messages = [{"role": "system", "content": words(50, 23)}]
    for i in range(20):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": words(10, 300 + i)})
    tok.renders = 0
    ids = render(finder, tok, messages)
    assert tok.renders <= 1 + 4 + 2  # the server's render, the budget, the 2-render probe
    info = finder.boundaries(ids)
    assert info.anchor_len is not None and info.kinds[info.anchor_len] == SYSTEM
    assert finder.stats["render_skipped"] > 0


def test_a_prompt_without_its_own_note_uses_a_siblings_shared_boundaries():
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=32))
    system = {"role": "system", "content": words(200, 24)}
    render(finder, tok, [system, {"role": "user", "content": words(30, 25)}])
    other = np.asarray(tok.encode(apply_chat_template(tok, CONFIG, [system, {"role": "user",
                                                                               "content": words(90, 26)}])))
    info = finder.boundaries(other)  # never noted (say, the server changed the text after rendering)
    assert info.anchor_len is not None and info.kinds[info.anchor_len] == SYSTEM
    beyond = [p for p in info.segments if p > info.anchor_len + 5]
    assert beyond and all(info.kinds[p] == STRIDE for p in beyond)


# ----------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def tiny_processor(tmp_path_factory: pytest.TempPathFactory):
    from mlx_vlm import load

    from apcctl.lab.tinymodel.build import build_model

    model, processor = load(str(build_model(tmp_path_factory.mktemp("seg") / "tiny", "tiny", seed=0)))
    return model.config, processor


TINY_TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": " ".join(["Search the cache for a prefix."] * 8),
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}} for i in range(4)]


def test_tiny_glm_template_tools_end_system_end_and_message_starts(tiny_processor):
    config, processor = tiny_processor
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    tok = processor.tokenizer
    messages = [{"role": "system", "content": "You are terse. " * 40},
                {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "sure thing " * 10},
                {"role": "user", "content": "and more"}]
    text = apply_chat_template(processor, config, messages, tools=TINY_TOOLS)
    finder.note(apply_chat_template, processor, config, messages,
                {"add_generation_prompt": True, "tools": TINY_TOOLS}, text)
    ids = np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int32)
    info = finder.boundaries(ids)
    role = {tok.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|assistant|>")}
    # GLM renders the tools block first. transformers refuses to render the tools with no
    # message, so the tools end is where renders of the first message with another role part
    # (right before <|system|>, not inside it), and the content start where renders with
    # another content part (right after it).
    tools_end = [p for p in info.segments if info.kinds[p] == PREAMBLE]
    content = [p for p in info.segments if info.kinds[p] == CONTENT]
    assert len(tools_end) == 1 and ids[tools_end[0]] == tok.convert_tokens_to_ids("<|system|>")
    assert tok.decode(ids[:tools_end[0]].tolist()).endswith("</tool_call>")
    assert content == [tools_end[0] + 1]
    # System end and every message start: right before a role token, exact.
    others = [p for p in info.segments if info.kinds[p] in (SYSTEM, MESSAGE)]
    assert all(int(ids[p]) in role for p in others)
    assert len(others) == len(messages) - 1  # not the generation prompt's start
    assert info.kinds[others[0]] == SYSTEM and info.anchor_len == others[0]
    # The anchors registry agrees with the anchor (no slack before <|user|>).
    registry = AnchorRegistry()
    prefix = apply_chat_template(processor, config, messages[:1], add_generation_prompt=False, tools=TINY_TOOLS)
    registry.note(prefix, lambda t: tok.encode(t, add_special_tokens=False), "x", finder.hard_ids(tok))
    assert registry.boundary(ids)[0] == info.anchor_len


def test_tiny_wrapper_notes_segments_and_the_coordinator_entry_point_finds_them(tiny_processor):
    config, processor = tiny_processor
    finder = SegmentFinder(SegmentSettings())
    wrapped = segments.wrap_apply_chat_template(apply_chat_template, finder)
    messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "hi"}]
    text = wrapped(processor, config, messages, tools=TINY_TOOLS)
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    info = segments.boundaries(ids, finder)
    assert isinstance(info, SegmentInfo) and info.source == "template" and len(finder) == 1
    assert info.anchor_len is not None and info.anchor_label.startswith("Be brief.")


# ----------------------------------------------------------------------------- with the policy


def test_segments_feed_plan_captures_as_segment_checkpoints_that_thin_first():
    """The coordinator's call, on the policy: captures ≥ the gap, thinned first, budgeted."""
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0, max_new_renders=0))
    messages = [{"role": "system", "content": words(400, 30)}]
    for i in range(12):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": words(140, 400 + i)})
    ids = render(finder, tok, messages)
    info = finder.boundaries(ids)
    cache = LineageCache(LineageConfig(periodic_stride=0, segment_min_gap=256, max_checkpoints=4))
    plan = cache.lookup(ids)
    caps = cache.plan_captures(ids, plan, anchor_len=info.anchor_len, segments=info.segments)
    seg = [c.length for c in caps if c.kind == SEGMENT]
    assert len(seg) >= 4
    assert all(b - a >= 256 for a, b in zip([0, *seg], seg))
    entry = cache.commit(ids, kv=SizedKV(10, len(ids) - 1), head=SizedSnapshot(100),
                         captures={c.length: (c.kind, SizedSnapshot(100)) for c in caps})
    assert len(entry.checkpoints) <= 4
    kept = [c.length for c in entry.checkpoints if c.kind == SEGMENT]
    assert kept == sorted(seg)[: len(kept)]  # latest segments are thinned first
    # Across lineages: another conversation sharing the first 5 messages restores at a segment.
    other = messages[:5] + [{"role": "user", "content": words(50, 999)}]
    other_ids = np.asarray(tok.encode(apply_chat_template(tok, CONFIG, other)), dtype=np.int32)
    restored = cache.lookup(other_ids)
    assert restored.kind == SEGMENT and restored.entry is entry
    assert restored.length == max(p for p in kept if p <= restored.shared)


def test_a_short_trailing_system_message_stays_out_of_the_anchor():
    """The time in its own system message: the anchor ends before it, shared by every minute."""
    tok = FakeTokenizer(USER_LAST.replace("{%- if messages[-1].role != 'user' %}{{ raise_exception('must end with a user turn') }}{% endif %}\n", ""))
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    system = {"role": "system", "content": words(400, 40)}
    ids = {}
    for minute in ("09:41", "09:42"):
        messages = [system, {"role": "system", "content": f"Current time: 2026-11-30 {minute}"},
                    {"role": "user", "content": words(20, 41)}]
        ids[minute] = render(finder, tok, messages)
    infos = {m: finder.boundaries(v) for m, v in ids.items()}
    a, b = infos["09:41"], infos["09:42"]
    assert a.anchor_len == b.anchor_len  # the same anchor every minute
    ends = [p for p in a.segments if a.kinds[p] == SYSTEM]
    assert len(ends) == 2 and a.anchor_len == ends[0]
    assert np.array_equal(ids["09:41"][:a.anchor_len], ids["09:42"][:a.anchor_len])
    # A long second system message is part of the anchor.
    finder = SegmentFinder(SegmentSettings(fallback_stride=0, anchor_tail_tokens=4))
    info = finder.boundaries(render(finder, tok, [system, {"role": "system", "content": words(30, 42)},
                                                  {"role": "user", "content": words(20, 43)}]))
    assert info.anchor_len == max(p for p in info.segments if info.kinds[p] == SYSTEM)


def test_admin_views_show_segment_checkpoints_as_their_own_kind():
    from server_patch.admin.views import entry_view

    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0, max_new_renders=0))
    messages = [{"role": "system", "content": words(300, 50)}]
    for i in range(6):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": words(300, 500 + i)})
    ids = render(finder, tok, messages)
    info = finder.boundaries(ids)
    cache = LineageCache(LineageConfig(periodic_stride=0))
    caps = cache.plan_captures(ids, cache.lookup(ids), anchor_len=info.anchor_len, segments=info.segments)
    entry = cache.commit(ids, kv=SizedKV(10, len(ids) - 1), head=SizedSnapshot(100),
                         captures={c.length: (c.kind, SizedSnapshot(100)) for c in caps})
    view = entry_view(entry)
    assert "segment" in {c["kind"] for c in view["checkpoints"]}
    anchor = next(e for e in cache.entries() if e.is_anchor)
    assert {c["kind"] for c in entry_view(anchor)["checkpoints"]} <= {"segment"}


def test_system_paragraph_breaks_and_a_merged_clock_paragraph_out_of_the_anchor():
    """mlx-vlm joins system messages with "\\n\\n": the last breaks are segments, and a short last
    paragraph (the time) stays out of the anchor, so every minute shares it."""
    tok = FakeTokenizer(CHATML)
    finder = SegmentFinder(SegmentSettings(fallback_stride=0))
    body = "\n\n".join(words(150, 60 + k) for k in range(4))
    infos, ids = {}, {}
    for minute in ("09:41", "09:42"):
        messages = [{"role": "system", "content": body + f"\n\nCurrent time: 2026-11-30 {minute}"},
                    {"role": "user", "content": words(20, 61)}]
        ids[minute] = render(finder, tok, messages)
        infos[minute] = finder.boundaries(ids[minute])
    a = infos["09:41"]
    paragraphs = [p for p in a.segments if a.kinds[p] == "paragraph"]
    text = tok.decode(ids["09:41"].tolist())
    starts = [m.end() for m in re.finditer("\n\n", text)]
    expected = [position_of(tok, ids["09:41"], text[:s]) - BPE_SLACK for s in starts[-2:]]
    assert paragraphs == expected  # the last two breaks, 2 tokens early (plain text)
    assert a.anchor_len == expected[-1] == infos["09:42"].anchor_len
    # all of them
    every = SegmentFinder(SegmentSettings(fallback_stride=0, system_paragraphs=-1))
    info = every.boundaries(render(every, tok, [{"role": "system", "content": body},
                                                {"role": "user", "content": words(20, 62)}]))
    assert len([p for p in info.segments if info.kinds[p] == "paragraph"]) == 3


def test_settings_from_the_environment():
    s = SegmentSettings.from_env({"APC_SEGMENTS_TOOLS": "1", "APC_SEGMENTS_SYSTEM_PARAGRAPHS": "-1",
                                  "APC_SEGMENTS_FALLBACK_STRIDE": "0", "APC_SEGMENTS_ANCHOR_TAIL": "128"})
    assert (s.tool_boundaries, s.system_paragraphs, s.fallback_stride, s.anchor_tail_tokens) == (True, -1, 0, 128)
    assert not SegmentSettings.from_env({"APC_SEGMENTS": "0"}).enabled
    with pytest.raises(ValueError, match="APC_SEGMENTS_TOOLS"):
        SegmentSettings.from_env({"APC_SEGMENTS_TOOLS": "maybe"})
    with pytest.raises(ValueError, match="APC_SEGMENTS_FALLBACK_STRIDE"):
        SegmentSettings.from_env({"APC_SEGMENTS_FALLBACK_STRIDE": "-5"})
