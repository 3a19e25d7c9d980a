"""``apcctl bench replay`` and ``apcctl bench trace-gen``: the trace-driven policy benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from server_patch.lineage import LineageConfig

DEFAULT_POLICIES = "lineage,lineage-nosegments,stock,post-baseline,periodic,oracle,seen-oracle"


@click.command("replay")
@click.argument("trace", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--policy", "policies", default=DEFAULT_POLICIES, show_default=True,
              help="Comma-separated policies: lineage, lineage-nosegments, stock, post-baseline, "
                   "periodic, oracle, seen-oracle (the bound with generated replies kept).")
@click.option("--model-config", default="full", show_default=True,
              help="'full', 'tiny' or a path to a glm5_next config.json; sizes the state.")
@click.option("--prefill-rate", type=float, default=420.0, show_default=True,
              help="Prefill tokens per second, for the time-to-first-token estimate.")
@click.option("--lineage-config", "lineage_settings", multiple=True, metavar="FIELD=VALUE",
              help="Override a LineageConfig field for the lineage policies (repeatable), "
                   "e.g. guard_tokens=1 or thin_order=stale_guard,periodic,turn,segment,guard.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def replay_cmd(trace: Path | None, policies: str, model_config: str, prefill_rate: float,
               lineage_settings: tuple[str, ...], as_json: bool) -> None:
    """Replay TRACE (default: the bundled agent trace) against cache policies with sized state."""
    from apcctl.lab.sim.policies import POLICY_NAMES
    from apcctl.lab.sim.replay import replay
    from apcctl.lab.sim.report import print_report, summarize
    from apcctl.lab.sim.sizes import load_sizes
    from apcctl.lab.sim.trace import bundled_trace_path, read_trace

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}",
                                 param_hint="--policy")
    if prefill_rate <= 0:
        raise click.BadParameter("must be > 0", param_hint="--prefill-rate")
    path = trace or bundled_trace_path()
    try:
        sizes = load_sizes(model_config)
        loaded = read_trace(path)
        lineage_config = _lineage_config(lineage_settings)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    runs = replay(loaded, names, sizes, lineage_config)
    summary = summarize(runs, loaded.in_time_order(), sizes, prefill_rate, trace_name=str(path))
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        print_report(summary, sizes)


def _lineage_config(settings: tuple[str, ...]) -> LineageConfig | None:
    """``FIELD=VALUE`` pairs parsed exactly as the server parses ``APC_LINEAGE_<FIELD>``."""
    from server_patch.lineage import LineageConfig

    if not settings:
        return None
    env = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--lineage-config {item!r}: expected FIELD=VALUE")
        env[f"APC_LINEAGE_{key.strip().upper()}"] = value.strip()
    known = {f"APC_LINEAGE_{name.upper()}" for name in LineageConfig.__dataclass_fields__}
    unknown = sorted(set(env) - known)
    if unknown:
        raise ValueError(f"unknown lineage config field(s): {', '.join(k[12:].lower() for k in unknown)}")
    return LineageConfig.from_env(env)


@click.command("trace-gen")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--scale", type=click.Choice(["full", "tiny"]), default="full", show_default=True)
@click.option("--minutes", type=float, default=30.0, show_default=True)
@click.option("--template", default=None, metavar="FILE",
              help="Render the prompts with this chat template (apcctl/templates: qwen3.jinja, glm45.jinja) "
                   "and the tiny BPE tokenizer, with the server's boundary finder (apcctl.lab.sim.tracegen_rendered); "
                   "default: the synthetic GLM-layout trace.")
@click.option("--no-system-points", is_flag=True,
              help="With --template: the finder without points inside the system text (the before).")
@click.option("--drift", is_flag=True,
              help="The drift actor (apcctl.lab.sim.drift_actor): per client change of issue 37 a first request and "
                   "the changed one (kind drift:NAME), rendered with --template (default qwen3.jinja).")
def trace_gen_cmd(out: Path, seed: int, scale: str, minutes: float, template: str | None,
                  no_system_points: bool, drift: bool) -> None:
    """Write a deterministic agent trace to OUT (JSONL, prompts stored as deltas)."""
    from apcctl.lab.sim.trace import write_trace

    if drift:
        from apcctl.lab.sim import drift_actor
        from apcctl.lab.sim.tracegen_rendered import TEMPLATES

        if (template or "qwen3.jinja") not in TEMPLATES:
            raise click.BadParameter(f"unknown {template}; known: {', '.join(TEMPLATES)}", param_hint="--template")
        requests, meta = drift_actor.generate(seed=seed, template=template or "qwen3.jinja")
    elif template is not None:
        from apcctl.lab.sim.tracegen_rendered import TEMPLATES
        from apcctl.lab.sim.tracegen_rendered import generate as generate_rendered

        if template not in TEMPLATES:
            raise click.BadParameter(f"unknown {template}; known: {', '.join(TEMPLATES)}", param_hint="--template")
        requests, meta = generate_rendered(seed=seed, template=template, system_points=not no_system_points)
    else:
        from apcctl.lab.sim.tracegen import generate

        requests, meta = generate(seed=seed, scale=scale, minutes=minutes)
    write_trace(out, requests, meta)
    tokens = sum(r.n for r in requests)
    click.echo(f"{out}: {len(requests)} requests, {tokens:,} prompt tokens, "
               f"{out.stat().st_size / 1e6:.2f} MB")


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(replay_cmd)
    bench.add_command(trace_gen_cmd)
