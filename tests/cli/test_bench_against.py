"""``apcctl bench ttft --against REF`` on the tiny model: the server of another revision runs as
``patched@REF`` from that revision's worktree beside ``patched``, turn by turn, and the ratio of
their medians is reported; an unknown REF is a usage error. Real servers; never a time threshold.

The revision is a commit of a scratch repository holding this checkout's ``server_patch`` with one
line added (it prints ``MARKER`` at start): that line in the ``patched@HEAD`` server's log, and not
in ``patched``'s, shows the server ran from the worktree. ``bench stall``'s comparison is checked
on rows as the bench writes them (its servers are the same ``BenchServer``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.cli import main

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]
MARKER = "server_patch of the revision bench --against checked out"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture()
def scratch_repo(tmp_path: Path) -> Path:
    """A repository whose HEAD holds this checkout's committed ``server_patch``, marked."""
    repo = tmp_path / "repo"
    repo.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD", "server_patch"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
    launch = repo / "server_patch" / "launch.py"
    launch.write_text(launch.read_text().replace("\nimport io\n", f"\nimport io\nprint({MARKER!r}, flush=True)\n", 1))
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "marked")
    return repo


def test_against_head_runs_both_servers_interleaved_and_reports_the_ratio(
        tiny_model_dir: Path, scratch_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(scratch_repo)
    workdir = tmp_path / "work"
    out = CliRunner().invoke(main, ["bench", "ttft", "--model", str(tiny_model_dir), "--context", "64",
                                    "--questions", "2", "--max-tokens", "2", "--repeat", "0", "--modes", "patched",
                                    "--workdir", str(workdir), "--against", "HEAD", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["modes"] == ["patched", "patched@HEAD"]
    assert result["against"]["commit"] == _git(scratch_repo, "rev-parse", "HEAD")
    assert MARKER in (workdir / "server-patched@HEAD.log").read_text()  # it ran from the worktree
    assert MARKER not in (workdir / "server-patched.log").read_text()
    for mode in result["modes"]:  # both servers served every turn, the warm ones restored
        turns = result["turns"][mode]
        assert len(turns) == 3 and all(t["restored_tokens"] > 0 for t in turns[1:])
    ttft = result["against"]["ttft_ms"]
    assert ttft["pairs"] == 2 and ttft["min"] <= ttft["max"]
    # The ratio of the warm turns' medians (the summary's medians are rounded to 0.1 ms, which can
    # move the second decimal: 1.27 against 1.28 was seen on a fresh clone).
    base, other = (statistics.median(t["ttft_ms"] for t in result["turns"][m][1:]) for m in result["modes"])
    assert ttft["ratio"] == round(other / base, 2)
    assert not list(workdir.glob("tree-*")) and str(workdir) not in _git(scratch_repo, "worktree", "list")


def test_an_unknown_revision_or_no_repository_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["bench", "ttft", "--model", str(tmp_path / "unused"), "--workdir", str(tmp_path / "work")]
    monkeypatch.chdir(REPO)
    out = CliRunner().invoke(main, [*args, "--against", "no-such-revision-xyz"])
    assert out.exit_code == 2 and "unknown revision 'no-such-revision-xyz'" in out.output
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(main, [*args, "--against", "HEAD"])
    assert out.exit_code == 2 and "not in one" in out.output
    assert not (tmp_path / "unused").exists()  # refused before any model or server


def test_stall_compares_each_scenario_and_splits_parts_only_where_both_servers_split() -> None:
    from apcctl.lab.bench.against import compare_stall, groups, stall_lines

    def row(mode: str, p50: float, worst: dict | None) -> dict:
        gaps = {"tokens": 9, "p50": p50, "p99": 2 * p50, "max": 3 * p50}
        return {"scenario": "cold-prefill", "mode": mode, "alone": gaps, "with_event": gaps, "event_ms": p50,
                "server_gaps": {"worst_gap": worst} if worst else None}

    assert groups(["stock", "patched", "patched@X"]) == [["stock"], ["patched", "patched@X"]]
    split = {"ms": 30.0, "parts": {"prefill": 20.0, "step": 10.0}}
    result = {"scenarios": ["cold-prefill"], "rows": [row("patched", 10, split), row("patched@X", 15, None)]}
    cmp = compare_stall(result, "patched@X")["scenarios"]["cold-prefill"]
    assert cmp["gap_p50"] == cmp["gap_max"] == cmp["event_ms"] == 1.5
    assert cmp["worst_gap_ms"] is None and cmp["parts_ms"] == {} and cmp["split_by"] == ["patched"]
    assert "split by patched only" in "\n".join(stall_lines(compare_stall(result, "patched@X")))
    result["rows"][1] = row("patched@X", 15, {"ms": 60.0, "parts": {"prefill": 50.0, "join": 10.0}})
    cmp = compare_stall(result, "patched@X")["scenarios"]["cold-prefill"]
    assert cmp["worst_gap_ms"] == 2.0
    assert cmp["parts_ms"] == {"join": [10, 0], "prefill": [50, 20], "step": [0, 10]}
