"""What ``apcctl restart`` starts: the recorded command with what the operator changed since.

The config table is read again (its budget keys replace the ones it gave at the last start, and
a key taken out of it goes back to the server's default), then ``restart -e KEY=VALUE`` and
``--model`` apply on top, as they would on ``serve``. A key the last start had from ``-e`` or
the shell keeps beating the config table, as at ``serve``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from apcctl.core.manage import ServerSpec

SECRET_MARKS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


@dataclass(frozen=True)
class Changes:
    """The operator's changes for one server's next start."""

    config_env: dict[str, str] = field(default_factory=dict)  # the config table's budget variables now
    env: dict[str, str] = field(default_factory=dict)  # restart -e KEY=VALUE
    model: str | None = None  # restart --model

    @property
    def explicit(self) -> bool:
        """Changes a supervisor's installed unit cannot take (it reads the config itself)."""
        return bool(self.env) or self.model is not None


def respec(spec: ServerSpec, changes: Changes) -> ServerSpec:
    """``spec`` with ``changes`` applied (nothing else of it moves: port, host, disk path)."""
    env, from_config = dict(spec.env), dict(spec.config_env)
    for key in [k for k in from_config if k not in changes.config_env]:
        env.pop(key, None)
        del from_config[key]
    for key, value in changes.config_env.items():
        if key in from_config or key not in env:
            env[key] = from_config[key] = value
    for key, value in changes.env.items():
        env[key] = value
        from_config.pop(key, None)
    argv, model = list(spec.argv), spec.model
    if changes.model is not None:
        local = Path(changes.model).expanduser()
        model = str(local.resolve()) if local.exists() else changes.model
        at = argv.index("--model") + 1
        argv[at] = model
    if (argv, env, model) == (spec.argv, spec.env, spec.model):
        return spec
    return replace(spec, argv=argv, env=env, model=model, config_env=from_config, created=time.time())


def overridden(new: ServerSpec, changes: Changes) -> dict[str, tuple[str, str]]:
    """``{variable: (config value, value in force)}`` for each config-table key that does not
    apply to ``new`` (``respec``'s result) because the last start had the variable from ``-e``
    or its shell, which keeps beating the table: said in the plan, or the operator's change to
    the table silently does nothing (issue 36). Keys ``-e`` sets now are what was asked."""
    return {key: (value, new.env[key]) for key, value in changes.config_env.items()
            if key not in new.config_env and key not in changes.env and key in new.env and new.env[key] != value}


def override_notes(new: ServerSpec, changes: Changes, config_path: Path | None) -> list[str]:
    """``ram_budget = 1G in config.toml is overridden by ...``: one line per ``overridden`` key."""
    from apcctl.core.config_keys import BUDGET_KEYS, PATH_KEYS, SERVING_KEYS

    keys = {v: k for k, v in {**BUDGET_KEYS, **SERVING_KEYS, **PATH_KEYS}.items()}
    where = config_path.name if config_path else "the config file"
    return [f"{keys.get(variable, variable)} = {shown(variable, wanted)} in {where} is overridden by "
            f"{variable}={shown(variable, in_force)} from the last serve (-e or its shell); restart -e "
            f"{variable}={shown(variable, wanted)} to change it"
            for variable, (wanted, in_force) in overridden(new, changes).items()]


def shown(key: str, value: str | None) -> str:
    if value is None:
        return "(unset)"
    return "***" if any(mark in key.upper() for mark in SECRET_MARKS) else value


def difference(old: ServerSpec, new: ServerSpec) -> list[str]:
    """One line per change: the model, each changed argument list, each changed variable."""
    lines = []
    if old.model != new.model:
        lines.append(f"model: {old.model} -> {new.model}")
    elif old.argv != new.argv:
        lines.append(f"command: {' '.join(old.argv)} -> {' '.join(new.argv)}")
    for key in sorted({*old.env, *new.env}):
        before, after = old.env.get(key), new.env.get(key)
        if before != after:
            lines.append(f"{key}: {shown(key, before)} -> {shown(key, after)}")
    return lines


@dataclass(frozen=True)
class Respecified:
    """One managed server whose next start differs from its record: ``new`` is saved as its
    ``server.json`` for the roll; ``restore`` puts ``old`` back if the new one never ran."""

    name: str
    old: ServerSpec
    new: ServerSpec

    def lines(self) -> list[str]:
        return difference(self.old, self.new)

    def restore(self) -> None:
        from apcctl.core.manage import ManagedServer

        managed = ManagedServer(self.name)
        running = managed.running_spec()
        if managed.spec() == self.new and (running is None or running.argv != self.new.argv
                                           or running.env != self.new.env):
            managed.save(self.old)
