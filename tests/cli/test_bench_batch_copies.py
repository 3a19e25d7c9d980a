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
