"""The launcher's ``--api-key KEY`` (repeatable) and ``--api-key-file FILE``, as their settings.

mlx-vlm 0.7.10 has one ``--api-key`` of its own (``MLX_VLM_SERVER_API_KEY``: one key, no
namespaces, ``/health`` locked too). With the patch the launcher takes the flag itself: the keys
go to ``APC_API_KEYS``/``APC_API_KEY_FILE`` in this process's environment (never on to mlx-vlm's
command line), each key its own cache namespace, ``/health`` open. With ``APC_LINEAGE=0`` (stock
mlx-vlm, no middleware) only mlx-vlm's single ``--api-key`` can be honoured: anything more stops
the server rather than serving with keys silently ignored.
"""

from __future__ import annotations

import os
from typing import MutableMapping

from server_patch.argv import take_flags
from server_patch.tenancy.keys import KEY_FILE_ENV, KEYS_ENV, load

KEY_FLAG, FILE_FLAG = "--api-key", "--api-key-file"


def take_api_key_flags(args: list[str]) -> tuple[list[str], list[str], str | None]:
    """``args`` without the key flags, the keys given, and the key file (the last one given)."""
    rest, given = take_flags(args, (KEY_FLAG, FILE_FLAG))
    files = given.get(FILE_FLAG, [])
    return rest, given.get(KEY_FLAG, []), files[-1] if files else None


def apply_api_key_flags(args: list[str], environ: MutableMapping[str, str], patched: bool) -> list[str]:
    """The server's arguments after the key flags became settings (patched) or were checked (stock)."""
    if not patched:
        given = sum(1 for a in args if a == KEY_FLAG or a.startswith(KEY_FLAG + "="))
        if given > 1 or any(a.partition("=")[0] == FILE_FLAG for a in args) or \
                environ.get(KEYS_ENV) is not None or environ.get(KEY_FILE_ENV):
            raise SystemExit("server_patch.launch: APC_LINEAGE=0 runs stock mlx-vlm, which takes one --api-key "
                             f"only (no {FILE_FLAG}, {KEYS_ENV} or {KEY_FILE_ENV})")
        return args
    rest, keys, file = take_api_key_flags(args)
    if any("," in key for key in keys):
        raise SystemExit(f"server_patch.launch: a key given with {KEY_FLAG} cannot hold a comma; use {FILE_FLAG}")
    if keys:
        earlier = environ.get(KEYS_ENV)
        environ[KEYS_ENV] = ",".join([*([earlier] if earlier else []), *keys])
    if file is not None:
        environ[KEY_FILE_ENV] = os.path.abspath(os.path.expanduser(file))
    try:
        load(environ)  # a blank list, an unreadable file or a bad key stops the server before the model loads
    except ValueError as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    return rest
