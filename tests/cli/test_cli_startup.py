"""``apcctl`` starts fast: a command module is imported only when one of its commands runs, and
the commands that do not need numpy, mlx or mlx-vlm never load them (measured with
``python -X importtime``: ``--version`` went from 1.2-2.5 s to well under 0.1 s)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from apcctl.commands import BENCH_COMMANDS, COMMANDS, MODULES

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "mlx", "mlx_vlm")


def loaded_after(*args: str) -> list[str]:
    """The top-level packages loaded by ``apcctl ARGS`` in a fresh interpreter."""
    code = ("import sys, json\nfrom apcctl.cli import main\n"
            "try:\n    main(sys.argv[1:], prog_name='apcctl')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--version"], ["status", "--help"], ["restart", "--help"], ["forget", "--help"]])
def test_these_commands_load_neither_numpy_nor_mlx(args: list[str]) -> None:
    loaded = loaded_after(*args)
    assert not set(HEAVY) & set(loaded), loaded


def test_version_loads_no_command_module() -> None:
    loaded = loaded_after("--version")
    assert not {"rich", "psutil", "server_patch"} & set(loaded), loaded


def test_the_lazy_maps_name_every_command_of_every_module() -> None:
    """What each module registers is what COMMANDS and BENCH_COMMANDS say (no command missing
    from ``apcctl --help``, none loaded from the wrong module)."""
    registered: dict[str, str] = {}
    bench_registered: dict[str, str] = {}
    for name in MODULES:
        main, bench = click.Group("main"), click.Group("bench")
        importlib.import_module(f"apcctl.commands.{name}").register(main, bench)
        registered.update({command: name for command in main.commands})
        bench_registered.update({command: name for command in bench.commands})
    assert registered == COMMANDS
    assert bench_registered == BENCH_COMMANDS
