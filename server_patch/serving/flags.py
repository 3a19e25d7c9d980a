"""The launcher's ``--served-model-name`` (vLLM's flag) and ``--allowed-origins``, as their settings.

mlx-vlm 0.7.10 has neither flag, so the launcher takes them itself: their values (repeatable,
or comma-separated) go to ``APC_SERVED_MODEL_NAME`` and ``APC_ALLOWED_ORIGINS`` in this process's
environment, replacing what the environment said, and never reach mlx-vlm's command line. The
``--host`` the server binds, when it is a name, becomes one the origin guard answers to.
"""

from __future__ import annotations

from typing import MutableMapping

from server_patch.argv import take_flags
from server_patch.serving import origins

FLAGS = {"--served-model-name": "APC_SERVED_MODEL_NAME", "--allowed-origins": "APC_ALLOWED_ORIGINS"}


def apply_serving_flags(args: list[str], environ: MutableMapping[str, str], patched: bool = True) -> list[str]:
    """The server's arguments once the serving flags became settings; notes the ``--host`` name.
    Stock mlx-vlm (``APC_LINEAGE=0``) cannot honour them: given there, they stop the server."""
    rest, given = take_flags(args, FLAGS)
    if given and not patched:
        raise SystemExit(f"server_patch.launch: APC_LINEAGE=0 runs stock mlx-vlm, which has no {', '.join(given)}")
    for flag, values in given.items():
        environ[FLAGS[flag]] = ",".join(values)
    host = bound_host(rest)
    if host and not origins.is_address(host):
        origins.BOUND_HOSTS.append(host)
    return rest


def bound_host(args: list[str]) -> str | None:
    """The last ``--host`` value in ``args`` (what mlx-vlm's argparse keeps)."""
    _, given = take_flags(args, {"--host"})
    values = given.get("--host")
    return values[-1] if values else None
