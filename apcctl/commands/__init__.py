"""Command modules. Each module defines ``register(main, bench)`` and is listed here."""

from __future__ import annotations

import importlib

import click

# Module names under apcctl.commands; add yours here.
MODULES: tuple[str, ...] = ("bench_lookup", "model", "patch", "bench_replay", "profile", "bench_attention",
                           "serve", "status", "entries", "anchors", "requests", "ops", "restart", "report", "demo",
                           "bench_ttft", "top", "check", "service", "verify", "fleet", "bench_templates",
                           "config_show")


def register_all(main: click.Group, bench: click.Group) -> None:
    for name in MODULES:
        importlib.import_module(f"apcctl.commands.{name}").register(main, bench)
