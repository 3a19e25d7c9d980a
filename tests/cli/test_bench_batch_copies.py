"""``apcctl bench copies``' batch rows (issue 40): what mlx-vlm's join (``BatchKVCache.extend``)
and leave (``filter``) move, against a join into a buffer with room. Bytes are checked, times
never: the join copies both rows at the long row's width, the leave the kept row at that width,
the headroom join only the new row's tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from apcctl.lab.bench import batch_copies
from apcctl.cli import main


@pytest.fixture(scope="module")
def out() -> dict[str, Any]:
    return batch_copies.run(context=300, victim=20, repeat=1)


def test_the_join_and_the_leave_move_every_row_at_the_long_rows_width(out: dict[str, Any]) -> None:
    per_token, width = out["kv_bytes_per_token"], 512 + 256  # 300 tokens in 256-token steps, and a decode reserve
    assert per_token > 30_000  # the bench preset: ~32 KiB of KV per token
    assert out["join_bytes"] == 2 * width * per_token  # the 20-token row grew to the joiner's width
    assert out["leave_bytes"] == width * per_token
    assert out["headroom_join_bytes"] == 300 * per_token
    assert all(out[k]["min"] <= out[k]["median"] <= out[k]["max"] for k in ("join_ms", "leave_ms", "headroom_join_ms"))
    # Copy-free (copyfree.batch): one joint buffer at the joiner's width (a zero buffer made
    # ahead, or a new one), each row's tokens written once; the kept 20-token row copied from
    # its first column on.
    assert out["copyfree_join_rows_bytes"] == (300 + 20) * per_token
    assert out["copyfree_join_bytes"] == out["spare_join_bytes"] == 2 * width * per_token
    assert out["copyfree_leave_bytes"] == (width - (300 - 20)) * per_token
    # A lent joiner (its entry's buffer: 300 + reserve 256 + lend headroom 512, in 256 steps)
    # joins into the buffers asked for from both batches' shapes, at that width.
    assert out["lent_join_bytes"] == 2 * 1280 * per_token


def test_a_full_buffers_regrow_copies_its_rows_into_one_step_wider(out: dict[str, Any]) -> None:
    """The lone 300-token row, and it with the 20-token row left-padded to its width (as extend
    lays them out), each exactly full: one more token regrows them to 300 + 256 columns, every
    held row copied, by mlx-vlm and by grow_kv alike; the buffers made ahead are all taken."""
    per_token = out["kv_bytes_per_token"]
    for suffix, rows in (("long", 1), ("joint", 2)):
        for key in ("regrow", "alloc_grow", "ahead_grow"):
            assert out[f"{key}_{suffix}_rows_bytes"] == rows * 300 * per_token
            assert out[f"{key}_{suffix}_bytes"] == rows * (300 + 256) * per_token
            assert out[f"{key}_{suffix}_ms"]["min"] <= out[f"{key}_{suffix}_ms"]["max"]
            assert out[f"{key}_{suffix}_next_ms"]["min"] <= out[f"{key}_{suffix}_next_ms"]["max"]
        assert out[f"ahead_grow_{suffix}_left"] == 0  # the regrow wrote into them, allocating none


def test_a_visitor_joins_a_lone_rows_kvcache_and_the_next_one_its_freed_row(out: dict[str, Any]) -> None:
    """A 20-token visitor joins the lone 300-token row, both rows KVCaches as the model's own
    cache holds them: mlx-vlm merges each at its exact length, pads the short one to 300 and
    concatenates both; copy-free writes each row once, into the buffers made ahead (all taken);
    after it leaves (the long row kept in place), the next visitor goes into the row it freed,
    in the same buffer, and writes its 20 tokens and zeroes the one column the row that left
    wrote left of it (its first: the decode write after the first join moved the index by one)."""
    per_token = out["kv_bytes_per_token"]
    assert out["visit_merge_extend_buffer_bytes"] == 2 * 300 * per_token
    assert out["visit_merge_extend_bytes"] == (300 + 20 + 300 + 2 * 300) * per_token
    assert out["visit_ahead_bytes"] == (300 + 20) * per_token
    assert out["visit_ahead_made"] > 0 and out["visit_ahead_left"] == 0
    assert out["visit_ahead_buffer_bytes"] == out["visit_ahead_made_bytes"]
    assert out["visit_free_row_joined"] is True and out["visit_free_row_missed"] == 0
    assert out["visit_free_row_buffer_bytes"] == out["visit_ahead_buffer_bytes"]
    assert out["visit_free_row_zeroed_columns"] == 1
    assert out["visit_free_row_bytes"] == (20 + 1) * per_token
    for key in ("visit_merge_extend", "visit_ahead", "visit_free_row"):
        assert out[f"{key}_ms"]["min"] <= out[f"{key}_ms"]["median"] <= out[f"{key}_ms"]["max"]
        assert out[f"{key}_next_ms"]["min"] <= out[f"{key}_next_ms"]["max"]


def test_bench_copies_prints_the_batch_rows_too() -> None:
    done = CliRunner().invoke(main, ["bench", "copies", "--context", "300", "--reply", "20", "--slice", "128",
                                     "--repeat", "1", "--victim", "20", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["batch"]["victim"] == 20
    table = CliRunner().invoke(main, ["bench", "copies", "--context", "300", "--reply", "20", "--repeat", "1"])
    assert "join a 200-token decoding row (extend)" in table.output and "join into a buffer with room" in table.output
    assert "join, copy-free (each row once)" in table.output and "after the copy-free leave" in table.output
    assert "join, copy-free, buffer made ahead" in table.output
    assert "join of a lent row, buffer made ahead" in table.output
    assert "regrow, 1 row: mlx-vlm's update_and_fetch" in table.output
    assert "regrow, 2 rows: grow_kv, buffer made ahead" in table.output
    assert "the next decode write after it" in table.output
    assert "visitor joins a lone row: mlx-vlm's merge + extend" in table.output
    assert "visitor joins a lone row: the next one, into the row it freed" in table.output
    assert "the next one went into the freed row: yes" in table.output
