"""The launcher's ``--allowed-local-media-path DIR`` (vLLM's flag), as ``APC_ALLOWED_LOCAL_MEDIA_PATH``.

mlx-vlm 0.7.10 has no such flag (it reads any path a request names), so the launcher takes it
itself, like the serving flags; the last one given wins, and it never reaches mlx-vlm's argv.
"""

from __future__ import annotations

from typing import MutableMapping

from server_patch.intake.media import LOCAL_ENV
from server_patch.argv import take_flags

FLAG = "--allowed-local-media-path"


def apply_media_flag(args: list[str], environ: MutableMapping[str, str], patched: bool = True) -> list[str]:
    """``args`` without the flag, its value set as the setting; stock (``APC_LINEAGE=0``) refuses it."""
    rest, given = take_flags(args, {FLAG})
    if given and not patched:
        raise SystemExit(f"server_patch.launch: APC_LINEAGE=0 runs stock mlx-vlm, which has no {FLAG}")
    if given:
        environ[LOCAL_ENV] = given[FLAG][-1]
    return rest
