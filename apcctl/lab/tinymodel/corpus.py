"""The fixed English-and-code word list and sentence shapes the tiny tokenizers are built from.

The words (``data/words.txt``) are the vocabulary's whole-word tokens; ``data/preamble_words.txt``
holds the words of the chat template's tools preamble, so it tokenizes to words, not letters;
``data/sentences.txt`` holds ``str.format`` shapes (prose, code, JSON, numbers) that
:func:`training_corpus` fills with words.
"""

from __future__ import annotations

import random

from apcctl.lab.tinymodel.datafiles import read_data

WORDS: tuple[str, ...] = tuple(read_data("words.txt").split())
PREAMBLE_WORDS: tuple[str, ...] = tuple(read_data("preamble_words.txt").split())
SENTENCES: tuple[str, ...] = tuple(read_data("sentences.txt").splitlines())


def training_corpus(lines: int = 4000) -> list[str]:
    """A fixed synthetic corpus: prose, code, JSON and numbers, independent of the seed."""
    rng = random.Random(20240607)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(5)]
        template = rng.choice(SENTENCES)
        out.append(template.format(*words, n=rng.randint(0, 9999), m=rng.randint(0, 99)))
    return out
