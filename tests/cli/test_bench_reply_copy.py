"""``python -m apcctl.lab.bench.reply_copy``: the bytes each copy moves, on the bench preset's shapes.

Times are the bench's output, never asserted; what is checked is that it copies what it says:
the whole row, only the reply's rows, and the merge in the number of slices it names.
"""

from __future__ import annotations

from apcctl.lab.bench import reply_copy


def test_the_bench_times_the_row_copy_the_append_and_the_merge_on_their_own_bytes():
    out = reply_copy.run(context=300, reply=20, slice_rows=128, repeat=1)
    per_token = out["kv_bytes_per_token"]
    assert per_token > 30_000  # the bench preset: ~32 KiB of latent + index rows per token
    assert out["row_copy_bytes"] == per_token * 320 and out["append_bytes"] == per_token * 20
    assert out["merge_slices"] == 3 and out["merge_bytes"] == per_token * 300
    assert all(out[k]["min"] <= out[k]["median"] <= out[k]["max"] for k in ("row_copy_ms", "append_ms", "merge_ms"))


def test_apcctl_bench_copies_prints_the_copies_side_by_side():
    import json

    from click.testing import CliRunner

    from apcctl.cli import main

    done = CliRunner().invoke(main, ["bench", "copies", "--context", "300", "--reply", "20", "--slice", "128",
                                     "--repeat", "1"])
    assert done.exit_code == 0, done.output
    assert "whole row (before)" in done.output and "reply rows only (now)" in done.output
    assert "merge in 3 slices of 128 rows" in done.output
    as_json = CliRunner().invoke(main, ["bench", "copies", "--context", "300", "--reply", "20", "--repeat", "1",
                                        "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["append_bytes"] == 20 * 32770
    assert CliRunner().invoke(main, ["bench", "copies", "--reply", "0"]).exit_code == 2
