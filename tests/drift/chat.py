"""A word-level tokenizer and a ChatML-like renderer with the finder's boundary kinds, for the
drift tests (no model: the classifier works on token ids and a decoder)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from server_patch.boundaries.kinds import Kind

_PIECE = re.compile(r"<\|[a-z_]+\|>|</?\w+>|\s+|\w+|[^\w\s]")
GEN = "<|im_start|>assistant\n"


class WordTokenizer:
    """Each word, whitespace run, punctuation mark or special token is one id."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text: str) -> np.ndarray:
        out = []
        for piece in _PIECE.findall(text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
            out.append(self.ids[piece])
        return np.asarray(out, dtype=np.int32)

    def decode(self, ids: Any) -> str:
        return "".join(self.pieces[int(i)] for i in ids)


def render(tok: WordTokenizer, messages: list[dict[str, str]], tools: list[str] | None = None,
           gen: bool = True) -> tuple[np.ndarray, dict[int, str], int | None]:
    """Token ids, the boundaries the finder would give (each message's end but the last's,
    the tools preamble's end), and where the generation prompt starts."""
    parts: list[np.ndarray] = []
    kinds: dict[int, str] = {}
    at = 0

    def put(text: str) -> None:
        nonlocal at
        ids = tok.encode(text)
        parts.append(ids)
        at += len(ids)

    if tools:
        put("<tools>\n" + "\n".join(tools) + "\n</tools>\n")
        kinds[at] = Kind.TOOLS
    for i, m in enumerate(messages):
        put(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if i < len(messages) - 1:
            kinds[at] = Kind.SYSTEM if m["role"] == "system" else Kind.MESSAGE
    gen_start = None
    if gen:
        gen_start = at
        put(GEN)
    return np.concatenate(parts), kinds, gen_start
