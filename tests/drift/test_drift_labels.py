"""The finder's labels on Qwen3's real template (``apcctl/templates/qwen3.jinja``), offline: it
draws the last assistant message with empty ``<think>`` tags and the tools inside the system
turn, so a prefix render parts inside a message. Labels mark each message's real end and the
tools block for the drift finder; they are never restore points."""

from __future__ import annotations

from apcctl.lab.sim.tracegen_rendered import _Renderer
from server_patch.boundaries import Kind
from server_patch.boundaries.kinds import LABELS
from tests.drift.test_drift_numbering import A1, U1, U2, turns

TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a path", "parameters": {"type": "object"}}}
         for n in ("read_file", "run_shell")]


def render(messages, tools=None):
    renderer = _Renderer("qwen3.jinja", system_points=True)
    tokens, info = renderer.request(messages, tools or [])
    text = lambda a, b: renderer.tokenizer.decode([int(i) for i in tokens[a:b]])  # noqa: E731
    return tokens, info, text


def test_an_assistant_message_ends_where_the_next_header_starts() -> None:
    tokens, info, text = render(turns(U1, A1, U2))
    by_kind = {k: p for p, k in info.kinds.items()}
    parting, end = by_kind[Kind.PARTING], by_kind[Kind.REJOIN]
    assert text(parting, end).rstrip().endswith(A1 + "<|im_end|>")  # the whole reply, to its end token
    assert text(end, end + 3).startswith("<|im_start|>user")  # the next message starts there
    assert end not in info.segments and parting in info.segments  # a label; the parting stays a point


def test_a_reply_sent_back_with_its_reasoning_ends_where_the_next_header_starts() -> None:
    # qwen3 keeps the reasoning only in the last assistant turn: the prefix render has it, the
    # prompt (a user message after it) has the answer alone
    answer = "It exports parse and tokenize."
    tokens, info, text = render(turns(U1, "<think>\nLook at __all__ first.\n</think>\n\n" + answer, U2))
    end = next(p for p, k in info.kinds.items() if k == Kind.REJOIN)
    assert text(end - 3, end).startswith(".") and "Look at" not in text(0, len(tokens))
    assert text(end, end + 3).startswith("<|im_start|>user")


def test_the_tools_block_inside_the_system_turn_is_labelled() -> None:
    tokens, info, text = render(turns(U1), TOOLS)
    tools_end = next(p for p, k in info.kinds.items() if k == Kind.TOOLS_END)
    start = next(p for p, k in info.kinds.items() if k == Kind.SYSTEM_TEXT)
    block = text(start, tools_end)
    assert "<tools>" in block and "run_shell" in block and "numbering test" not in block
    assert "numbering test" in text(0, start)  # the system text is before the block
    assert text(tools_end, tools_end + 1) == "<|im_end|>"
    assert tools_end not in info.segments


def test_labels_are_never_among_the_segments() -> None:
    _, info, _ = render(turns(U1, A1, U2), TOOLS)
    labels = {p for p, k in info.kinds.items() if k in LABELS}
    assert labels and not labels & set(info.segments)
    assert set(info.segments) == {p for p, k in info.kinds.items() if k not in LABELS}
