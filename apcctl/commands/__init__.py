"""Command modules. Each module defines ``register(main, bench)`` and is listed here.

A module is imported only when one of its commands runs (or ``--help`` lists them): ``COMMANDS``
and ``BENCH_COMMANDS`` say which module defines which command, so ``apcctl --version`` and
``apcctl status --help`` load neither numpy, mlx nor the server (``tests/cli/test_cli_startup.py``).
A module in ``MODULES`` missing from both maps still works, registered eagerly.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import click

# Module names under apcctl.commands; add yours here (and its commands to COMMANDS / BENCH_COMMANDS).
MODULES: tuple[str, ...] = ("bench_lookup", "model", "patch", "bench_replay", "profile", "bench_attention",
                           "serve", "status", "entries", "anchors", "requests", "ops", "restart", "report", "demo",
                           "bench_ttft", "top", "check", "service", "verify", "fleet", "bench_templates", "bench_splits",
                           "config_show", "forget", "bench_stall", "bench_copies", "bench_fleet_roll", "bench_spec")
# Top-level command -> the module that registers it.
COMMANDS: dict[str, str] = {
    "model": "model", "patch": "patch", "profile": "profile", "serve": "serve", "stop": "serve", "logs": "ops",
    "status": "status", "entries": "entries", "anchors": "anchors", "requests": "requests", "drain": "ops",
    "flush": "ops", "undrain": "ops", "restart": "restart", "report": "report", "demo": "demo", "top": "top",
    "check": "check", "service": "service", "verify": "verify", "fleet": "fleet", "config": "config_show",
    "forget": "forget",
}
# ``apcctl bench`` subcommand -> its module.
BENCH_COMMANDS: dict[str, str] = {
    "lookup": "bench_lookup", "replay": "bench_replay", "trace-gen": "bench_replay", "attention": "bench_attention",
    "ttft": "bench_ttft", "fleet": "fleet", "templates": "bench_templates", "splits": "bench_splits",
    "stall": "bench_stall", "copies": "bench_copies", "fleet-roll": "bench_fleet_roll",
    "spec": "bench_spec",
}

_GROUPS: list[click.Group] = []  # main and bench, once register_all has run
_LOADED: set[str] = set()


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (click's documented lazy-loading hook)."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, str] = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            load(self.lazy[cmd_name])
        return self.commands.get(cmd_name)


def load(name: str) -> None:
    """Import command module ``name`` and let it add its commands to main and bench (once)."""
    if name in _LOADED:
        return
    _LOADED.add(name)
    importlib.import_module(f"apcctl.commands.{name}").register(*_GROUPS)


def load_all() -> None:
    """Every command module (for code that walks ``main.commands``)."""
    for name in MODULES:
        load(name)


def register_all(main: click.Group, bench: click.Group) -> None:
    _GROUPS[:] = [main, bench]
    mapped = {*COMMANDS.values(), *BENCH_COMMANDS.values()}
    for group, lazy in ((main, COMMANDS), (bench, BENCH_COMMANDS)):
        if isinstance(group, LazyGroup):
            group.lazy.update({name: module for name, module in lazy.items() if module in MODULES})
        else:
            mapped = set()  # a plain group: everything now
    for name in MODULES:
        if name not in mapped:
            load(name)
