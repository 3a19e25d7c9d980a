"""Which speculative drafters the lineage cache serves, decided before the server starts.

mlx-vlm 0.7.10's batched server speculates when started with ``--draft-model`` (or
``MLX_VLM_DRAFT_MODEL``), ``--draft-kind mtp|eagle3|dflash``. A restore hands the target's
caches to ``SpeculativeGenerationBatch``, which verifies every draft against the target, so a
wrong draft can only cost speed; but the drafter's own state, the rollback of the target's
recurrent layers and the commit of a request's rows are per drafter kind and family, and only
the pairs in ``SERVED`` are proved (tests/speculative/test_spec_server.py: every restore kind
answers what a cold prefill and the model without a drafter answer). Anything else is refused
at start with the reason: fail closed, never served unproved. ``APC_LINEAGE=0`` (stock
mlx-vlm) is not checked here.

A drafter is named by a local directory whose ``config.json`` says its ``model_type``: a Hub id
cannot be read before the load, so it is refused too (download it and pass the directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

#: (target model_type, drafter model_type, draft kind) the lineage cache serves, with the test
#: that proves it.
SERVED: dict[tuple[str, str, str], str] = {
    ("glm5_next", "glm5_next_mtp", "mtp"): "tests/speculative/test_spec_server.py",
}

_KIND_OF = {"glm5_next_mtp": "mtp"}  # what mlx-vlm resolves a served drafter's kind to


class UnservedDrafter(ValueError):
    """A drafter the lineage cache cannot serve correctly; the message says why."""


@dataclass(frozen=True)
class DraftOptions:
    model: str | None
    kind: str | None


def _flag(args: Sequence[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def draft_options(args: Sequence[str], environ: Mapping[str, str]) -> DraftOptions:
    """The drafter the server will load: its flags, else mlx-vlm's environment variables."""
    return DraftOptions(
        model=_flag(args, "--draft-model") or environ.get("MLX_VLM_DRAFT_MODEL") or None,
        kind=_flag(args, "--draft-kind") or environ.get("MLX_VLM_DRAFT_KIND") or None,
    )


def _model_type(directory: str | Path) -> str:
    try:
        config = json.loads((Path(directory).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def check_drafter(target_dir: str | None, options: DraftOptions, kv_bits: int | None = None) -> str | None:
    """None when no drafter is asked for; the served triple's description when it is served;
    raises ``UnservedDrafter`` with the reason otherwise. ``kv_bits``: the uniform KV
    quantization the server runs (None: float KV); quantized KV with a drafter is not proved."""
    if options.model is None:
        if options.kind is not None:
            raise UnservedDrafter(f"--draft-kind {options.kind} without --draft-model")
        return None
    if kv_bits is not None:
        raise UnservedDrafter(
            f"--draft-model with --kv-bits {kv_bits}: speculative decoding over quantized KV is not "
            "proved correct with the lineage cache; drop one of them")
    drafter = Path(options.model).expanduser()
    if not drafter.is_dir():
        raise UnservedDrafter(
            f"--draft-model {options.model}: the lineage cache checks a drafter before it serves "
            "it and can only read a local directory (download it and pass its path)")
    target_type = _model_type(target_dir) if target_dir else ""
    drafter_type = _model_type(drafter)
    kind = options.kind or _KIND_OF.get(drafter_type, "")
    if (target_type, drafter_type, kind) in SERVED:
        return f"{target_type} + {drafter_type} ({kind})"
    served = ", ".join(f"{t} + {d} ({k})" for t, d, k in SERVED)
    if drafter_type in (target_type, f"{target_type}_text") and target_type:
        hint = (" (a checkpoint with its MTP layer inside is not served: split it into a "
                "standalone drafter with mlx-vlm's split_mtp and pass that directory)")
    else:
        hint = ""
    raise UnservedDrafter(
        f"speculative decoding with target {target_type or '?'}, drafter "
        f"{drafter_type or '?'} and --draft-kind {kind or '?'} is not proved correct with the "
        f"lineage cache{hint}; served: {served}. Start without --draft-model, or with "
        "APC_LINEAGE=0 for stock mlx-vlm")


def drafter_support(target_dir: str | None, drafter_dir: str | None, kind: str | None = None) -> dict[str, object]:
    """For ``apcctl model check``: whether the lineage serves this drafter, and why not."""
    try:
        served = check_drafter(target_dir, DraftOptions(drafter_dir, kind))
    except UnservedDrafter as exc:
        return {"drafter": drafter_dir, "served": False, "reason": str(exc)}
    return {"drafter": drafter_dir, "served": served is not None, "reason": served or "no drafter"}


#: Set by the launcher when it starts a served drafter; the intake reads it (same process).
SPECULATING_ENV = "APC_SPECULATIVE_DRAFTER"
_LOGPROB_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions", "/completions", "/v1/completions"})


def logprobs_refusal(path: str, data: object, environ: Mapping[str, str]) -> str | None:
    """A 400's reason for a request asking for logprobs while a drafter speculates, else None.

    mlx-vlm 0.7.10's speculative batches compute no logprobs: such a request got every token's
    logprob as 0.0 and no top_logprobs (found by tests/speculative/test_spec_server.py), numbers
    that look real and are not. Refused, never served wrong."""
    if not environ.get(SPECULATING_ENV) or path not in _LOGPROB_ROUTES or not isinstance(data, dict):
        return None
    if data.get("logprobs") or data.get("top_logprobs"):
        return ("logprobs are not computed under speculative decoding (this server runs a "
                "--draft-model): leave logprobs/top_logprobs out, or ask a server without a drafter")
    return None
