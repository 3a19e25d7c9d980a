"""Start a server with the copy counter on: ``python -m server_patch.copyfree.counted [server args]``.

Exactly ``python -m server_patch.launch`` (stock with ``APC_LINEAGE=0``, patched otherwise),
except that ``server_patch.copyfree.counter`` wraps mlx-vlm's copying cache operations first,
so stock and patched servers are counted the same way. Totals go to ``APC_COPY_COUNTER_FILE``
(JSON, rewritten after every counted copy). For measurement only: the copy-on-write probe
evaluates every cache write.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from server_patch.launch import lineage_enabled
    from server_patch.launch import main as launch_main

    if lineage_enabled():
        from server_patch.overlay import PatchError, install

        try:
            install()  # before the counter imports mlx_vlm; the launcher's install is then a no-op
        except PatchError as exc:
            raise SystemExit(f"server_patch.copyfree.counted: {exc}") from exc
    from server_patch.copyfree import counter

    counter.install()
    launch_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
