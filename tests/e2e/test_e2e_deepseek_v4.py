"""deepseek_v4 through the real patched server, with the lineage on, as it is.

Its own cold prefill depends on where a prompt is split (``server_patch.state.splits``): the
server says so once at start, naming the family, serves restores (entry, anchor), and the
canary's check of those restores passes with the family's measured split term
(``server_patch.canary.compare.SPLIT_RTOL``) that a split-invariant family does not get.
"""

from __future__ import annotations

import pytest

from tests.server_harness import PatchedServer, cached_tokens, reply_text, text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from apcctl.lab.tinymodel.servable import build_family_dir

    model_dir = build_family_dir("deepseek_v4", tmp_path_factory.mktemp("ds4") / "model")
    srv = PatchedServer(model_dir, env={"TOP_LOGPROBS_K": "5"}, log_dir=tmp_path_factory.mktemp("e2e-ds4"))
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.server
def test_served_warned_once_and_its_restores_pass_the_canary(server):
    system = {"role": "system", "content": text(200, 1)}
    messages = [system, {"role": "user", "content": text(60, 2)}]
    first = server.chat(messages, tenant="ds4", max_tokens=4)
    messages += [{"role": "assistant", "content": reply_text(first)}, {"role": "user", "content": text(40, 3)}]
    warm = server.chat(messages, tenant="ds4", max_tokens=4)
    session = server.chat([system, {"role": "user", "content": text(50, 4)}], tenant="ds4", max_tokens=4)
    kinds = [line["kind"] for line in server.lineage_lines("restore")]
    assert kinds[0] == "cold" and kinds[1] in ("entry", "final") and kinds[2] == "anchor", kinds
    assert cached_tokens(warm) > 250 and cached_tokens(session) > 150

    warnings = [line for line in server.log_text().splitlines()
                if "WARNING: deepseek_v4 is served with the lineage cache on" in line]
    assert len(warnings) == 1, warnings  # at start, not again when the runtime is built
    assert "split at the restore point" in warnings[0]

    status, answer = server.admin("POST", "/verify", {})
    assert status == 200, answer
    failed = [r for r in answer["results"] if r["result"] != "pass"]
    assert answer["results"] and answer["complete"] and not failed, failed
    assert all(r["tolerance"] > 0.4 for r in answer["results"])  # the family's split term is in
