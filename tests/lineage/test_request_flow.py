"""One request flow (``server_patch.lineage.flow``) for the server and the simulator: a short
trace served by the in-process coordinator (mlx-vlm's ResponseGenerator with the overlay, the
kilobyte model) and replayed by ``apcctl bench replay``'s lineage policy restores at the same
points, the same kinds, request by request.

The server side runs in a subprocess (the overlay must be installed before mlx-vlm is
imported, as in ``test_copyfree_batched``). It reports each request's prompt ids, the reply ids
its entry moved past (None if it stayed at the prompt end), the anchor and segment boundaries
it planned captures from, and where it restored; the simulator gets exactly those as a trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from apcctl.lab.sim.policies.lineage import LineagePolicy
from apcctl.lab.sim.sizes import load_sizes
from apcctl.lab.sim.trace import Request
from server_patch.lineage import LineageConfig
from tests.integration.test_reply_reuse import WORD, verbatim_model  # noqa: F401 (a fixture: the re-rendering template)
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(r"""
    import dataclasses, json, sys, time
    from server_patch.overlay import install
    install()
    import numpy as np
    from mlx_vlm import apc as _apc
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.server.generation import GenerationArguments, ResponseGenerator
    from server_patch.copyfree import replies
    from server_patch.integration import segments
    from server_patch.integration.coordinator import LineageCoordinator
    from server_patch.integration.pending import namespace_of, request_key
    from server_patch.integration.parts import of_server
    current = lambda: of_server().runtimes.current  # the server's open lineage runtime
    from server_patch.lineage import as_tokens

    model_dir, word = sys.argv[1], sys.argv[2]
    served, fed = [], {}
    lookup, validated = LineageCoordinator.lookup, replies.validated

    def seen_lookup(self, token_ids, **kw):
        answer = lookup(self, token_ids, **kw)
        prompt = as_tokens(token_ids)
        record = self.lineage.book.by_key(request_key(namespace_of(kw["extra_hash"]), prompt)).record
        served.append({"tokens": [int(t) for t in prompt], "namespace": namespace_of(kw["extra_hash"]),
                       "restored": record.restored_tokens if answer else 0,
                       "kind": record.restore_kind if answer else "cold",
                       "oracle": record.oracle, "lost": record.lost})
        return answer

    def seen_validated(layout, reply, batch, idx):
        ids = validated(layout, reply, batch, idx)
        if ids is not None:
            fed[reply.pending.tokens.tobytes()] = [int(t) for t in ids]
        return ids

    LineageCoordinator.lookup, replies.validated = seen_lookup, seen_validated
    rg = ResponseGenerator(model_path=model_dir, apc_manager=_apc.from_env(model_namespace="t"))
    model, processor, config = rg.wait_until_ready()
    (say,) = processor.tokenizer.encode(word, add_special_tokens=False)

    def text(n, seed):
        rng = np.random.RandomState(seed)
        words = "apple banana cherry delta echo fox golf hotel india juliet kilo lima".split()
        return " ".join(words[i] + str(int(j)) for i, j in zip(rng.randint(0, 12, n), rng.randint(0, 99, n)))

    def ask(messages):
        # The model says only `word`: its reply re-renders to the very ids it was fed.
        args = GenerationArguments(max_tokens=10, temperature=0.0, logit_bias={say: 100.0})
        _, it = rg.generate(prompt=apply_chat_template(processor, config, messages), args=args)
        out = ""
        for tok in it:
            out += tok.text
            if tok.finish_reason:
                break
        time.sleep(0.2)  # the row leaves the decoding batch: its entry moves past the reply
        return messages + [{"role": "assistant", "content": out}]

    system = {"role": "system", "content": text(40, 1)}
    convo = ask([system, {"role": "user", "content": text(80, 2)}])
    for turn in range(2):  # follow-ups that re-send each reply
        convo = ask(convo + [{"role": "user", "content": text(12, 3 + turn)}])
    for seed in (8, 9):  # new conversations, same system text: the second one restores it
        ask([system, {"role": "user", "content": text(30, seed)}])
    ask(convo[:3] + [{"role": "user", "content": text(20, 10)}])  # an edit of the second question
    ask(convo + [{"role": "user", "content": text(12, 11)}])  # back to the long conversation

    for req in served:
        info = segments.boundaries(np.asarray(req["tokens"], dtype=np.int32), of_server().finder)
        req["anchor_len"], req["segments"] = info.anchor_len, [int(s) for s in info.segments]
        req["reply"] = fed.get(np.asarray(req["tokens"], dtype=np.int32).tobytes())
    config = {k: list(v) if isinstance(v, tuple) else v
              for k, v in dataclasses.asdict(current().config).items()}
    print(json.dumps({"served": served, "config": config}))
    rg.stop_and_join()
""")


@pytest.fixture(scope="module")
def server_run(verbatim_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    tmp = tmp_path_factory.mktemp("request-flow")
    env = dict(os.environ, APC_ENABLED="1", APC_DISK_ENABLED="0", APC_LINEAGE_DISK="0",
               HF_HUB_OFFLINE="1", APC_STATE_DIR=str(tmp / "state"), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(verbatim_model), WORD], env=env, cwd=tmp,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def replayed(run: dict) -> list[tuple[int, str]]:
    """The same requests through the simulator's lineage policy, with the server's config."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in run["config"].items()}
    policy = LineagePolicy(load_sizes("tiny"), config=LineageConfig(**fields))
    points = []
    for i, req in enumerate(run["served"]):
        reply = None if req["reply"] is None else np.asarray(req["reply"], dtype=np.int32)
        served = policy.serve(Request("trace", float(i), np.asarray(req["tokens"], dtype=np.int32),
                                      anchor_len=req["anchor_len"], segments=tuple(req["segments"]),
                                      namespace=req["namespace"], index=i, reply=reply))
        points.append((served.reused, served.source.split(":")[-1]))
    return points


@pytest.mark.server
def test_the_simulator_restores_where_the_server_does(server_run):
    served = server_run["served"]
    assert len(served) == 7, [len(r["tokens"]) for r in served]
    on_server = [(r["restored"], r["kind"]) for r in served]
    assert on_server == replayed(server_run)
    # What the trace exercises: cold starts, follow-ups restored past each whole reply, the
    # shared system text restored at its divergence point, an edit restored at a prompt end.
    first, second = served[0], served[1]
    assert [restored for restored, _ in on_server].count(0) == 2  # the first two conversations
    assert first["reply"] and on_server[1] == (len(first["tokens"]) + len(first["reply"]), "entry")
    assert second["tokens"][:on_server[1][0]] == first["tokens"] + first["reply"]
    assert {kind for _, kind in on_server} >= {"cold", "entry", "divergence", "final"}, on_server


@pytest.mark.server
def test_the_live_oracle_is_the_seen_oracle_of_what_the_server_processed(server_run):
    """Issue 26: each request's oracle on the server is the seen oracle (every earlier prompt,
    and every earlier prompt + the reply it was fed) rounded down to the shadow block, and what
    it restored less is explained to the token."""
    from apcctl.lab.sim.policies.seen import SeenOraclePolicy

    block = server_run["config"]["shadow_block_tokens"]
    seen = SeenOraclePolicy()
    for i, req in enumerate(server_run["served"]):
        reply = None if req["reply"] is None else np.asarray(req["reply"], dtype=np.int32)
        bound = seen.serve(Request("trace", float(i), np.asarray(req["tokens"], dtype=np.int32),
                                   namespace=req["namespace"], index=i, reply=reply)).reused
        assert req["oracle"] == bound // block * block, (i, req["oracle"], bound)
        assert sum(req["lost"].values()) == max(0, req["oracle"] - req["restored"]), (i, req)
    assert sum(r["oracle"] > 0 for r in server_run["served"]) >= 4  # most requests share a prefix
