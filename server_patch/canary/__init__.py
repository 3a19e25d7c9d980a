"""A live correctness canary: while idle, the server proves its restores equal a cold prefill.

* ``points``: which restore points to check (an entry's head and checkpoints, anchors, files);
* ``check``: restore through ``CacheLayout.build`` (a request's path), prefill the same tokens
  cold, compare next-token logits (``compare``: tolerance by dtype);
* ``runner``: runs checks on the generation thread between loop turns, only while idle, and
  abandons them at the next chunk boundary when a request arrives; the optional schedule;
* ``book``: results, counters, suspect restore kinds (``APC_CANARY_ON_FAIL=cold``);
* ``metrics``: the Prometheus families; ``faults``: test-only corruption.

The overlay calls ``on_idle``; the coordinator asks ``refuses``. Neither ever raises.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("server_patch.canary")


def on_idle(generator: Any) -> None:
    """The generation loop found nothing to do: run (a part of) a queued check."""
    try:
        from server_patch.canary.runner import RUNNER
        from server_patch.integration import runtime as lineage_runtime

        current = lineage_runtime.current()
        if current is not None:
            RUNNER.on_idle(generator, current)
    except Exception as exc:  # never into the generation loop: its handler drops the batch
        log.warning("apc_canary idle pass failed: %s", exc)


def refuses(kind: str) -> bool:
    """Whether a request must prefill ``kind`` cold (a failed check, APC_CANARY_ON_FAIL=cold)."""
    try:
        from server_patch.canary.book import BOOK

        return BOOK.refuses(kind)
    except Exception:  # never fails an admission
        return False
