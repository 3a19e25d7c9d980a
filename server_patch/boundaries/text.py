"""Small text helpers of boundary finding: digests, common prefixes, roles, added tokens."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

SYSTEM_ROLES = ("system", "developer")


def text_digest(text: str) -> bytes:
    """The digest a render cache keeps instead of the text (verified against a later prompt)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def chain_digest(*parts: bytes | str) -> bytes:
    """One digest of several parts, separated so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part)
        h.update(b"\x1f")
    return h.digest()


def canonical(value: Any) -> str:
    """A stable text form of a message or kwargs, for cache keys."""
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        return repr(value)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_suffix(a: str, b: str) -> int:
    """Length of the longest common suffix of two strings."""
    return common_prefix(a[::-1], b[::-1])


def role_of(message: Any) -> str:
    if isinstance(message, dict):
        return str(message.get("role", ""))
    return str(getattr(message, "role", "user" if isinstance(message, str) else ""))


def leading_system_count(messages: Sequence[Any]) -> int:
    """How many messages at the start are system/developer ones."""
    count = 0
    for message in messages:
        if role_of(message) not in SYSTEM_ROLES:
            break
        count += 1
    return count


@dataclass(frozen=True)
class AddedTokens:
    """A tokenizer's added/special tokens: the pre-tokenizer splits on them, so BPE never merges
    across them (``ids``), and a boundary must never fall inside one (``texts``, longest first)."""

    ids: frozenset[int] = frozenset()
    texts: tuple[str, ...] = ()

    @classmethod
    def of(cls, tokenizer: Any) -> "AddedTokens":
        ids: set[int] = set()
        texts: set[str] = set()
        try:
            added = tokenizer.get_added_vocab()
            ids.update(int(i) for i in added.values())
            texts.update(str(t) for t in added if len(str(t)) > 1)
        except Exception:
            pass
        try:
            ids.update(int(i) for i in tokenizer.all_special_ids)
            texts.update(str(t) for t in tokenizer.all_special_tokens if len(str(t)) > 1)
        except Exception:
            pass
        return cls(frozenset(ids), tuple(sorted(texts, key=len, reverse=True)))

    def snap(self, cut: int, text: str) -> int:
        """``cut`` moved to the start of an added token whose text it would split (else unchanged).

        Where two renders part inside a special token (GLM's ``<|system|>`` against ``<|user|>``
        share ``<|``), the boundary belongs before the token.
        """
        for special in self.texts:
            start = text.rfind(special, max(0, cut - len(special) + 1), cut + len(special) - 1)
            if start != -1 and start < cut < start + len(special):
                return start
        return cut

    def touches(self, text: str, offset: int) -> bool:
        """Whether an added token ends at ``offset`` in ``text`` or starts there (a seam there
        splits no BPE merge)."""
        return any(text.startswith(t, offset) or text.endswith(t, 0, offset) for t in self.texts)

    def parting(self, a: str, b: str) -> int:
        """Where two renders part, never inside an added token."""
        return self.snap(common_prefix(a, b), a)


def encoder(tokenizer: Any):
    """``tokenizer.encode`` without special tokens, for tokenizers that take the flag or not."""
    def encode(text: str) -> list[int]:
        try:
            return tokenizer.encode(text, add_special_tokens=False)
        except TypeError:
            return tokenizer.encode(text)
    return encode
