"""``apcctl model check``'s drafter line: does a checkpoint have an MTP drafter, and does the
lineage cache serve it (the server's own start-up gate, ``server_patch.speculative.support``)?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server_patch.speculative.support import drafter_support

#: The drafter section ``apcctl model matrix --markdown`` ends docs/models.md with.
DOCS_SECTION = """
## Speculative decoding: the tiny model's MTP drafter (issue 39)

`apcctl model build OUT --preset tiny-spec --drafter` (or `--preset bench-spec`) also writes
`OUT/mtp/`: a standalone `glm5_next_mtp`
checkpoint (the layout mlx-vlm 0.7.10's `Glm5NextMTPSplitter` writes from GLM-5-Next's layer 45:
`enorm`, `hnorm`, `eh_proj`, `mtp_block.*`, `shared_head_norm`, with the target's
`text_config`). Serve it with `--draft-model OUT/mtp --draft-kind mtp`. The target's own files
and fingerprint are untouched (`apcctl/lab/tinymodel/drafter.py`).

How it is made, honestly: **constructed to agree, nothing trained or fitted.** A drafter for a
random six-layer target cannot agree with it by learning in minutes on two cores (a ridge fit of
`eh_proj` to the target's next hidden state, the first version, reached ~20% greedy agreement on
held-out positions and 0 accepted drafts of 45 on a real server; a 4,096-wide random-feature fit
on 3,000 positions overfitted to 13%). So the speculative presets `tiny-spec` and `bench-spec`
(tiny's and bench's shapes; builder version 4) carry a **dominant path**
(`apcctl/lab/tinymodel/weights.py: add_dominant_path`): the last 24 features of every token's embedding hold a vote for that token's successor in one fixed random cycle through
the generatable words (EOS excluded, so the path never ends a reply, and followed without a break
it repeats only after ~560 tokens), no layer writes those features (their rows of every
`o_proj`/`down_proj` are zero), and each cycle token's `lm_head` row reads them with the preset's
`path_gain` (tiny-spec 0.4, bench-spec 5.0: bench's final hidden state is ~12x larger before
the final norm). The other 40 features carry the context exactly as before, and where the
context's logits differ by more than the vote's lead, the target leaves the path: every answer is still the
target's own weights' answer over its whole context (warm must still equal cold token for token).
The path is opt-in: a target that follows its last token's successor most of the time changes
fewer tokens when a restore is corrupted and starts different prompts' replies alike, so `tiny`
and `bench` (every other test, bench and the demo) have `path_gain` 0, no path, and exactly
builder 2's weights (`tests/test_tiny_model.py` pins their fingerprints); only the speculative
tests (`tests/speculative`, the `spec_model_dir` fixture) and `apcctl bench spec` use the
`-spec` presets, and `apcctl model build --drafter` refuses the others.

The drafter implements that path for token `t+2` from the embedding of token `t+1`: `eh_proj`
copies the embedding's 24 path features and nothing else (the target's hidden state is read
and ignored), the decoder block stays in the graph with zero residual writers (its KV, index
and pooling caches fill with real values), and `shared_head_norm` + the target's `lm_head` turn
the vote into the successor. Its acceptance is therefore exactly how often the target follows
its own dominant path. The build measures it (32 corpus prompts x 32 greedy tokens, one batch:
seconds on tiny, ~46 s of CPU on bench) and records it in `OUT/mtp/.apcctl-drafter.json` (`fit_report`), and
`apcctl model build --drafter` prints it:

| preset | target follows its path (drafter agrees), greedy corpus tokens |
|---|---|
| tiny-spec (seed 0) | 72% (of 1,024) |
| bench-spec (seed 0) | 59% (of 1,024) |

With mlx-vlm's own speculative generation in-process on the tiny-spec preset (2 drafts per round),
a chat prompt accepted 29 of 36 drafts (1.61 per round) and the reply equalled generation
without a drafter; `tests/speculative/test_drafter_acceptance.py` asserts more than 0.5
accepted per round over the bundled agent prompts, and that the same drafter with a random
`eh_proj` stays below that. Limits: the drafter ignores the target's hidden state and its own
attention writes nothing, so a warm restore cannot change its drafts; what the issue asks of
the drafter's context after a restore is proved on its caches, not on its acceptance.

Which drafters the lineage cache serves is decided at start (`server_patch.speculative.support`,
`apcctl model check` says the same): glm5_next with a standalone glm5_next_mtp drafter and
`--draft-kind mtp` (entry, final, anchor, divergence and disk restores answer a cold prefill's
tokens, with and without the drafter: `tests/speculative/test_spec_server.py`). Every other
kind, family or layout is refused with the reason.

### Reply reuse and copy-free admission under speculation

mlx-vlm 0.7.10's `SpeculativeGenerationBatch` keeps no fed ids, and within a round its caches
hold draft rows: the target verifies `[bonus, drafts...]` in one forward, then
`commit_speculative_round` keeps `accepted + 1` of them per row (KV rows trimmed, the recurrent
state rolled back to the verified one). After that commit a row's cache holds exactly what it
held before plus `verify_input[row, :accepted + 1]`. The overlay (`overlay/patches/speculative.py`)
has `_mtp_rounds_batch` report each committed round and the batch name its finished rows before
it filters or releases its cache; `server_patch.speculative.rounds` turns the rounds into each
tracked reply's fed ids and the cache's row order, and the row's end goes through the same
commit as a plain batch's (`copyfree.replies.validated`: every KV cache of the row must hold
prompt + exactly those ids). So accepted tokens extend the entry as fed tokens do without a
drafter, a rejected draft never reaches it, and the recurrent state stored is the verified one.
Fails closed: no round seen, a round whose rows do not match the cache, or a missed round
(the cache holds more than the rounds account for) keep the prompt-end entry
(`tests/speculative/test_spec_rounds.py`). Only draft kinds whose rounds are reported (mtp)
turn it on (`GeneratorView.verified`); any other kind is never tracked.

One difference from a plain server, by construction: a speculative row's last emitted token is
the target's own next token, emitted and never fed, so its entry ends one token before the
reply does. mlx-vlm's plain decode step is pipelined and feeds its last emitted token as a
by-product. The next turn therefore restores one token less and prefills that token with its
suffix (`tests/speculative/test_spec_replies.py` asserts the head is prompt + every verified id
and at most one token short of the no-drafter server). Feeding it at the end would cost a
decode forward to save one token of a prefill that runs anyway. A round never drafts past
`max_tokens` (its block is capped by the smallest remaining budget), but one that accepted
drafts after a stop id keeps those in the cache too (verified, never emitted): its entry stays
correct, and the next turn, which shares only the emitted part, restores at the protected prompt
end (no reply reuse for that reply; a recurrent state cannot be cut back to the stop id).

Copy-free admission is on with a drafter (lending the entry's buffer to a lone restored row,
adopting a lone row's buffer at its end), decided by reading 0.7.10's code: drafts are written
only at and past the row's verified length and trimmed back (`trim`), never below it; the only
operations that move rows already written (`prepare`/`finalize` for ragged acceptance, the round
loop's `filter`) run only with more than one row, a lent row is lone, and a speculative batch
is never extended while it decodes (`extend` raises); the rotating-cache transaction (which
restores a snapshot) applies to rotating caches only, which are not lent; a lone row's buffer
is adopted when it finishes, right before the batch releases its cache. A shared reply
deferral (a row of a multi-row batch appending its reply to its entry's buffer at its end) stays
plain-only: a speculative batch's cache rows follow its rounds, not its uids.
`tests/speculative/test_spec_replies.py` shows the warm turns lent exactly as without a
drafter, and every answer equal to a cold drafter server's and the no-drafter server's.

**Staged.** A restore is staged (its merge copy made on the stager thread, issue 29) only where
it would otherwise be copied on the generation thread while other rows decode. With a drafter
that never happens: mlx-vlm admits no prompt while a speculative batch decodes (`next` returns
before the prompt batch), so a turn queued behind a speculative stream is admitted when it has
ended and its copy runs beside no decoding row. The same test shows two such turns `copied`
then, each answering as cold.

### The drafter's context on a warm turn

Measured, not assumed (`tests/speculative/test_drafter_context.py`, in process, the tiny-spec
model and its built drafter): warm == cold already holds, and nothing needs storing with an entry.
mlx-vlm's chunked prefill stops while one prompt token is left, cold or warm, and `generate`
runs that token; the speculative batch hands the MTP drafter `prompt_tokens` = that one token
and the target's hidden state there (`SpeculativePrefill` accumulates chunks only for dflash and
eagle3). `glm5_next_mtp` is reset per batch, prefilled from those alone at its own position 0,
and ignores the target's shared KV (`set_shared_kv`). So after a restore that skipped most of
the prompt, the drafter's KV, index and pooling caches, seed token, seed hidden and position
equal a cold prefill's within float tolerance (the test compares all of them, from a prompt of
96 tokens restored at 70). The cost is the same cold and warm: the drafter never sees the
prompt beyond its last token, so acceptance cannot differ between warm and cold turns, and
equally gains nothing from a long prompt. On the real server, every restore kind's warm turn
speculates exactly as its cold twin: equal rounds, drafted and accepted drafts
(`tests/speculative/test_spec_server.py`).
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
