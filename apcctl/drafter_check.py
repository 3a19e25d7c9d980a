"""``apcctl model check``'s drafter line: does a checkpoint have an MTP drafter, and does the
lineage cache serve it (the server's own start-up gate, ``server_patch.speculative.support``)?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server_patch.speculative.support import drafter_support


def found_drafter(model_dir: Path) -> tuple[str | None, str]:
    """(drafter directory, where it was found): ``model_dir/mtp`` as ``apcctl model build
    --drafter`` writes it, else MTP tensors inside the checkpoint (mlx-vlm's own detection,
    which reads only the safetensors headers), else none."""
    built = Path(model_dir) / "mtp"
    if (built / "config.json").is_file():
        return str(built), "standalone drafter in mtp/"
    try:
        from mlx_vlm.speculative.drafters.mtp_split import detect_mtp_splitter

        if detect_mtp_splitter(Path(model_dir)) is not None:
            return str(model_dir), "MTP layer inside the checkpoint"
    except (OSError, ValueError, KeyError):
        pass
    return None, "none"


def drafter_report(model_dir: Path, drafter: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """The drafter of ``model_dir`` (``drafter`` when given, else the one found) and whether the
    lineage serves it; ``given`` says whether the operator named it."""
    found = "given" if drafter else None
    if drafter is None:
        drafter, found = found_drafter(model_dir)
    report = {"found": found, **drafter_support(str(model_dir), drafter, kind), "given": found == "given"}
    return report


def format_drafter(report: dict[str, Any]) -> str:
    if report["drafter"] is None:
        return "drafter: none (serve with --draft-model DIR --draft-kind mtp; apcctl model build --drafter makes one)"
    verdict = "served by the lineage cache" if report["served"] else "refused at start"
    return f"drafter: {report['drafter']} ({report['found']}): {verdict}: {report['reason']}"
