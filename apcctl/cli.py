"""The ``apcctl`` command line: one click group; each command family lives in its own module,
imported only when one of its commands runs (``apcctl.commands.LazyGroup``)."""

from __future__ import annotations

import click

from apcctl.commands import LazyGroup
from apcctl.commands.codes import EXIT_CODES_HELP
from apcctl.commands.complete import SuggestingGroup


class Group(SuggestingGroup, LazyGroup):
    """Commands imported on first use, and a mistyped one answered with the closest names."""


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_HELP)
@click.version_option(package_name="apcctl")
def main() -> None:
    """Run and inspect the lineage prompt cache of a patched mlx-vlm server."""


@main.group(cls=Group)
def bench() -> None:
    """Benchmarks that print ratios measured side by side in one run."""


def _register() -> None:
    """Attach command modules; each exposes click commands and never imports the server."""
    from apcctl.commands import register_all

    register_all(main, bench)


_register()


if __name__ == "__main__":  # ``python -m apcctl.cli``: what launchd/systemd run (no PATH needed)
    main(prog_name="apcctl")
