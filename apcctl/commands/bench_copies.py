"""``apcctl bench copies``: what a shared row's reply commit and a warm turn's merge copy cost.

The bench itself is ``apcctl.lab.bench.reply_copy`` (in-process, on the bench preset's cache
shapes): the whole-row copy a shared row's end used to make, the reply-rows-only append it makes
now, and the merge copy in one piece and in slices, side by side in one run. Not a test:
nothing asserts a time.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from apcctl.core import render


def register(main: click.Group, bench: click.Group) -> None:
    del main
    bench.add_command(copies)


_REGROWN = (("long", "1 row"), ("joint", "2 rows"))  # the lone long row; it and the decoding row
_REGROWS = (("regrow", "mlx-vlm's update_and_fetch"), ("alloc_grow", "grow_kv allocating"),
            ("ahead_grow", "grow_kv, buffer made ahead"))


# A short visitor joins a lone long stream (its rows in the model's own KVCache), and the next one.
_VISITS = (("visit_merge_extend", "mlx-vlm's merge + extend"), ("visit_ahead", "one_row + extend_kv, made ahead"),
           ("visit_free_row", "the next one, into the row it freed"))


def _regrow_rows(batch: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """The table's regrow rows (name, key, where): a full buffer takes one more token."""
    return [(f"regrow, {rows}: {how}", f"{key}_{suffix}", batch) for suffix, rows in _REGROWN for key, how in _REGROWS]


@click.command("copies")
@click.option("--context", type=click.IntRange(16), default=16384, show_default=True,
              help="Tokens of the row's conversation before its reply.")
@click.option("--reply", type=click.IntRange(1), default=300, show_default=True, help="Tokens of the reply.")
@click.option("--slice", "slice_rows", type=click.IntRange(1), default=2048, show_default=True,
              help="Rows per slice of the sliced merge (what one decode step would wait for).")
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True, help="Timed runs of each copy.")
@click.option("--victim", type=click.IntRange(1), default=200, show_default=True,
              help="Tokens of the decoding row a --context-token row joins and leaves (issue 40).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def copies(context: int, reply: int, slice_rows: int, repeat: int, victim: int, as_json: bool) -> None:
    """The bytes and milliseconds of each copy on the generation thread: the whole row, only
    the reply's rows, the merge in one piece and per slice; a row joining a decoding batch and
    leaving it (mlx-vlm's extend and filter, and the copy-free join and leave), the next decode
    write after each, and a join into a buffer with room; a full decoding buffer's regrow
    (mlx-vlm's, and copyfree.grow's allocating and into buffers made ahead) and the write after;
    a short visitor joining a lone long stream (its rows in the model's own KVCache: mlx-vlm's
    merge and extend, one_row and extend_kv into buffers made ahead) and the next visitor, written
    into the row the first one freed."""
    from apcctl.lab.bench import batch_copies, reply_copy

    with click.progressbar(length=2, label="timing the copies", file=sys.stderr) as bar:
        out = reply_copy.run(context, reply, slice_rows, repeat)
        bar.update(1)
        out["batch"] = batch_copies.run(context, victim, repeat)
        bar.update(1)
    if as_json:
        render.emit_json(out)
        return
    rows = [(name, render.human_bytes(of[f"{key}_bytes"]), *(f"{of[f'{key}_ms'][s]:.1f}" for s in ("min", "median", "max")))
            for name, key, of in (("whole row (before)", "row_copy", out), ("reply rows only (now)", "append", out),
                                  ("merge, one piece", "merge", out),
                                  (f"join a {victim:,}-token decoding row (extend)", "join", out["batch"]),
                                  ("leave it again (filter)", "leave", out["batch"]),
                                  ("join, copy-free (each row once)", "copyfree_join", out["batch"]),
                                  ("join, copy-free, buffer made ahead", "spare_join", out["batch"]),
                                  ("join of a lent row, buffer made ahead", "lent_join", out["batch"]),
                                  ("leave, copy-free (kept row at its width)", "copyfree_leave", out["batch"]),
                                  ("short row leaves, long row copied", "long_copied_leave", out["batch"]),
                                  ("short row leaves, long row kept in place", "long_in_place_leave", out["batch"]),
                                  ("join into a buffer with room", "headroom_join", out["batch"]),
                                  *_regrow_rows(out["batch"]),
                                  *((f"visitor joins a lone row: {how}", key, out["batch"]) for key, how in _VISITS))]
    render.console().print(render.table(("COPY", "BYTES", "MIN ms", "MEDIAN ms", "MAX ms"), rows,
                                        title=f"{context:,}-token context, {reply:,}-token reply"))
    batch = out["batch"]
    click.echo("the next decode write after each (ms median; a view or a full buffer is copied there): "
               + ", ".join(f"{name} {batch[f'{key}_ms']['median']:.1f}" for name, key in (
                   ("after extend", "join_next"), ("after filter", "leave_next"),
                   ("after the copy-free join", "copyfree_join_next"), ("after the copy-free leave", "copyfree_leave_next"),
                   ("after a leave kept as a view", "view_leave_next"),
                   ("after the long row was copied", "long_copied_leave_next"),
                   ("after it was kept in place", "long_in_place_leave_next"))))
    click.echo("a full buffer's regrow, the rows copied: " + ", ".join(
        f"{rows} {render.human_bytes(batch[f'regrow_{suffix}_rows_bytes'])}" for suffix, rows in _REGROWN)
        + "; the next decode write after it (ms median): " + ", ".join(
        f"{how}, {rows} {batch[f'{key}_{suffix}_next_ms']['median']:.1f}" for suffix, rows in _REGROWN
        for key, how in _REGROWS))
    click.echo(f"a {victim:,}-token visitor joining a lone {context:,}-token row: the next decode write after it "
               "(ms median): " + ", ".join(f"{how} {batch[f'{key}_next_ms']['median']:.1f}" for key, how in _VISITS)
               + "; the joint buffers: " + ", ".join(
                   f"{how} {render.human_bytes(batch[f'{key}_buffer_bytes'])}" for key, how in _VISITS)
               + f"; the next one went into the freed row: {'yes' if batch['visit_free_row_joined'] else 'NO'}")
    if "merge_slice_ms" in out:
        click.echo(f"merge in {out['merge_slices']} slices of {slice_rows:,} rows: "
                   f"{out['merge_slice_ms']['median']:.1f} ms median each")
