"""The drift actor's cases through the server's own finder, template and tokenizer, offline:
each change is named as the case says (the real server does it in tests/e2e/test_e2e_drift.py),
and ``apcctl bench trace-gen --drift`` writes them as a trace."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.lab.sim import drift_actor
from apcctl.lab.sim.tracegen_rendered import _Renderer
from server_patch.drift import DriftDetector


@pytest.mark.parametrize("template", ["qwen3.jinja", "glm45.jinja"])
def test_each_case_is_named_through_the_finder(template: str) -> None:
    renderer = _Renderer(template, system_points=True)
    template_facts = renderer.finder.template
    detector = DriftDetector()
    decode = lambda ids: renderer.tokenizer.decode([int(i) for i in ids])  # noqa: E731
    named = {}
    for case in drift_actor.cases():
        for step, (messages, tools) in enumerate(((case.first, case.tools),
                                                  (case.then(drift_actor.SYNTHETIC_REPLY), case.then_tools or case.tools))):
            kwargs = {"tools": tools or [], "add_generation_prompt": True}
            template_facts.note(renderer.apply, renderer.tokenizer, "qwen3", kwargs)
            tokens, info = renderer.request(messages, tools or [])
            found = detector.observe(tokens, case.name, kinds=info.kinds, gen_start=template_facts.gen_start(tokens),
                                     decode=decode)
            if step == 0:
                assert found == {}, (case.name, found)
                reply = renderer.tokenizer.encode(drift_actor.SYNTHETIC_REPLY, add_special_tokens=False)
                detector.observe_reply(np.concatenate([tokens, reply]), case.name, len(tokens))
        named[case.name] = (found.get("cause"), found.get("segment", ""))
        # exact on qwen3 too, which draws the tools inside the system turn and the last
        # assistant message with <think> tags (the finder's labels: tools_end, rejoin)
        assert found.get("cause") == case.cause and found["segment"] == case.segment, (case.name, found)
    assert len(named) == len(drift_actor.cases())


def test_trace_gen_writes_the_drift_actor(tmp_path) -> None:
    out = tmp_path / "drift.jsonl"
    result = CliRunner().invoke(main, ["bench", "trace-gen", "--drift", str(out)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [line.get("kind") for line in lines[1:]]
    assert kinds.count("new_session") == len(drift_actor.cases())
    assert {k for k in kinds if k.startswith("drift:")} == {f"drift:{c.name}" for c in drift_actor.cases()}
