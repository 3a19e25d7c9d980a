"""The admin bearer token: given by env/flag, or generated once into an owner-only file."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from server_patch.paths import state_dir


def default_token_path() -> Path:
    """``APC_ADMIN_TOKEN_FILE``, else ``<state dir>/admin-token``."""
    configured = os.environ.get("APC_ADMIN_TOKEN_FILE")
    if configured:
        return Path(configured).expanduser()
    return state_dir() / "admin-token"


def load_or_create_token(path: Path | None = None) -> str:
    """``APC_ADMIN_TOKEN`` if set; else the token file, created with mode 0600 if missing."""
    env = os.environ.get("APC_ADMIN_TOKEN")
    if env:
        return env.strip()
    path = path or default_token_path()
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    try:
        os.link(tmp, path)  # never replaces a token another process wrote meanwhile
    except FileExistsError:
        token = path.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)
    return token


def token_matches(expected: str, header: str | None) -> bool:
    """Constant-time check of an ``Authorization: Bearer <token>`` header."""
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), expected.encode())
