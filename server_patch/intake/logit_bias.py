"""``logit_bias`` checked against the model before it reaches the sampler.

Stock turns the keys into ints and hands the map to the sampler as it is: a key that is not a
number, a value that is not one, or a map that is not an object is a 500; an id past the
vocabulary indexes past the logits and the server process dies (a segfault in MLX, every
request in flight lost). What is accepted: an object of token ids (non-negative integers below
the vocabulary size) to finite numbers, OpenAI's shape; any bias size stays allowed, as in stock.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import HTTPException

class RequestRefused(HTTPException):
    """A 400 whose text is its detail alone, since mlx-vlm's handlers re-raise ``str(error)``."""

    def __init__(self, detail: str) -> None:
        super().__init__(status_code=400, detail=detail)

    def __str__(self) -> str:
        return str(self.detail)


def vocabulary_size(processor: Any, config: Any) -> int | None:
    """The logits' width: the text config's ``vocab_size``, else the tokenizer's length."""
    for source in (getattr(config, "text_config", None), config):
        size = getattr(source, "vocab_size", None) if source is not None else None
        if isinstance(source, dict):
            size = source.get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    tokenizer = getattr(processor, "tokenizer", processor)
    try:
        return len(tokenizer) if tokenizer is not None else None
    except TypeError:
        return None


def checked(logit_bias: Any, vocab: int | None) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: bias}``, or :class:`RequestRefused` saying what is wrong."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise RequestRefused("logit_bias must be an object mapping token ids to numbers")
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        text = str(key).strip()
        if not (text.isascii() and text.isdigit()):
            raise RequestRefused(f"logit_bias key {key!r} is not a token id (a non-negative integer)")
        token = int(text)
        if vocab is not None and token >= vocab:
            raise RequestRefused(f"logit_bias token id {token} is past the vocabulary ({vocab} tokens)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise RequestRefused(f"logit_bias value for token {token} must be a number, got {bias!r}")
        out[token] = float(bias)
    return out
