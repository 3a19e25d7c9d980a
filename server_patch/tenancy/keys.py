"""Inference API keys (``APC_API_KEYS``, ``APC_API_KEY_FILE``): who may call inference routes.

As vLLM's ``--api-key`` and llama-server's ``--api-key``/``--api-key-file``: with keys
configured, a request must carry one as ``Authorization: Bearer <key>`` (or Anthropic's
``x-api-key: <key>``), and each key is its own cache namespace, so two keys never share an
entry. A configured but empty key list (a blank variable, a file with no key) stops the server:
it would let anyone in. Keys are compared in constant time (``infra.auth.token_matches``) and
never logged or stored; a namespace holds :func:`namespace.key_identity` of the key.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from server_patch import settings
from server_patch.infra.auth import ASCII_WHITESPACE, TokenError, tighten, token_matches, validated
from server_patch.tenancy.namespace import key_identity

KEYS_ENV = "APC_API_KEYS"
KEY_FILE_ENV = "APC_API_KEY_FILE"
MLX_VLM_KEY_ENV = "MLX_VLM_SERVER_API_KEY"  # mlx-vlm's own single key, checked by its handlers


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys, as bytes; ``upstream``: mlx-vlm's own key, which its handlers still check."""

    keys: tuple[bytes, ...]
    upstream: bytes | None = None

    def identity(self, authorization: bytes | None, x_api_key: bytes | None) -> str | None:
        """The key identity of a request's credentials, or None when they match no key.

        Every key is compared (no early exit), so the time taken says nothing about which one.
        """
        found: bytes | None = None
        for key in self.keys:
            bearer = token_matches(key, authorization)
            plain = x_api_key is not None and hmac.compare_digest(x_api_key.strip(ASCII_WHITESPACE), key)
            if bearer or plain:
                found = key
        return None if found is None else key_identity(found)


def load(env: Mapping[str, str] | None = None) -> ApiKeys | None:
    """The configured keys, or None when none are configured; :class:`TokenError` when unusable."""
    env = os.environ if env is None else env
    keys: list[bytes] = []
    raw = settings.setting(KEYS_ENV).raw(env)  # raw: a blank list must be refused, not defaulted
    if raw is not None:
        listed = [part for part in os.fsencode(raw).split(b",") if part.strip(ASCII_WHITESPACE)]
        if not listed:
            raise TokenError(f"{KEYS_ENV} is set but holds no key: an empty key list would let anyone in")
        keys += [validated(part, f"{KEYS_ENV} key {n}") for n, part in enumerate(listed, 1)]
    file = settings.value(KEY_FILE_ENV, env)
    if file:
        keys += read_key_file(Path(file).expanduser())
    if not keys:
        return None
    upstream = os.fsencode(env[MLX_VLM_KEY_ENV]) if env.get(MLX_VLM_KEY_ENV) else None
    accepted = tuple(dict.fromkeys([*keys, *([upstream] if upstream else [])]))
    return ApiKeys(accepted, upstream)


def read_key_file(path: Path) -> list[bytes]:
    """One key per line; blank lines and ``#`` comments are skipped; at least one key."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenError(f"API key file {path} cannot be read: {exc.strerror}") from None
    tighten(path, "API key file")
    keys = []
    for number, line in enumerate(data.splitlines(), 1):
        line = line.strip(ASCII_WHITESPACE)
        if line and not line.startswith(b"#"):
            keys.append(validated(line, f"API key file {path} line {number}"))
    if not keys:
        raise TokenError(f"API key file {path} holds no key: an empty key list would let anyone in")
    return keys
