"""Walking a note's tokenized pieces along a prompt's token ids: where its seams fall."""

from __future__ import annotations

from collections import Counter

import numpy as np

from server_patch.boundaries.kinds import BPE_SLACK
from server_patch.boundaries.notes import Note, Walk
from server_patch.lineage.lookup import common_prefix_len

MAX_BOS = 4  # tokens a tokenizer may put before the rendered text (BOS and the like)
MERGE_TOKENS = 3  # tokens on either side of a seam that a BPE merge may change
MIN_FIRST_MATCH = 4  # tokens of the first piece that must match before a walk counts


def walk(prompt: np.ndarray, note: Note, stats: Counter[str]) -> Walk | None:
    """Match ``note``'s pieces along ``prompt``; None when not even its first piece matches.

    Pieces were tokenized apart. Where the prompt's tokenization merged the tail of one piece
    with the head of the next, the piece is accepted when at most ``MERGE_TOKENS`` of its
    tokens differ, the seam is put before the merge (minus the slack), and the walk
    resynchronises on the next piece a few tokens on.
    """
    pieces = note.pieces
    if len(pieces) < 2 or pieces[0].shape[0] == 0:
        return None
    pos = _start(prompt, pieces[0])
    if pos is None:
        return None
    hard = note.hard_ids
    positions: list[tuple[int, str]] = []
    anchors_at: list[int] = []
    skip = 0  # head tokens of the current piece that a merge already consumed
    for j, ids in enumerate(pieces):
        body = ids[skip:]
        size = int(body.shape[0])
        agreed = common_prefix_len(prompt[pos:], body)
        if j == len(pieces) - 1:  # the tail (generation prompt): nothing to place after it
            pos += agreed
            break
        nxt = pieces[j + 1]
        if agreed == size:
            pos += size
            at = pos
            exact = skip == 0 and ((size and int(body[-1]) in hard) or (nxt.shape[0] and int(nxt[0]) in hard))
            if not exact:
                at = max(0, pos - BPE_SLACK)
            skip = 0
        elif size - agreed <= MERGE_TOKENS:
            at = max(pos, pos + agreed - BPE_SLACK)
            found = resync(prompt, pos + agreed, nxt)
            if found is None:
                positions.append((at, note.kinds[j]))
                if j in note.anchor_seams:
                    anchors_at.append(at)
                pos += agreed
                break
            pos, skip = found
            stats["seam_merges"] += 1
        else:
            pos += agreed
            break
        positions.append((at, note.kinds[j]))
        if j in note.anchor_seams:
            anchors_at.append(at)
    if not positions:
        return None
    return Walk(note, positions, pos, anchors_at)


def _start(prompt: np.ndarray, first: np.ndarray) -> int | None:
    """Where the first piece starts in ``prompt`` (after up to ``MAX_BOS`` added tokens)."""
    n = int(prompt.shape[0])
    pos, best_shared = -1, 0
    for o in range(min(MAX_BOS, n - 1) + 1):
        shared = common_prefix_len(prompt[o:], first)
        if shared > best_shared:
            pos, best_shared = o, shared
        if shared == first.shape[0]:
            break
    if pos < 0 or best_shared < min(int(first.shape[0]), MIN_FIRST_MATCH):
        return None
    return pos


def resync(prompt: np.ndarray, start: int, nxt: np.ndarray) -> tuple[int, int] | None:
    """(position, skipped head tokens) where ``nxt`` continues after a merged seam."""
    n = int(prompt.shape[0])
    for r in range(0, MERGE_TOKENS + 1):
        width = min(4, int(nxt.shape[0]) - r)
        if width <= 0:
            break
        for q in range(start, min(n - width, start + MERGE_TOKENS) + 1):
            if np.array_equal(prompt[q:q + width], nxt[r:r + width]):
                return q, r
    return None
