"""The canary as one part of the server: its book and its runner, built together.

``integration.parts.Parts`` builds one per server and hands it the traffic gate; the door
(``integration.hooks.idle``) calls ``on_idle`` from the generation loop, and the lineage
runtime asks ``refuses`` at admission. Neither ever raises.
"""

from __future__ import annotations

import logging
from typing import Any

from server_patch.infra.traffic import Traffic
from server_patch.canary.book import Book, on_fail_from_env
from server_patch.canary.runner import Runner

log = logging.getLogger("server_patch.canary")


class Canary:
    def __init__(self, book: Book, runner: Runner) -> None:
        self.book = book
        self.runner = runner

    @classmethod
    def from_env(cls, traffic: Traffic) -> "Canary":
        book = Book(on_fail=on_fail_from_env())
        return cls(book, Runner(book, traffic))

    def on_idle(self, generator: Any, runtime: Any) -> None:
        """The generation loop found nothing to do: run (a part of) a queued check on ``runtime``."""
        if runtime is None:
            return
        try:
            self.runner.on_idle(generator, runtime)
        except Exception as exc:  # never into the generation loop: its handler drops the batch
            log.warning("apc_canary idle pass failed: %s", exc)

    def refuses(self, kind: str) -> bool:
        """Whether a request must prefill ``kind`` cold (a failed check, APC_CANARY_ON_FAIL=cold)."""
        try:
            return self.book.refuses(kind)
        except Exception:  # never fails an admission
            return False
