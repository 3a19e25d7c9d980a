"""Server options the lineage cache cannot honour, refused before anything starts, and the
quantized-KV policy (``--kv-bits``) it does honour.

No mlx or mlx-vlm import here: ``server_patch.launch`` runs this before the overlay is
installed (importing mlx-vlm earlier would load modules the overlay must patch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence


class UnsupportedCacheError(TypeError):
    """The model (or a server option) uses a cache class whose restore semantics we have not
    registered."""


TURBOQUANT_REFUSAL = (
    "the lineage cache cannot restore a TurboQuant KV cache ({cls}): its rotated codebook rows "
    "have no restore rule. Use an integer --kv-bits with --kv-quant-scheme uniform (4 or 8: "
    "mlx-vlm's QuantizedKVCache, which the lineage cache restores), or APC_LINEAGE=0 for stock "
    "mlx-vlm's prompt cache")

DEFAULT_GROUP_SIZE = 64  # mlx-vlm's DEFAULT_KV_GROUP_SIZE

#: Option -> the environment variable mlx-vlm's server CLI copies it into.
_OPTIONS = {"--kv-bits": "KV_BITS", "--kv-group-size": "KV_GROUP_SIZE",
            "--kv-quant-scheme": "KV_QUANT_SCHEME", "--kv-key-scheme": "KV_KEY_SCHEME",
            "--kv-value-scheme": "KV_VALUE_SCHEME"}


@dataclass(frozen=True)
class KVQuant:
    """Uniform KV quantization as the server runs it: ``mx.quantize`` bits and group size."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE


def option_of(args: Sequence[str], environ: Mapping[str, str], flag: str) -> str | None:
    """``flag N`` / ``flag=N`` from the server's arguments, else its environment variable."""
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return environ.get(_OPTIONS[flag])


def kv_bits_of(args: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """``--kv-bits N`` / ``--kv-bits=N`` from the server's arguments, else ``KV_BITS``."""
    return option_of(args, environ, "--kv-bits")


def _unset(value: float | str | None) -> bool:
    return value in (None, "", 0, "0", 0.0) or (isinstance(value, str) and value.strip() in ("0", "0.0"))


def kv_quant_of(args: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> KVQuant | None:
    """The uniform KV quantization the server will run (None: float KV), or raise
    ``UnsupportedCacheError`` for one the lineage cache cannot restore (TurboQuant: a
    fractional ``--kv-bits`` or a ``turboquant`` scheme)."""
    import os

    env = os.environ if environ is None else environ
    raw = kv_bits_of(args, env)
    if _unset(raw):
        return None
    label = f"--kv-bits {raw}"
    try:
        bits = float(str(raw))
        group = int(option_of(args, env, "--kv-group-size") or DEFAULT_GROUP_SIZE)
    except ValueError:
        raise UnsupportedCacheError(f"{label}: not a number (--kv-bits, --kv-group-size)") from None
    schemes = {option_of(args, env, flag) for flag in ("--kv-quant-scheme", "--kv-key-scheme",
                                                       "--kv-value-scheme")}
    if "turboquant" in schemes or not math.isclose(bits, round(bits), abs_tol=1e-6):
        raise UnsupportedCacheError(TURBOQUANT_REFUSAL.format(cls=f"{label}, TurboQuantKVCache"))
    return KVQuant(int(round(bits)), group)


def check_options(kv_bits: float | str | None, environ: Mapping[str, str] | None = None) -> KVQuant | None:
    """Refuse what would otherwise fail at the first store (TurboQuant KV); return the uniform
    quantization the lineage cache will restore (None: float KV). ``kv_bits`` is the server's
    ``--kv-bits`` (the ``KV_BITS`` env var mlx-vlm's CLI sets)."""
    if _unset(kv_bits):
        return None
    return kv_quant_of(["--kv-bits", str(kv_bits)], environ if environ is not None else {})
