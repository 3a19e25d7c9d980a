"""The launcher's own flags, taken out of the argument list before mlx-vlm's argparse sees it.

mlx-vlm 0.7.10's server has no ``--served-model-name``, ``--allowed-origins``, ``--api-key-file``
or ``--allowed-local-media-path``: each topic that adds one takes it here, with one parser, so
they all accept ``--flag VALUE`` and ``--flag=VALUE`` alike and refuse a flag with no value.
"""

from __future__ import annotations

from typing import Collection


def take_flags(args: list[str], names: Collection[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``args`` without the flags in ``names`` (``--flag VALUE`` or ``--flag=VALUE``), and the
    values each was given, in order."""
    rest: list[str] = []
    given: dict[str, list[str]] = {}
    it = iter(args)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag not in names:
            rest.append(arg)
            continue
        if not eq:
            value = next(it, None)
            if value is None or value.startswith("--"):
                raise SystemExit(f"server_patch.launch: {flag} needs a value")
        given.setdefault(flag, []).append(value)
    return rest, given
