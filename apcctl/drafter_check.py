"""``apcctl model check``'s drafter line: does a checkpoint have an MTP drafter, and does the
lineage cache serve it (the server's own start-up gate, ``server_patch.speculative.support``)?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server_patch.speculative.support import drafter_support

#: The drafter section ``apcctl model matrix --markdown`` ends docs/models.md with.
DOCS_SECTION = """
## Speculative decoding: the tiny model's MTP drafter (issue 39)

`apcctl model build OUT --drafter` also writes `OUT/mtp/`: a standalone `glm5_next_mtp`
checkpoint (the layout mlx-vlm 0.7.10's `Glm5NextMTPSplitter` writes from GLM-5-Next's layer 45:
`enorm`, `hnorm`, `eh_proj`, `mtp_block.*`, `shared_head_norm`, with the target's
`text_config`). Serve it with `--draft-model OUT/mtp --draft-kind mtp`. The target's own files
and fingerprint are untouched (`apcctl/tinymodel/drafter.py`).

How it is made, honestly: the target generates greedily from the bundled corpus, and `eh_proj`
is the ridge least-squares map from `[enorm(embed(x[t+1])), hnorm(h[t])]` to the target's next
final hidden state `h[t+1]`; the drafter's decoder block is in the graph (its KV, index and
pooling caches fill with real values) but its residual writers are zero. The stamp
(`OUT/mtp/.apcctl-drafter.json`) records the held-out greedy agreement. **It is low**: ~20% on
held-out corpus positions, and 0 accepted drafts of 45 on the chat prompts of the first
real-server probe: a linear map cannot follow a 6-layer random target. So this drafter
exercises every draft/verify/rollback path with almost every draft rejected; it does not yet
make acceptance measurable, and since its block writes nothing, what its attention sees after a
warm restore cannot change its drafts. The construction that would (an induction head in the
drafter's attention copying the token that followed the same token before, which a looping
random model and a re-sent conversation both reward) is not built yet.

Which drafters the lineage cache serves is decided at start (`server_patch.speculative.support`,
`apcctl model check` says the same): glm5_next with a standalone glm5_next_mtp drafter and
`--draft-kind mtp` (entry, final, anchor, divergence and disk restores answer a cold prefill's
tokens, with and without the drafter: `tests/speculative/test_spec_server.py`). Every other
kind, family or layout is refused with the reason.
"""


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
