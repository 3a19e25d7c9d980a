"""The copy ledger the serving path calls: counts and deltas, and no debug tool behind it."""

from __future__ import annotations

import json
import subprocess
import sys

from server_patch.observe.ledger import CopyLedger, delta


def test_the_ledger_counts_by_op_and_kind_only_while_on(tmp_path):
    ledger = CopyLedger()
    ledger.add("merge", 100)
    assert not ledger.enabled() and ledger.snapshot() == {} and ledger.mark() is None
    assert ledger.since(ledger.mark()) == {}  # off: a request's record carries no copies

    file = tmp_path / "copies.json"
    ledger.switch_on(file)
    ledger.add("merge", 100)
    ledger.add("merge", 28, kind="kv")
    ledger.add("extract", 7, kind="state")
    ledger.add("clone", 0)  # nothing copied: no key
    assert ledger.enabled()
    assert ledger.snapshot() == {"merge.kv": 128, "extract.state": 7}
    assert json.loads(file.read_text()) == {"extract.state": 7, "merge.kv": 128}

    before = ledger.mark()
    ledger.add("extract", 5, kind="state")
    ledger.add("anchor", 9)
    assert ledger.since(before) == {"extract.state": 5, "anchor.kv": 9}
    assert before == {"merge.kv": 128, "extract.state": 7}  # a mark is a copy, not a view

    ledger.reset()
    assert ledger.snapshot() == {} and json.loads(file.read_text()) == {}


def test_delta_keeps_only_what_changed():
    assert delta({"a.kv": 5, "b.kv": 3, "c.state": 1}, {"a.kv": 5, "b.kv": 1}) == {"b.kv": 2, "c.state": 1}


def test_the_serving_path_imports_the_ledger_not_the_instrumentation():
    code = (
        "import sys\n"
        "import server_patch.observe.ledger\n"
        "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_vlm')))\n"
        "assert not bad, bad\n"
        "import server_patch.state.rows, server_patch.integration.timings\n"
        "assert 'server_patch.copyfree.counter' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
