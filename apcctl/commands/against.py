"""The ``--against REF`` option of ``bench ttft`` and ``bench stall`` (``apcctl.lab.bench.against``).

Not a command module (it is not listed in MODULES): the option and its error boundary, shared.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import click

if TYPE_CHECKING:
    from apcctl.lab.bench.against import Against

against_option: Callable[[Callable[..., Any]], Callable[..., Any]] = click.option(
    "--against", "against_ref", metavar="REF", default=None,
    help="Also run mode patched@REF: the server of git revision REF of this repository (a detached "
         "worktree in the workdir, removed afterwards), interleaved with patched; prints both and "
         "the ratio of their medians.")


@contextmanager
def against_tree(ref: str | None, workdir: Path) -> Iterator["Against | None"]:
    """None without ``--against``; else REF's worktree (an unknown REF, or a working directory
    outside a git repository, is a usage error: exit 2, nothing checked out)."""
    from apcctl.lab.bench.against import AgainstError, resolve, worktree

    if ref is None:
        yield None
        return
    try:
        resolve(ref)
    except AgainstError as exc:
        raise click.BadParameter(str(exc), param_hint="--against") from None
    with worktree(ref, workdir) as against:
        yield against
