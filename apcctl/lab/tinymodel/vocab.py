"""The tiny glm5_next model's tokens, in id order, and which of them the model may sample.

Replies must round-trip like a real GLM-4.5's (reply reuse, issue 13): a reply re-sent as
``content`` re-renders as the sampled ids, so the model only samples :func:`generatable` tokens.
"""

from __future__ import annotations

from apcctl.lab.tinymodel.corpus import PREAMBLE_WORDS, WORDS

UNK_TOKEN = "[UNK]"  # a word with a character the vocabulary lacks
# Special (control) tokens get ids 0..n-1 in this order and are skipped when decoding.
CONTROL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|image|>",
    "<|begin_of_video|>", "<|end_of_video|>", "<|video|>", UNK_TOKEN,
)
# Markup the server's parsers must see in decoded text, so not "special".
MARKUP_TOKENS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
SUBWORD_PREFIX = "##"


def _characters() -> list[str]:
    """Printable ASCII, Latin-1 and Latin Extended-A/B, Greek; no whitespace (never a token)."""
    codes = [*range(0x21, 0x7F), *range(0xA1, 0x250), *range(0x391, 0x3CA)]
    return [c for c in map(chr, codes) if c.isprintable() and not c.isspace()]


def vocabulary() -> list[str]:
    """Every token in id order: control, markup, whole words, characters, word continuations.

    A word is a single pre-token (letters only), so it encodes to its own id; a word not in
    the list is spelled from a character and ``##`` continuations (WordPiece's longest match).
    """
    words = [*WORDS, *(w.capitalize() for w in WORDS), *PREAMBLE_WORDS]
    assert all(w.isascii() and w.isalpha() for w in words)
    chars = _characters()
    pieces = [*CONTROL_TOKENS, *MARKUP_TOKENS, *words, *chars, *(SUBWORD_PREFIX + c for c in chars)]
    return list(dict.fromkeys(pieces))


def generatable(token: str) -> bool:
    """Whether the model may sample ``token``: a whole word, an ASCII character, an EOS token.

    Each such token decodes to itself between single spaces and re-encodes to the same id, so
    any sequence of them survives decode -> re-encode (a client re-sends text, not ids). A
    ``##`` continuation would glue onto the word before it; control and markup tokens would
    steer the server's parsers. Other characters would round-trip too; they are left out so
    replies read as words.
    """
    if token in EOS_TOKENS:
        return True
    if token in CONTROL_TOKENS or token in MARKUP_TOKENS or token.startswith(SUBWORD_PREFIX):
        return False
    return token.isascii()
