"""The admin bearer token: given by env/flag, or generated once into an owner-only file.

A blank token would let anyone in, so it is refused when the server starts: a blank
``APC_ADMIN_TOKEN`` stops the server with a message, a blank token file gets a fresh token.
The header is compared as raw bytes: only ASCII whitespace around the configured token is
dropped, so ``Bearer <token>\\xa0`` (or a lone NBSP against a blank token) never matches.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

from server_patch import settings
from server_patch.private_files import FILE_MODE, fsync_dir, fsync_fd, open_private, private_dir
from server_patch.paths import state_dir

log = logging.getLogger("server_patch.admin")

ENV = "APC_ADMIN_TOKEN"
ASCII_WHITESPACE = b" \t\r\n\x0b\x0c"
SCHEME = b"Bearer "  # exactly this, as mlx-vlm's own API-key check and every client here send it


class TokenError(ValueError):
    """The configured token cannot be used; the message says which and why."""


def default_token_path() -> Path:
    """``APC_ADMIN_TOKEN_FILE``, else ``<state dir>/admin-token``."""
    configured = settings.value("APC_ADMIN_TOKEN_FILE")
    if configured:
        return Path(configured).expanduser()
    return state_dir() / "admin-token"


def validated(raw: bytes, source: str, hint: str = "") -> bytes:
    """``raw`` without surrounding ASCII whitespace; refused when blank or not sendable in a header."""
    token = raw.strip(ASCII_WHITESPACE)
    if not token:
        raise TokenError(f"{source} is blank: an empty admin token would let anyone in{hint}")
    if any(byte < 0x20 or byte > 0x7E for byte in token):
        raise TokenError(f"{source} must be printable ASCII (no control characters or non-ASCII bytes){hint}")
    return token


def load_or_create_token(path: Path | None = None) -> str:
    """``APC_ADMIN_TOKEN`` if set; else the token file, created (or filled when blank) with mode 0600.

    Raises :class:`TokenError` for a blank or unusable configured token.
    """
    env = settings.setting(ENV).raw()  # raw: a blank token must be refused, not defaulted
    if env is not None:
        hint = " (set a token, or unset it to use the token file)"
        return validated(os.fsencode(env), ENV, hint).decode("ascii")
    path = path or default_token_path()
    for _ in range(3):  # a concurrent creator can make one attempt see a vanished file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            created = _create(path)
            if created is not None:
                return created
            continue
        if not data.strip(ASCII_WHITESPACE):
            return _fill_blank(path)
        tighten(path)
        return validated(data, f"token file {path}").decode("ascii")
    raise TokenError(f"token file {path} keeps disappearing while it is read")


def _write_new(path: Path, token: str) -> Path:
    """A durable temporary file next to ``path`` holding ``token``."""
    private_dir(path.parent, tighten=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, (token + "\n").encode("ascii"))
        fsync_fd(fd)  # the token is on disk before any name points at it
    finally:
        os.close(fd)
    return tmp


def _create(path: Path) -> str | None:
    """Generate a token into a missing file; None when another process created it first."""
    token = secrets.token_urlsafe(32)
    tmp = _write_new(path, token)
    try:
        os.link(tmp, path)  # never replaces a token another process wrote meanwhile
    except FileExistsError:
        return None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return token


def _fill_blank(path: Path) -> str:
    """Replace an empty (or whitespace) token file with a fresh token, atomically.

    A lock on the blank file makes two servers starting together agree on one token: the
    second re-reads the path after the first has replaced it.
    """
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = path.read_bytes()
        if data.strip(ASCII_WHITESPACE):
            return validated(data, f"token file {path}").decode("ascii")
        token = secrets.token_urlsafe(32)
        tmp = _write_new(path, token)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        log.warning("admin token file %s was blank: a new token was generated into it", path)
        return token
    finally:
        os.close(fd)  # releases the lock


def tighten(path: Path, what: str = "admin token file") -> None:
    """A secret file (``what``) readable by others is made owner-only (when it is ours)."""
    try:
        info = path.stat()
        if info.st_mode & 0o077 and info.st_uid == os.getuid():
            os.chmod(path, FILE_MODE)
            log.warning("%s %s was readable by others: mode set to 0600", what, path)
    except OSError:
        pass


def token_matches(expected: str | bytes, header: str | bytes | None) -> bool:
    """Constant-time check of an ``Authorization: Bearer <token>`` header, byte for byte.

    A ``str`` header is taken as ASGI delivers it (latin-1), so any byte round-trips; a
    character outside latin-1 cannot have come off the wire and never matches.
    """
    if not expected or header is None:
        return False
    if isinstance(header, str):
        try:
            header = header.encode("latin-1")
        except UnicodeEncodeError:
            return False
    if not header.startswith(SCHEME):
        return False
    wanted = expected.encode("ascii") if isinstance(expected, str) else expected
    return hmac.compare_digest(header[len(SCHEME):], wanted)
