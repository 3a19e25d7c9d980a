"""Server options the lineage cache cannot honour, refused before anything starts.

No mlx or mlx-vlm import here: ``server_patch.launch`` runs this before the overlay is
installed (importing mlx-vlm earlier would load modules the overlay must patch).
"""

from __future__ import annotations

from typing import Mapping, Sequence


class UnsupportedCacheError(TypeError):
    """The model (or a server option) uses a cache class whose restore semantics we have not
    registered."""


KV_BITS_REFUSAL = (
    "the lineage cache cannot restore a quantized KV cache ({cls}): its packed rows have no "
    "restore rule yet. Run without --kv-bits, or with APC_LINEAGE=0 for stock mlx-vlm's prompt cache")


def check_options(kv_bits: float | str | None) -> None:
    """Refuse what would otherwise fail at the first store: a quantized KV cache.

    ``kv_bits`` is the server's ``--kv-bits`` (the ``KV_BITS`` env var mlx-vlm's CLI sets)."""
    if kv_bits not in (None, "", 0, "0", 0.0):
        raise UnsupportedCacheError(KV_BITS_REFUSAL.format(cls=f"--kv-bits {kv_bits}"))


def kv_bits_of(args: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """``--kv-bits N`` / ``--kv-bits=N`` from the server's arguments, else ``KV_BITS``."""
    for i, arg in enumerate(args):
        if arg.startswith("--kv-bits="):
            return arg.split("=", 1)[1]
        if arg == "--kv-bits" and i + 1 < len(args):
            return args[i + 1]
    return environ.get("KV_BITS")
