"""Read the package's data files (templates, word lists) as text, from a checkout or a wheel."""

from __future__ import annotations

from importlib import resources


def read_data(name: str) -> str:
    """The text of ``data/<name>`` inside this package, via ``importlib.resources``."""
    return resources.files(__package__).joinpath("data", name).read_text(encoding="utf-8")
