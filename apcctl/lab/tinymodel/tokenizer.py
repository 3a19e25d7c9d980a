"""The tiny glm5_next model's WordPiece tokenizer over :func:`apcctl.lab.tinymodel.vocab.vocabulary`."""

from __future__ import annotations

from typing import Any

from apcctl.lab.tinymodel.vocab import CONTROL_TOKENS, MARKUP_TOKENS, SUBWORD_PREFIX, UNK_TOKEN, vocabulary


def build_tokenizer() -> Any:
    """A WordPiece ``tokenizers.Tokenizer`` with GLM's control and markup tokens.

    Whitespace separates pre-tokens and is dropped; punctuation and digits are one token
    each; decoding joins tokens with single spaces (``##`` pieces glue on). Unlike a
    byte-level BPE, the ids a random model samples from generatable tokens are the
    canonical encoding of their own text, which reply reuse needs end to end.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=UNK_TOKEN,
                                           continuing_subword_prefix=SUBWORD_PREFIX))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Punctuation("isolated"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tokenizer.decoder = decoders.WordPiece(prefix=SUBWORD_PREFIX, cleanup=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer
